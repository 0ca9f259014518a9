#!/usr/bin/env bash
# What a session lent a CUDA machine runs there (see NOTES.md, "GPU"): the tests marked cuda, then the GPU
# benchmark tables. Each part has its own time limit so that one hang cannot cost the others; logs go to
# $OUT (the device tool's return folder) or ./gpu-check-out. Wheels the machine lacks (dp-accounting,
# dm-tree, opacus) are read from .whl/ when that folder exists (NOTES.md says how to fill it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
{ nvidia-smi -L; python3 -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/machine.txt"
SECONDS=0
timeout -k 5 "${TESTS_S:-170}" python3 -m pytest -q -m cuda tests -p no:cacheprovider --continue-on-collection-errors \
    -o addopts="" -rfE --durations=5 2>&1 | tee "$OUT/pytest_cuda.txt" | tail -60
echo "gpu-check: cuda tests ended at ${SECONDS}s"
timeout -k 5 "${BENCH_S:-200}" python3 benchmarks/bench_gpu.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_gpu.txt"
echo "gpu-check: benchmarks ended at ${SECONDS}s"
