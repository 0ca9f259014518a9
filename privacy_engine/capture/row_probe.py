"""The row check's instruments (``capture.independence``): forward hooks that fingerprint every module's
input and output rows on a sub-batch and compare them with the same rows of the full batch
(``RowProbe``), the forwards run with every hook switched off (``without_forward_hooks``), and random ops
made deterministic so two forwards can be compared (``DeterministicRandom``)."""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch
from torch import nn
from torch.nn.modules import module as module_globals
from torch.nn.utils.rnn import PackedSequence
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from privacy_engine.models.validation import module_label

__all__ = ["DeterministicRandom", "RowMismatch", "RowProbe", "without_forward_hooks"]


class RowMismatch(Exception):
    """Stops the comparing forward at the first module whose rows disagree (``RowProbe.problem`` says why)."""


class RowProbe:
    """Forward hooks on every module: record a fingerprint of each module's inputs and outputs on the
    sub-batch, then compare them with the same rows on the full batch, in call order.

    Where the examples must sit: at dim 0 in a batch-first wrapper for the inputs and outputs of the layers
    the engine computes per-example gradients of (``hooked``: it reads the examples there), unless the layer
    declares its own layout (``batch_first``: ``nn.MultiheadAttention``, recurrent layers, which the engine
    follows) or sits inside a module that declares one (``layer_dims``: the dim the engine reads for each
    instrumented module, ``capture.batch_size.declared_batch_dims``); anywhere for other modules (a
    container may work time-major internally), as long as one dim holds them.

    An instrumented module whose output has the same shape for the sub-batch as for the full batch, with
    the full batch's size at the dim the engine reads, does not hold the examples there (T5's relative
    position bias ``(q_len, k_len, heads)`` when ``q_len`` equals the batch size): refused, since reading
    that axis as the examples would clip positions instead of examples.
    """

    def __init__(self, modules, batch_dim: int, batch_size: int, rows: torch.Tensor, hooked: set[str],
                 layer_dims: dict[str, int] | None = None) -> None:  # fmt: skip
        self.modules = modules
        self.batch_dim = batch_dim
        self.batch_size = batch_size
        self.rows = rows
        # Batch-first wrappers only: with batch_first=False some layers still read dim 0 (cells, conv, embeddings).
        layer_dims = layer_dims or {}
        self.fixed_dim = {
            path: layer_dims.get(path, 0)
            for path, module in modules
            if batch_dim == 0 and path in hooked and _declares_layout(module) is None
        }
        self.events: list[tuple[str, str, list]] = []
        self.position = 0
        self.problem: str | None = None

    @contextlib.contextmanager
    def recording(self):
        """Context: hooks that record a fingerprint of every module's input and output rows (the sub-batch
        forward); removed on exit."""
        with self._hooks(self._record):
            yield

    @contextlib.contextmanager
    def comparing(self):
        """Context: hooks that compare every module's rows with those recorded, in call order (the full-batch
        forward); the first disagreement sets ``problem`` and raises ``RowMismatch``. Removed on exit."""
        self.position = 0
        with self._hooks(self._compare):
            yield

    @contextlib.contextmanager
    def _hooks(self, on_event):
        handles = []
        try:
            for path, module in self.modules:
                handles.append(module.register_forward_pre_hook(
                    lambda m, a, k, path=path: on_event("input", path, (a, k)), with_kwargs=True, prepend=True))
                handles.append(module.register_forward_hook(lambda m, a, o, path=path: on_event("output", path, o)))
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _record(self, kind: str, path: str, value) -> None:
        leaves = _tensor_leaves(value)
        rows = len(self.rows)
        # One fingerprint per dim that could hold the sub-batch's examples (the comparison picks one).
        prints = [(tuple(t.shape), {d: _fingerprint(t, d) for d in range(t.dim()) if t.shape[d] == rows}) for t in leaves]
        self.events.append((kind, path, prints))

    def _compare(self, kind: str, path: str, value) -> None:
        if self.position >= len(self.events) or self.events[self.position][:2] != (kind, path):
            expected = self.events[self.position][1] if self.position < len(self.events) else None
            modules = dict(self.modules)
            ran = "nothing" if expected is None else module_label(expected, modules.get(expected))
            self._stop(
                f"the forward runs different modules on a sub-batch than on the full batch "
                f"({module_label(path, modules.get(path))} where the sub-batch ran {ran}): its control "
                f"flow depends on the batch as a whole, so examples interact."
            )
        recorded = self.events[self.position][2]
        self.position += 1
        leaves = _tensor_leaves(value)
        if len(leaves) != len(recorded):
            # Optional tensors that depend on the data, not on other examples (Hugging Face drops an attention
            # mask with nothing padded): nothing to align here; the module's output is still compared.
            return
        for full, (sub_shape, sub_prints) in zip(leaves, recorded):
            if tuple(full.shape) == sub_shape:
                fixed = self.fixed_dim.get(path)
                if kind == "output" and fixed is not None and full.dim() > fixed and full.shape[fixed] == self.batch_size:
                    self._stop(_unbatched_output_problem(module_label(path, dict(self.modules).get(path)),
                                                         tuple(full.shape), self.batch_size, len(self.rows), fixed))  # fmt: skip
                continue  # not a tensor of the batch (a mask, position ids, a scalar)
            dim = self._examples_dim(tuple(full.shape), sub_shape, path)
            if dim is None:
                self._stop(_shape_problem(kind, module_label(path, dict(self.modules).get(path)), tuple(full.shape),
                                          sub_shape, self.batch_size, len(self.rows), self.fixed_dim.get(path)))
            if not _same_rows(_fingerprint(full.index_select(dim, self.rows), dim), sub_prints.get(dim), full.dtype):
                self._stop(_value_problem(kind, path, self.modules))

    def _examples_dim(self, full_shape: tuple, sub_shape: tuple, path: str) -> int | None:
        """The dim holding the examples: the only one where the shapes differ, B for the full batch and the
        sub-batch's size for the sub-batch (and the layer's fixed dim, where the engine reads them there)."""
        if len(full_shape) != len(sub_shape):
            return None
        differing = [d for d, (a, b) in enumerate(zip(full_shape, sub_shape)) if a != b]
        if len(differing) != 1:
            return None
        dim = differing[0]
        if full_shape[dim] != self.batch_size or sub_shape[dim] != len(self.rows):
            return None
        fixed = self.fixed_dim.get(path)
        return dim if fixed is None or fixed == dim else None

    def _stop(self, problem: str):
        self.problem = problem
        raise RowMismatch(problem)


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called", "_global_forward_pre_hooks")


