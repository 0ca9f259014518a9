"""torchvision's own models (built by their constructors, ``weights=None``, after ``fix_module``) in hooks and
ghost mode, each exact against a float64 per-example loop or refused with an error naming the layer.

torchvision is not in the test virtual environment: the registry has only CUDA-linked wheels, and
transformers probes for torchvision, so it lives in ``.venv/opacus-suite-site`` (``pip install --no-deps
--target .venv/opacus-suite-site -r tests/opacus_suite/requirements.txt``; ``.ci/run`` does it before the
tests). Each model runs in a fresh process with that folder on ``PYTHONPATH`` (this file run as a script),
so nothing else in the test session sees torchvision. Its compiled extension does not load with the CPU
torch build; the two operator schemas torchvision's import registers fake kernels for (``nms``, ``qnms``,
never called by these models) are defined first (``tests/torchvision_without_extension.py``, shared with the Opacus suite's conftest).

The reference is the per-example loop: each example alone through a copy of the model, float64.

- hooks: ``GradSampleModule``; error = max over parameters of ``||grad_sample - reference||`` divided by the
  norm of the whole per-example reference;
- ghost: ``GhostClippingModule`` with the bound at the median per-example norm; error = the larger of the
  per-example norms' relative error and the clipped sum's (relative to the clipped sum's norm).

Dropout and stochastic depth are set to p=0 (a per-example loop cannot replay the batch's random masks);
the models stay in training mode.

    PYTHONPATH=.venv/opacus-suite-site:. python tests/test_torchvision_models.py resnet18 mobilenet_v3_small
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / ".venv" / "opacus-suite-site"
EXACT = 1e-6
#: name -> (constructor keywords, batch, image side): small inputs, every model's own layers.
MODELS = {
    "resnet18": ({}, 3, 32),
    "mobilenet_v3_small": ({}, 3, 32),
    "efficientnet_b0": ({}, 2, 32),
    "shufflenet_v2_x0_5": ({}, 3, 32),
    "squeezenet1_1": ({}, 3, 48),
}
RESULT_PREFIX = "RESULT "


# ---------------------------------------------------------------------------------------- the tests
if __name__ != "__main__":
    import pytest

    # One process runs every model (~5 s of it is importing torch, torchvision and the engine; ~15-25 s in
    # all on 2 cores): slow-marked, run by .ci/run's slow step.
    pytestmark = pytest.mark.slow

    @pytest.fixture(scope="module")
    def results() -> dict:
        if not (SITE / "torchvision").is_dir():
            pytest.skip(
                f"torchvision is not installed in {SITE}: pip install --no-deps --target {SITE} -r "
                "tests/opacus_suite/requirements.txt (.ci/run does it before the tests)"
            )
        environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SITE), str(ROOT)]))
        completed = subprocess.run(
            [sys.executable, __file__, *MODELS],
            check=False,
            capture_output=True,
            text=True,
            timeout=900,
            env=environment,
            cwd=ROOT,
        )
        lines = [line for line in completed.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
        assert completed.returncode == 0 and len(lines) == 1, completed.stdout + completed.stderr
        return json.loads(lines[0][len(RESULT_PREFIX) :])

    @pytest.mark.parametrize("name", list(MODELS))
    def test_torchvision_model_is_exact_in_hooks_and_ghost_mode(results: dict, name: str) -> None:
        result = results[name]
        assert result["problems"] == [], result  # fix_module left nothing in the way
        assert result["batchnorms_left"] == 0, result
        assert result["default_mode"] == "ghost", result  # make_private's "auto" on a CNN with samplers
        for mode in ("hooks", "ghost"):
            assert result[mode]["refused"] is None, result[mode]["refused"]
            assert result[mode]["error"] <= EXACT, (mode, result[mode])
            assert result[mode]["compared"] == result["trainable"] > 0, result  # every parameter compared

    @pytest.mark.parametrize("mode", ["hooks", "ghost"])
    def test_unfixed_resnet18_is_refused_naming_the_batchnorm_and_fix_module(results: dict, mode: str) -> None:
        message = results["unfixed"][mode]
        assert message.startswith("UnsupportedModuleError"), message
        assert "'bn1' is BatchNorm2d" in message and "'layer4.1.bn2' is BatchNorm2d" in message, message
        assert "privacy_engine.fix_module(model)" in message, message


# ---------------------------------------------------------------------------------------- the worker
def _without_randomness(model):
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) or type(module).__name__ == "StochasticDepth":
            module.p = 0.0
    return model


def _loss(model, images, labels):
    import torch

    return torch.nn.functional.cross_entropy(model(images), labels)


def _reference(model, images, labels):
    import torch

    reference = copy.deepcopy(model)
    trainable = [(name, p) for name, p in reference.named_parameters() if p.requires_grad]
    stacks = {name: [] for name, _ in trainable}
    for index in range(len(images)):
        reference.zero_grad(set_to_none=True)
        _loss(reference, images[index : index + 1], labels[index : index + 1]).backward()
        for name, param in trainable:
            stacks[name].append(torch.zeros_like(param) if param.grad is None else param.grad.detach().clone())
    return {name: torch.stack(grads) for name, grads in stacks.items()}


def _hooks(model, images, labels, reference):
    import torch

    from privacy_engine import GradSampleModule

    model = copy.deepcopy(model)
    _loss(GradSampleModule(model), images, labels).backward()
    total = torch.cat([g.flatten(1) for g in reference.values()], dim=1).norm()
    errors = [
        float((p.grad_sample - reference[n]).norm() / total) for n, p in model.named_parameters() if n in reference
    ]
    return max(errors), len(errors)


def _ghost(model, images, labels, reference):
    import torch

    from privacy_engine import GhostClippingModule, PerSampleGradientClipper

    model = copy.deepcopy(model)
    norms = torch.cat([g.flatten(1) for g in reference.values()], dim=1).norm(dim=1)
    bound = float(norms.median())
    clipper = PerSampleGradientClipper([p for p in model.parameters() if p.requires_grad], max_grad_norm=bound)
    wrapped = GhostClippingModule(model, clipper=clipper)
    _loss(wrapped, images, labels).backward()
    norm_error = float(((wrapped.last_per_sample_norms.flatten() - norms).abs() / norms).max())
    clipper.pre_step()
    factors = (bound / norms).clamp(max=1.0)
    expected = {name: torch.einsum("b,b...->...", factors, g) for name, g in reference.items()}
    scale = torch.cat([e.flatten() for e in expected.values()]).norm()
    errors = [float((p.grad - expected[n]).norm() / scale) for n, p in model.named_parameters() if n in expected]
    return max([norm_error, *errors]), len(errors)


def _attempt(function, *args) -> dict:
    try:
        error, compared = function(*args)
    except Exception as problem:  # noqa: BLE001  (reported to the test, which shows it)
        return {"refused": f"{type(problem).__name__}: {problem}", "error": None, "compared": 0}
    return {"refused": None, "error": error, "compared": compared}


def _refusal(build) -> str | None:
    try:
        build()
    except Exception as problem:  # noqa: BLE001  (reported to the test)
        return f"{type(problem).__name__}: {problem}"
    return None


def run_model(torchvision, name: str) -> dict:
    """Build ``name`` with torchvision's constructor, fix it, and compare both modes with the loop."""
    import torch

    from privacy_engine import fix_module
    from privacy_engine.engine.mode_choice import choose_grad_sample_mode
    from privacy_engine.engine.options import PrivacyOptions

    keywords, batch, side = MODELS[name]
    torch.manual_seed(0)
    model, report = fix_module(getattr(torchvision.models, name)(weights=None, num_classes=5, **keywords))
    model = _without_randomness(model).double().train()
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, side, side, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 5, (batch,), generator=generator)
    reference = _reference(model, images, labels)
    return {
        "problems": [str(problem) for problem in report.problems],
        "batchnorms_left": sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()),
        "trainable": len(reference),
        "default_mode": choose_grad_sample_mode(
            model, PrivacyOptions(max_grad_norm=1.0, noise_multiplier=1.0), distributed=False
        ).mode,
        "hooks": _attempt(_hooks, model, images, labels, reference),
        "ghost": _attempt(_ghost, model, images, labels, reference),
    }


def main(names: list[str]) -> dict:
    """Every model in ``names``, and the refusals of resnet18 without ``fix_module``."""
    import torch

    from torchvision_without_extension import import_torchvision_without_extension

    library = import_torchvision_without_extension()  # noqa: F841  (kept alive while torchvision runs)
    import torchvision

    from privacy_engine import GhostClippingModule, GradSampleModule, PerSampleGradientClipper

    torch.set_num_threads(1)  # a fresh process of its own: its thread count is not the test session's
    results = {name: run_model(torchvision, name) for name in names}
    unfixed = torchvision.models.resnet18(weights=None)
    clipper = PerSampleGradientClipper(list(unfixed.parameters()), max_grad_norm=1.0)
    results["unfixed"] = {
        "hooks": _refusal(lambda: GradSampleModule(unfixed)),
        "ghost": _refusal(lambda: GhostClippingModule(unfixed, clipper=clipper)),
    }
    return results


if __name__ == "__main__":
    print(RESULT_PREFIX + json.dumps(main(sys.argv[1:])))
