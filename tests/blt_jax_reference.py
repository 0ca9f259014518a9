"""Records JAX Privacy's optimised BLT strategies, their loss and sensitivity, for tests/test_blt.py.

Run with JAX Privacy installed (in a throwaway environment: jax is no dependency of this project):

    python3 -m venv /tmp/jaxvenv && /tmp/jaxvenv/bin/pip install jax jax-privacy
    /tmp/jaxvenv/bin/python tests/blt_jax_reference.py

It writes tests/blt_jax_reference.json: for each case (n steps, min-sep participation with at most k
participations, d buffers) the BLT ``jax_privacy.matrix_factorization.buffered_toeplitz.optimize_loss``
returns for the mean squared error of the prefix sums (``LossFn.build_min_sep(error="mean")``), its
buffer decays and output scales, its unpenalised loss (mean error x sensitivity^2), the sensitivity^2, the
mean error, and the wall time of the optimisation on this machine; the file names the versions.
"""

from __future__ import annotations

import json
import pathlib
import time
from importlib.metadata import version

#: (n, min_sep, max_participations (None: ceil(n / min_sep)), num_buffers)
CASES = [
    (64, 1, 1, 2),
    (200, 20, None, 3),
    (512, 64, None, 4),
    (1000, 100, None, 3),
    (1000, 1, 1, 4),
    (2000, 250, None, 5),
]


def jax_case(n: int, min_sep: int, max_participations: int | None, num_buffers: int) -> dict[str, object]:
    import jax

    jax.config.update("jax_enable_x64", True)
    from jax_privacy.matrix_factorization import buffered_toeplitz as bt

    loss_fn = bt.LossFn.build_min_sep(n=n, error="mean", min_sep=min_sep, max_participations=max_participations)
    bt.optimize_loss(loss_fn=loss_fn, num_buffers=num_buffers)  # compile once, not timed
    start = time.perf_counter()
    blt, loss = bt.optimize_loss(loss_fn=loss_fn, num_buffers=num_buffers)
    seconds = time.perf_counter() - start
    inverse = blt.inverse()
    return {
        "n": n,
        "min_sep": min_sep,
        "max_participations": max_participations,
        "num_buffers": num_buffers,
        "buf_decay": [float(x) for x in blt.buf_decay],
        "output_scale": [float(x) for x in blt.output_scale],
        "inverse_buf_decay": [float(x) for x in inverse.buf_decay],
        "inverse_output_scale": [float(x) for x in inverse.output_scale],
        "loss": float(loss),
        "sensitivity_squared": float(loss_fn.sensitivity_squared(blt)),
        "mean_error": float(loss_fn.error_for_inv(inverse)),
        "toeplitz_coefficients_first_8": [float(x) for x in blt.toeplitz_coefs(8)],
        "optimize_seconds": seconds,
    }


def main() -> None:
    cases = [jax_case(*case) for case in CASES]
    record = {
        "generated_by": "tests/blt_jax_reference.py",
        "jax_privacy": version("jax-privacy"),
        "jax": version("jax"),
        "error": "mean",
        "cases": cases,
    }
    path = pathlib.Path(__file__).with_name("blt_jax_reference.json")
    path.write_text(json.dumps(record, indent=1) + "\n")
    for case in cases:
        print(case["n"], case["min_sep"], case["num_buffers"], case["loss"], f"{case['optimize_seconds']:.2f}s")


if __name__ == "__main__":
    main()
