"""Shared pieces of the benchmarks: the three reference workloads, their data, a timer and a
peak-memory probe.

Workloads (the issue's definitions; every benchmark script builds its models from here so that
numbers from different scripts describe the same models):

===========  =======================================================================  =====
name         model                                                                    batch
===========  =======================================================================  =====
mlp          Linear 784-512-512-10 with ReLU                                          256
cnn          Conv2d(1,16,8,s2,p3)-tanh-MaxPool(2,1)-Conv2d(16,32,4,s2)-tanh-           256
             MaxPool(2,1)-Linear(512,32)-tanh-Linear(32,10) on 1x28x28
transformer  Embedding(8000,128) + 2-layer TransformerEncoder (d 128, 4 heads, ff 256,   64
             batch_first, default dropout 0.1) + mean-pool + Linear(128,2), sequence 64
hf-decoder   GPT-2 from a config (no download): 2 layers, hidden 64, 4 heads,            8
             vocabulary 1024, sequence 32, dropout off; next-token loss (token mean)
===========  =======================================================================  =====

``WORKLOADS`` holds the first three (every benchmark runs them); ``ALL_WORKLOADS`` adds ``hf-decoder``.

Each workload has a *skeleton* (``skeleton_of``): the same layers with every width 4, for measuring a
step's fixed cost (Python, dispatch, hooks) with negligible arithmetic.

Timing (``time_interleaved``): the variants being compared are run round-robin, so that a burst of
load from other processes on a shared machine hits every variant alike; in each round every variant
runs one untimed step and then its timed step, so that the timed step follows a step of its own
kind, as in training. Each variant's result is the median wall time over the timed rounds after
warm-up rounds; the process's CPU time per step is recorded too.

Peak memory (``peak_memory_increase``):

- on CPU, the peak *resident set size* growth of the process during steady-state steps: after
  warm-up steps (one-time allocations: optimizer state, thread pools, library workspaces) the
  kernel's high-water mark is reset (``/proc/self/clear_refs``), the resident size is read, the
  steps run, and the result is ``VmHWM - VmRSS_before``. Everything the step touches counts
  (tensors, autograd buffers, library scratch space), so it is what an out-of-memory killer sees.
  Run it in a fresh process per variant (``run_python_json``) with ``MALLOC_MMAP_THRESHOLD_`` set
  (``MEMORY_CHILD_ENV``) so that glibc returns every large block to the kernel when it is freed;
  otherwise freed memory stays resident and the "before" reading would hide the next step's peak.
- on CUDA, ``torch.cuda.max_memory_allocated`` growth over the memory allocated before the steps
  (tensor bytes held by the caching allocator's clients).

The step functions handed to these helpers must leave nothing behind between steps (call
``zero_grad(set_to_none=True)``, which also drops per-sample gradients, at the end of a step), so
that the "before" reading holds only parameters and optimizer state.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

CPU = torch.device("cpu")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Batch = tuple[torch.Tensor, torch.Tensor]

# Blocks of 64 KiB and more are mmap-ed (and unmapped when freed): RSS then follows live memory.
MEMORY_CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


# ---------------------------------------------------------------------------------- workloads
@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model, its data and its loss: one row of a benchmark table."""

    name: str
    description: str
    batch_size: int
    build_model: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], Batch]

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {self.batch_size}")

    @staticmethod
    def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (every workload is a classifier; ``loss_reduction="mean"``)."""
        return F.cross_entropy(outputs, targets)


def build_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def build_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=2, padding=3),
        nn.Tanh(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2),
        nn.Tanh(),
        nn.MaxPool2d(2, 1),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        nn.Tanh(),
        nn.Linear(32, 10),
    )


class MeanPoolTransformer(nn.Module):
    """Token ids -> embedding -> TransformerEncoder -> mean over positions -> class logits."""

    def __init__(
        self,
        *,
        vocab_size: int = 8000,
        d_model: int = 128,
        num_heads: int = 4,
        feedforward: int = 256,
        num_layers: int = 2,
        num_classes: int = 2,
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        layer = nn.TransformerEncoderLayer(d_model, num_heads, feedforward, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.classifier = nn.Linear(d_model, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(self.embedding(tokens)).mean(dim=1))


def build_transformer() -> nn.Module:
    return MeanPoolTransformer()


def _image_batch(batch_size: int, generator: torch.Generator) -> Batch:
    images = torch.randn(batch_size, 1, 28, 28, generator=generator)
    return images, torch.randint(0, 10, (batch_size,), generator=generator)


def _flat_image_batch(batch_size: int, generator: torch.Generator) -> Batch:
    images, labels = _image_batch(batch_size, generator)
    return images.flatten(1), labels


TRANSFORMER_SEQUENCE_LENGTH = 64


def _token_batch(batch_size: int, generator: torch.Generator) -> Batch:
    tokens = torch.randint(0, 8000, (batch_size, TRANSFORMER_SEQUENCE_LENGTH), generator=generator)
    return tokens, torch.randint(0, 2, (batch_size,), generator=generator)


WORKLOADS: dict[str, Workload] = {
    "mlp": Workload(
        name="mlp",
        description="MLP 784-512-512-10, batch 256",
        batch_size=256,
        build_model=build_mlp,
        make_batch=_flat_image_batch,
    ),
    "cnn": Workload(
        name="cnn",
        description="CNN 2xConv2d + 2xLinear on 1x28x28, batch 256",
        batch_size=256,
        build_model=build_cnn,
        make_batch=_image_batch,
    ),
    "transformer": Workload(
        name="transformer",
        description="Embedding + 2-layer TransformerEncoder, seq 64, batch 64",
        batch_size=64,
        build_model=build_transformer,
        make_batch=_token_batch,
    ),
}


# ---------------------------------------------------------------------------------- small HF decoder
# The small Hugging Face decoder people fine-tune on CPU in tests and tutorials (issue 25): GPT-2 built from
# a config (no download), 2 layers, hidden 64, 4 heads, vocabulary 1024, sequence 32, dropout off (every
# variant then computes the same function), next-token loss averaged over all tokens of the batch.
HF_DECODER_SEQUENCE_LENGTH = 32
HF_DECODER_VOCAB = 1024


class CausalLMLogits(nn.Module):
    """An HF causal LM called as ``model(input_ids=...)``, returning its logits as ``(B, vocab, T)`` so that
    ``F.cross_entropy(outputs, targets)`` with ``targets`` of shape ``(B, T)`` is the token-mean loss (every
    example has the same number of tokens, so it is also the mean over examples of each example's loss)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits.transpose(1, 2)


def build_hf_decoder(
    *, hidden: int = 64, heads: int = 4, layers: int = 2, vocab: int = HF_DECODER_VOCAB,
    positions: int = HF_DECODER_SEQUENCE_LENGTH,
) -> nn.Module:  # fmt: skip
    import transformers  # only this workload needs it

    config = transformers.GPT2Config(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=positions,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return CausalLMLogits(transformers.GPT2LMHeadModel(config))


def _next_token_batch(
    batch_size: int, generator: torch.Generator, *, vocab: int = HF_DECODER_VOCAB, length: int = HF_DECODER_SEQUENCE_LENGTH
) -> Batch:
    tokens = torch.randint(0, vocab, (batch_size, length + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ---------------------------------------------------------------------------------- skeletons
# A workload's skeleton: the same layers in the same order, every width 4 (vocabularies 16), the same batch
# size and sequence length, so that the arithmetic is negligible and a step's time is its fixed cost:
# Python, dispatch, hooks, bookkeeping. Used for the "python overhead per step" column of bench_dp_step.
SKELETON_WIDTH = 4
SKELETON_VOCAB = 16


def build_mlp_skeleton() -> nn.Module:
    w = SKELETON_WIDTH
    return nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))


def build_deep_mlp_skeleton(depth: int) -> nn.Module:
    """``depth`` Linear(4, 4) layers with ReLU between them (the fixed cost as a function of depth)."""
    layers: list[nn.Module] = []
    for index in range(depth):
        layers += [nn.Linear(SKELETON_WIDTH, SKELETON_WIDTH)] + ([nn.ReLU()] if index < depth - 1 else [])
    return nn.Sequential(*layers)


def _small_flat_batch(batch_size: int, generator: torch.Generator) -> Batch:
    inputs = torch.randn(batch_size, SKELETON_WIDTH, generator=generator)
    return inputs, torch.randint(0, SKELETON_WIDTH, (batch_size,), generator=generator)


def _cnn_skeleton_batch(batch_size: int, generator: torch.Generator) -> Batch:
    images = torch.randn(batch_size, 1, 12, 12, generator=generator)
    return images, torch.randint(0, SKELETON_WIDTH, (batch_size,), generator=generator)


def build_cnn_skeleton() -> nn.Module:
    w = SKELETON_WIDTH  # 1x12x12 -> 4x6x6 -> 4x5x5 -> 4x2x2 -> 4x1x1
    return nn.Sequential(
        nn.Conv2d(1, w, 2, stride=2), nn.Tanh(), nn.MaxPool2d(2, 1), nn.Conv2d(w, w, 2, stride=2), nn.Tanh(),
        nn.MaxPool2d(2, 1), nn.Flatten(), nn.Linear(w, w), nn.Tanh(), nn.Linear(w, w),
    )  # fmt: skip


def _token_skeleton_batch(batch_size: int, generator: torch.Generator) -> Batch:
    tokens = torch.randint(0, SKELETON_VOCAB, (batch_size, TRANSFORMER_SEQUENCE_LENGTH), generator=generator)
    return tokens, torch.randint(0, 2, (batch_size,), generator=generator)


def _next_token_skeleton_batch(batch_size: int, generator: torch.Generator) -> Batch:
    return _next_token_batch(batch_size, generator, vocab=SKELETON_VOCAB)


def skeleton_of(workload: Workload) -> Workload:
    """``workload``'s skeleton (same layers, widths 4, same batch size): see ``SKELETON_WIDTH``."""
    w, vocab = SKELETON_WIDTH, SKELETON_VOCAB
    builders: dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.Generator], Batch]]] = {
        "mlp": (build_mlp_skeleton, _small_flat_batch),
        "cnn": (build_cnn_skeleton, _cnn_skeleton_batch),
        "transformer": (
            lambda: MeanPoolTransformer(vocab_size=vocab, d_model=w, num_heads=1, feedforward=w),
            _token_skeleton_batch,
        ),
        "hf-decoder": (lambda: build_hf_decoder(hidden=w, heads=1, vocab=vocab), _next_token_skeleton_batch),
    }
    if workload.name not in builders:
        raise ValueError(f"no skeleton for workload {workload.name!r}; choose from {sorted(builders)}")
    build_model, make_batch = builders[workload.name]
    return Workload(
        name=f"{workload.name}-skeleton",
        description=f"{workload.name} skeleton (widths {w}), batch {workload.batch_size}",
        batch_size=workload.batch_size,
        build_model=build_model,
        make_batch=make_batch,
    )