@contextlib.contextmanager
def without_forward_hooks(modules, keep: frozenset[int] = frozenset()):
    """The check's forwards run without the forward hooks of the model, the engine and the user (global ones
    included): they are not training forwards, and a hook (logging activations, registering gradient hooks)
    must see only those. The probe's own hooks go on the emptied dicts. ``keep``: the ids of hooks
    (``RemovableHandle.id``) left in place (the engine's per-example loss hooks, for a pass that must return
    what the real forward returned)."""
    saved = [(module, {name: getattr(module, name) for name in _HOOK_DICTS}) for _, module in modules]
    saved_global = {name: getattr(module_globals, name) for name in _GLOBAL_HOOK_DICTS}
    try:
        for module, hooks in saved:
            for name, value in hooks.items():
                setattr(module, name, OrderedDict((key, hook) for key, hook in value.items() if key in keep))
        for name in _GLOBAL_HOOK_DICTS:
            setattr(module_globals, name, OrderedDict())
        yield
    finally:
        for module, hooks in saved:
            for name, value in hooks.items():
                setattr(module, name, value)
        for name, value in saved_global.items():
            setattr(module_globals, name, value)


def _tensor_leaves(value) -> list[torch.Tensor]:
    """The tensors of a module's inputs or outputs, except a PackedSequence's (its examples are interleaved
    along one dim: no rows to compare; the module that packs and unpacks it is compared instead)."""
    value = tree_map(lambda v: None if isinstance(v, PackedSequence) else v, value, is_leaf=lambda v: isinstance(v, PackedSequence))
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _declares_layout(module: nn.Module) -> bool | None:
    declared = getattr(module, "batch_first", None)
    return declared if isinstance(declared, bool) else None


def _fingerprint(tensor: torch.Tensor, dim: int) -> torch.Tensor | None:
    """Per row (example): sum, sum of |x|, sum of x^2 and a sum with fixed irregular weights, in float64."""
    if tensor.dim() <= dim or tensor.shape[dim] == 0 or tensor.is_sparse or tensor.is_complex() or tensor.is_nested:
        return None  # (not compared: no rows to read)
    rows = tensor.detach().movedim(dim, 0).reshape(tensor.shape[dim], -1).to(torch.float64)
    weights = torch.arange(rows.shape[1], dtype=torch.float64, device=rows.device).mul_(0.6180339887498949).frac_()
    return torch.stack((rows.sum(1), rows.abs().sum(1), rows.square().sum(1), rows @ weights), dim=1)


