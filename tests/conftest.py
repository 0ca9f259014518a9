"""Shared test helpers: the independent per-example reference and the ``cuda`` marker.

The reference never touches ``GradSampleModule`` or ``torch.func``: it deep-copies the model and, for
each example alone, runs an ordinary forward and backward, so it is the definition of a per-example
gradient rather than another implementation of it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence

import pytest
import torch
from torch import nn

RTOL = 1e-6
ATOL = 1e-10


def pytest_collection_modifyitems(config: pytest.Config, items: Sequence[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def take_example(value, index: int, batch_dim: int):
    """Example ``index`` of ``value`` with its batch dimension kept (size 1); non-tensors unchanged."""
    if isinstance(value, torch.Tensor):
        return value.narrow(batch_dim, index, 1)
    return value


def per_example_reference(
    model: nn.Module,
    args: Sequence,
    loss_of: Callable[[object, int], torch.Tensor],
    *,
    kwargs: Mapping[str, object] | None = None,
    batch_dim: int = 0,
    kwarg_batch_dims: Mapping[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Parameter name -> ``(batch, *param.shape)`` stack of each example's own gradient.

    For example ``i`` the (deep-copied) model runs on example ``i`` alone (every tensor argument
    narrowed to ``i`` along ``batch_dim``, or along ``kwarg_batch_dims[name]`` for a keyword
    argument), ``loss_of(output, i)`` gives that example's loss, and ``backward()`` gives its
    gradient. Parameters that receive no gradient from an example get zeros. Frozen parameters are
    left out. Names are those of ``model.named_parameters()`` (tied parameters appear once).
    """
    kwargs = dict(kwargs or {})
    kwarg_batch_dims = dict(kwarg_batch_dims or {})
    reference = copy.deepcopy(model)
    batch_size = next(a for a in args if isinstance(a, torch.Tensor)).shape[batch_dim]
    trainable = [(name, p) for name, p in reference.named_parameters() if p.requires_grad]
    stacks: dict[str, list] = {name: [] for name, _ in trainable}
    for index in range(batch_size):
        reference.zero_grad(set_to_none=True)
        example_args = [take_example(a, index, batch_dim) for a in args]
        example_kwargs = {
            name: take_example(value, index, kwarg_batch_dims.get(name, batch_dim)) for name, value in kwargs.items()
        }
        loss_of(reference(*example_args, **example_kwargs), index).backward()
        for name, param in trainable:
            grad = torch.zeros_like(param) if param.grad is None else param.grad.detach().clone()
            stacks[name].append(grad)
    return {name: torch.stack(grads) for name, grads in stacks.items()}


def assert_matches_reference(model: nn.Module, reference: Mapping[str, torch.Tensor]) -> None:
    """Every trainable parameter's ``grad_sample`` equals the reference (rtol 1e-6), and only those."""
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert set(trainable) == set(reference)
    for name, param in trainable.items():
        assert getattr(param, "grad_sample", None) is not None, f"{name} has no grad_sample"
        torch.testing.assert_close(
            param.grad_sample, reference[name], rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.fixture
def restore_sampler_registry():
    """Undo every registration a test makes (samplers, plugins loaded) when the test ends."""
    from grad_samplers import registry

    tables = (registry.GRAD_SAMPLERS, registry.NORM_SAMPLERS, registry.WEIGHTED_SUM_SAMPLERS)
    saved = [dict(table) for table in tables]
    plugins_loaded = registry._plugins_loaded
    yield registry
    for table, contents in zip(tables, saved):
        table.clear()
        table.update(contents)
    registry._plugins_loaded = plugins_loaded


_MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def module_fingerprint(model: nn.Module) -> dict:
    """Everything a wrapper could leave behind on ``model``: per submodule its ``__dict__`` keys, its
    hook tables and whether ``forward`` is overridden on the instance; per parameter its ``__dict__``
    keys and whether it carries tensor hooks. Two fingerprints are equal iff nothing was left."""
    modules = {}
    for path, module in model.named_modules(remove_duplicate=False):
        modules[path] = {
            "dict_keys": sorted(module.__dict__),
            "hooks": {name: dict(getattr(module, name, {}) or {}) for name in _MODULE_HOOK_DICTS},
            "forward": module.__dict__.get("forward"),
            "parameters": [(name, id(p)) for name, p in module._parameters.items()],
        }
    parameters = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        parameters[name] = {
            "dict_keys": sorted(param.__dict__),
            "tensor_hooks": bool(param._backward_hooks),
            "post_accumulate_hooks": bool(param._post_accumulate_grad_hooks),
        }
    global_hooks = {
        name: dict(getattr(torch.nn.modules.module, name))
        for name in dir(torch.nn.modules.module)
        if name.startswith("_global_") and isinstance(getattr(torch.nn.modules.module, name), dict)
    }
    return {"modules": modules, "parameters": parameters, "global_hooks": global_hooks}


def run_rank_job(worker, world_size: int, out, time_limit_s: float) -> tuple[list[dict], list[str], list[int]]:
    """Spawn ``world_size`` processes ``python worker RANK WORLD_SIZE OUT`` (gloo on loopback, one thread each),
    wait at most ``time_limit_s`` (then kill them all and fail: the test always ends), and return what each rank
    wrote to ``OUT/rank{r}.pt`` (read with ``weights_only=True``), the ranks' logs and their exit codes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    processes = [
        subprocess.Popen([sys.executable, str(worker), str(rank), str(world_size), str(out)], env=env, cwd=root,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(world_size)
    ]  # fmt: skip
    logs = []
    try:
        for process in processes:
            logs.append(process.communicate(timeout=time_limit_s)[0])
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        pytest.fail(f"the job of {world_size} ranks ({Path(worker).name}) did not end within {time_limit_s} s")
    results = []
    for rank in range(world_size):
        path = Path(out) / f"rank{rank}.pt"
        assert path.exists(), f"rank {rank} wrote nothing:\n{logs[rank][-3000:]}"
        results.append(torch.load(path, weights_only=True))
    return results, logs, [process.returncode for process in processes]


def pytest_collection_finish(session: pytest.Session) -> None:
    """A test module that changes torch's default dtype when imported would change every test after it."""
    if torch.get_default_dtype() != torch.float32:
        raise pytest.UsageError(
            f"torch's default dtype is {torch.get_default_dtype()} after collection: a test module sets it at import "
            "(set it inside the test or the worker's main instead)"
        )


@pytest.fixture(autouse=True)
def _default_dtype_left_as_found():
    """Fail a test that leaves torch's default dtype changed (and restore it, so later tests are unaffected)."""
    before = torch.get_default_dtype()
    yield
    after = torch.get_default_dtype()
    if after != before:
        torch.set_default_dtype(before)
        pytest.fail(f"the test left torch's default dtype at {after} (was {before})")