def deep_mlp_skeleton(depth: int, batch_size: int) -> Workload:
    """``build_deep_mlp_skeleton(depth)`` as a workload of ``batch_size`` examples."""
    return Workload(
        name=f"mlp{depth}-skeleton",
        description=f"{depth} x Linear(4, 4), batch {batch_size}",
        batch_size=batch_size,
        build_model=functools.partial(build_deep_mlp_skeleton, depth),
        make_batch=_small_flat_batch,
    )


#: The reference workloads plus the ones only ``bench_dp_step.py`` runs by default.
ALL_WORKLOADS: dict[str, Workload] = {
    **WORKLOADS,
    "hf-decoder": Workload(
        name="hf-decoder",
        description=f"GPT-2 2 layers, hidden 64, vocab {HF_DECODER_VOCAB}, seq {HF_DECODER_SEQUENCE_LENGTH}, batch 8",
        batch_size=8,
        build_model=build_hf_decoder,
        make_batch=_next_token_batch,
    ),
}


#: GPT-2 small (124M parameters: 12 layers, hidden 768, 12 heads, vocabulary 50257) built from its config,
#: sequence 128, dropout off: the GPU benchmark's language model (too slow for the CPU tables).
GPT2_SMALL_SEQUENCE_LENGTH = 128


def gpt2_small(batch_size: int = 16) -> Workload:
    """GPT-2 small (``GPT2_SMALL_SEQUENCE_LENGTH`` tokens, next-token loss) with ``batch_size`` examples."""
    return Workload(
        name="gpt2-small",
        description=f"GPT-2 small 124M, seq {GPT2_SMALL_SEQUENCE_LENGTH}, batch {batch_size}",
        batch_size=batch_size,
        build_model=functools.partial(
            build_hf_decoder, hidden=768, heads=12, layers=12, vocab=50257, positions=GPT2_SMALL_SEQUENCE_LENGTH
        ),
        make_batch=functools.partial(_next_token_batch, vocab=50257, length=GPT2_SMALL_SEQUENCE_LENGTH),
    )