def _same_rows(full: torch.Tensor | None, sub: torch.Tensor | None, dtype: torch.dtype) -> bool:
    if full is None or sub is None:
        return full is None and sub is None
    # Relative to each row's size: the same computation at another batch size rounds differently
    # (blocked matrix products), by a few units of the dtype's precision; interactions change rows by O(1).
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    tolerance = max(1e-4, 64 * eps)
    scale = torch.stack((full[:, 1], full[:, 1], full[:, 2], full[:, 1]), dim=1).abs()
    difference = (full - sub.to(full.device)).abs()
    return bool((difference <= tolerance * scale + 1e-30).all() or not torch.isfinite(full).all())


def _shape_problem(kind, label, full_shape, sub_shape, batch_size, sub_rows, fixed_dim) -> str:
    what = "input" if kind == "input" else "output"
    where = f"at dim {fixed_dim}, where the engine reads them for this layer" if fixed_dim is not None else "in one dim"
    return (
        f"the {what} of {label} does not keep the examples {where}: shape {full_shape} for a batch of "
        f"{batch_size} but {sub_shape} for {sub_rows} of its examples. A layer run time-major (T, B, F) inside a "
        f"batch-first model (or the reverse) takes another axis for the batch, so its per-example gradients mix "
        f"examples; a tensor built across the batch (batch x batch) mixes them too. Give every layer the examples "
        f"at the wrapper's batch dim (or use a layer that declares its layout, e.g. batch_first=True), and "
        f"compute each example from its own row."
    )


def _unbatched_output_problem(label, shape, batch_size, sub_rows, dim) -> str:
    return (
        f"the output of {label} does not hold the examples at dim {dim}, where the engine reads them for this "
        f"layer: it has shape {shape} both for a batch of {batch_size} and for {sub_rows} of its examples, so "
        f"its {shape[dim]} rows at dim {dim} are something else that happens to number {batch_size} (positions, "
        f"heads: a layer whose output is shared by every example, like T5's relative position bias). Its "
        f"per-example gradients cannot be read from its rows. Have the module that uses it for every example run "
        f"as one unit of the torch.func fallback: grad_samplers.register_per_sample_unit(<that module's class>) "
        f"before wrapping."
    )


def _value_problem(kind, path, modules) -> str:
    by_path = dict(modules)
    label = module_label(path, by_path.get(path))
    if kind == "output":
        return (
            f"{label} mixes the examples of a batch: its output for an example "
            f"changes when other examples are removed from the batch (batch statistics such as "
            f"F.batch_norm(training=True), x - x.mean(0), a normalisation over the batch dim, in-batch "
            f"similarities). Per-example clipping cannot bound one example's influence then. Use a per-example "
            f"normalisation (nn.GroupNorm, nn.LayerNorm over features) or compute the statistics in eval mode."
        )
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    return (
        f"the input of {label} already mixes the examples of a batch (it changes when other examples are removed), "
        f"though every module before it kept them apart: the mixing happens in code outside any submodule, in "
        f"the forward of {module_label(parent, by_path.get(parent))}. Compute each example from its own row only."
    )


class DeterministicRandom(TorchDispatchMode):
    """Random ops made deterministic (for the row check's forwards only): dropout keeps every unit
    (``bernoulli`` -> ones, ``native_dropout`` -> identity), ``rand``/``uniform`` -> 0.5, ``randn``/``normal``
    -> the mean, ``randperm`` -> ``arange``, any other seeded op -> its output filled with ones. Only
    determinism matters: the same rows must come out of a forward on the full batch and on a sub-batch."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in ("native_dropout", "_fused_dropout"):  # (output, mask): keep every unit, unscaled
            _, mask = func(*args, **kwargs)
            return args[0].clone(), torch.ones_like(mask)
        if name == "randperm":
            return torch.arange(args[0], dtype=kwargs.get("dtype") or torch.int64, device=kwargs.get("device"))
        result = func(*args, **kwargs)  # the right shape and dtype (its values are overwritten)
        if name in ("rand", "rand_like", "uniform", "uniform_"):
            fill = 0.5
        elif name in ("randn", "randn_like", "normal_"):
            fill = 0.0
        elif name == "normal":
            mean = args[0] if args else kwargs.get("mean", 0.0)
            if isinstance(mean, torch.Tensor):
                return mean.expand_as(result).clone().to(result.dtype)
            fill = float(mean)
        else:
            fill = 1
        for leaf in tree_leaves(result):
            if isinstance(leaf, torch.Tensor):
                leaf.fill_(fill)
        return result