def get_workload(name: str, batch_size: int | None = None) -> Workload:
    """The workload called ``name`` (``ALL_WORKLOADS``), with ``batch_size`` examples if given."""
    try:
        workload = ALL_WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(ALL_WORKLOADS)}") from None
    if batch_size is None or batch_size == workload.batch_size:
        return workload
    description = workload.description.rsplit(", batch ", 1)[0] + f", batch {batch_size}"
    return dataclasses.replace(workload, batch_size=batch_size, description=description)


# ---------------------------------------------------------------------------------- machine
def use_all_cores() -> int:
    """Set torch's intra-op threads to the cores this process may run on; return that number."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    return cores


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------- timing
@dataclass(frozen=True, kw_only=True)
class Timing:
    """Wall and CPU times of one variant's steps, in seconds.

    CPU time is the process's user + system time (all its threads): on a machine shared with other
    work it is far less disturbed than wall time, which counts time spent waiting for a core.
    """

    samples: tuple[float, ...]
    cpu_samples: tuple[float, ...] = ()
    #: CPU time of the calling thread alone: with one torch thread, the step's critical path even while
    #: helper threads (a background noise draw) run beside it on another core.
    thread_cpu_samples: tuple[float, ...] = ()

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples)

    @property
    def median_ms(self) -> float:
        return 1000.0 * self.median_s

    @property
    def median_cpu_ms(self) -> float:
        return 1000.0 * statistics.median(self.cpu_samples) if self.cpu_samples else float("nan")

    @property
    def median_thread_cpu_ms(self) -> float:
        return 1000.0 * statistics.median(self.thread_cpu_samples) if self.thread_cpu_samples else float("nan")

    @property
    def spread(self) -> float:
        """(upper quartile - lower quartile) / median of the wall times: a rough noise gauge."""
        if len(self.samples) < 4:
            return float("nan")
        quartiles = statistics.quantiles(self.samples, n=4)
        return (quartiles[2] - quartiles[0]) / self.median_s


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_interleaved(
    steps: Mapping[str, Callable[[], None]],
    *,
    repeats: int,
    warmup: int,
    settle_steps: int = 1,
    device: torch.device = CPU,
) -> dict[str, Timing]:
    """Median wall time per step of each variant, the variants run round-robin.

    ``warmup`` rounds are run first and discarded, then ``repeats`` timed rounds. In each round
    every variant runs ``settle_steps`` untimed steps and then one timed step, so that the timed
    step follows a step of its own kind, as in training: a step that directly follows another
    variant's can pay for that variant's memory traffic (on virtual machines with free-page
    reporting, memory another variant just freed in bulk is handed back to the host and faulted in
    again at its next use, costing the next step several times its own work). Each step is timed
    alone (device synchronised before and after on CUDA).
    """
    if repeats < 1 or warmup < 0 or settle_steps < 0:
        raise ValueError(f"need repeats >= 1, warmup >= 0, settle_steps >= 0; got {repeats}, {warmup}, {settle_steps}")
    for _ in range(warmup):
        for step in steps.values():
            step()
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    thread_cpu: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            for _ in range(settle_steps):
                step()
            synchronize(device)
            start, start_cpu, start_thread = time.perf_counter(), _cpu_seconds(), time.thread_time()
            step()
            synchronize(device)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(_cpu_seconds() - start_cpu)
            thread_cpu[name].append(time.thread_time() - start_thread)
    return {
        name: Timing(samples=tuple(wall[name]), cpu_samples=tuple(cpu[name]), thread_cpu_samples=tuple(thread_cpu[name]))
        for name in steps
    }


def median_time(step: Callable[[], None], *, repeats: int, warmup: int, device: torch.device = CPU) -> Timing:
    """``time_interleaved`` for a single step function (no settling steps: nothing to settle from)."""
    return time_interleaved({"step": step}, repeats=repeats, warmup=warmup, settle_steps=0, device=device)["step"]


def reference_matmul_ms(size: int = 1024, repeats: int = 5) -> float:
    """Median milliseconds of one ``size x size`` float32 matmul on CPU: a machine-speed probe.

    Printed before and after a benchmark run: if the two differ much, the machine's speed changed
    during the run (other jobs, a throttled virtual machine) and the run's numbers are suspect.
    """
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(size, size, generator=generator)
    matrix @ matrix  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matrix @ matrix
        times.append(time.perf_counter() - start)
    return 1000.0 * statistics.median(times)


# ---------------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def peak_memory_increase(
    step: Callable[[], None], *, steps: int = 3, warmup: int = 2, device: torch.device = CPU
) -> int:
    """Peak memory (bytes) a steady-state step needs above what is held between steps.

    See the module docstring for what is measured on CPU (RSS) and on CUDA (allocated bytes).
    On CPU, raises if the kernel's high-water mark cannot be reset (the number would be wrong).
    """
    for _ in range(warmup):
        step()
    synchronize(device)
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(steps):
            step()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    if not _reset_high_water_mark():
        raise RuntimeError("cannot reset the RSS high-water mark (/proc/self/clear_refs not writable)")
    before_kib = _status_kib("VmRSS")
    for _ in range(steps):
        step()
    return 1024 * (_status_kib("VmHWM") - before_kib)


def run_python_json(args: Sequence[str], *, env: Mapping[str, str] | None = None, timeout_s: float = 600) -> dict:
    """Run ``python args...`` from the repository root in a fresh process; parse its last stdout line
    as JSON. Used to measure each variant's memory in a process of its own."""
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = REPO_ROOT + os.pathsep + child_env.get("PYTHONPATH", "")
    child_env.update(env or {})
    done = subprocess.run(
        [sys.executable, *args],
        check=False,
        cwd=REPO_ROOT,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        raise RuntimeError(f"child {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------- script scaffolding
def set_threads(threads: int | None) -> int:
    """Use ``threads`` torch threads (None: every core, ``use_all_cores``); return the number used."""
    if threads is None:
        return use_all_cores()
    torch.set_num_threads(threads)
    return threads


def runnable_variants(requested: Sequence[str], *, opacus_installed: bool) -> list[str]:
    """``requested`` without the Opacus variants when Opacus is missing, and with ``plain`` first when
    it was left out (every ratio needs it)."""
    variants = [v for v in requested if opacus_installed or not v.startswith("opacus")]
    if "plain" not in variants:
        variants.insert(0, "plain")
    return variants


def versions(opacus_module: object | None, *, threads: int | None = None, missing: str = "not installed") -> str:
    """``torch X[, N threads], opacus Y`` (or ``opacus <missing>``): the start of a benchmark's header."""
    text = f"torch {torch.__version__}" + (f", {threads} threads" if threads is not None else "")
    return text + (f", opacus {opacus_module.__version__}" if opacus_module is not None else f", opacus {missing}")


def peak_mib_in_children(variants: Sequence[str], before: list[str], after: list[str]) -> dict[str, float]:
    """Each variant's peak memory growth in MiB, measured by ``python *before variant *after`` in a
    fresh process (``MEMORY_CHILD_ENV``) that prints ``{"peak_bytes": ...}`` last."""
    return {
        variant: run_python_json([*before, variant, *after], env=MEMORY_CHILD_ENV)["peak_bytes"] / 2**20
        for variant in variants
    }


def training_step(
    module: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, inputs: tuple, targets: torch.Tensor
) -> Callable[[], None]:
    """A closure running one step on a fixed batch: ``loss_fn(module(*inputs), targets)``, backward,
    ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)`` (methods looked up at each call, so
    a profiler may patch them afterwards)."""

    def step() -> None:
        loss_fn(module(*inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def opacus_step(
    model: nn.Module, sgd: torch.optim.Optimizer, inputs: tuple, targets: torch.Tensor, *, mode: str,
    loss_fn: Callable, batch_size: int, noise_multiplier: float, max_grad_norm: float,
) -> Callable[[], None]:  # fmt: skip
    """One Opacus 1.6 DP-SGD step of ``model`` on a fixed batch (``make_private`` without Poisson
    sampling): ``mode`` "hooks", or "ghost" (its criterion wrapper: two backward passes; the loss is
    its cross-entropy, not ``loss_fn``). The loader is built on ``inputs[0]`` and ``targets``."""
    from opacus import PrivacyEngine as OpacusPrivacyEngine

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs[0], targets), batch_size=batch_size)
    engine = OpacusPrivacyEngine(accountant="rdp")
    settings = {"module": model, "optimizer": sgd, "data_loader": loader, "noise_multiplier": noise_multiplier,
                "max_grad_norm": max_grad_norm, "poisson_sampling": False}  # fmt: skip
    if mode == "hooks":
        wrapped, optimizer, _ = engine.make_private(**settings, grad_sample_mode="hooks")
        return training_step(wrapped, optimizer, loss_fn, inputs, targets)
    if mode != "ghost":
        raise ValueError(f"unknown Opacus mode {mode!r}; choose 'hooks' or 'ghost'")
    wrapped, optimizer, criterion, _ = engine.make_private(
        **settings, criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost"
    )
    return training_step(wrapped, optimizer, criterion, inputs, targets)  # both backward passes


def render_table(lines: list[list[str]]) -> str:
    """Rows of cells as a text table: columns padded to their widest cell, a rule under the header."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    rendered = [" | ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in lines]
    rendered.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(rendered)


__all__ = [
    "ALL_WORKLOADS",
    "CPU",
    "MEMORY_CHILD_ENV",
    "WORKLOADS",
    "MeanPoolTransformer",
    "Timing",
    "Workload",
    "build_cnn",
    "build_deep_mlp_skeleton",
    "build_hf_decoder",
    "build_mlp",
    "build_transformer",
    "deep_mlp_skeleton",
    "get_workload",
    "gpt2_small",
    "median_time",
    "opacus_step",
    "peak_memory_increase",
    "peak_mib_in_children",
    "reference_matmul_ms",
    "render_table",
    "run_python_json",
    "runnable_variants",
    "set_threads",
    "skeleton_of",
    "synchronize",
    "time_interleaved",
    "training_step",
    "use_all_cores",
    "versions",
]
