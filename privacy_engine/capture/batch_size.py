"""Batch-size bookkeeping of one forward: which size the examples have, and layers whose output is
shared by every example (batch 1 in a forward of B, e.g. position embeddings) expanded to B.

Where a layer's examples sit is a property of the layer's input, not of the model: a module that declares
its layout (a boolean ``batch_first`` attribute: ``nn.TransformerEncoderLayer``, ``nn.MultiheadAttention``,
recurrent layers) fixes it for itself and every layer inside it; elsewhere the wrapper's ``batch_first``
holds (``declared_batch_dims``, read at wrapping into ``_tables.layer_batch_dims``). A sequence-first
encoder (``batch_first=False`` layers) under a batch-first head is read at dim 1 inside the encoder and at
dim 0 in the head.

``BatchSizeTracking`` is a mixin of the capturing wrappers (``GradSampleModule`` and, through it,
``GhostClippingModule``); it reads ``_batch_dim``, ``_tables.layer_batch_dims``, ``batch_first``,
``_module`` and ``_flags.in_forward`` and keeps ``_batch_sizes`` (``capture.state.BatchSizeState``), which
``GradSampleModule.forward`` resets and ``_forward_replay`` restores after the independence check's extra
forwards.
"""

from __future__ import annotations

import torch
from torch import nn

from privacy_engine.capture.recompute import NON_REENTRANT, checkpoint_recompute
from privacy_engine.models.validation import module_label, submodule_label

__all__ = ["BatchSizeTracking", "declared_batch_dims", "expand_batch", "input_batch_size"]


class BatchSizeTracking:
    """Mixin: the batch size of the running forward, checked layer by layer."""

    def _forward_batch_size(self) -> int | None:
        """The batch size the last forward's layers saw (None if no trainable layer ran)."""
        sizes = self._batch_sizes
        if sizes.forward_batch is not None:
            return sizes.forward_batch[1]
        if sizes.forward_broadcast is not None:
            return sizes.forward_broadcast[1]
        if sizes.forward_single is not None:
            return 1
        return sizes.forward_without_grad

    def _layer_dim(self, path: str) -> int:
        """The dim holding the examples in the input and output of the instrumented module at ``path``."""
        return self._tables.layer_batch_dims.get(path, self._batch_dim)

    def _note_batch_without_grad(self, output, path: str) -> None:
        """A layer the wrapper instruments (at ``path``) ran without gradients inside a training forward of the
        wrapper (a reentrant activation checkpoint runs its first forward under ``no_grad``, and captures in
        backward): keep its output's batch size, the forward's batch size when no layer ran with gradients."""
        sizes = self._batch_sizes
        dim = self._layer_dim(path)
        if not self._flags.in_forward or not isinstance(output, torch.Tensor) or output.dim() <= dim:
            return
        if sizes.forward_without_grad is None or sizes.forward_without_grad == 1:
            sizes.forward_without_grad = output.shape[dim]

    def _label(self, path: str) -> str:
        return submodule_label(self._module, path)

    def _note_input_batch(self, module: nn.Module, args, kwargs) -> None:
        """Forward pre-hook on the wrapped module: start a forward's batch bookkeeping."""
        sizes = self._batch_sizes
        sizes.input_batch = input_batch_size(args, kwargs, self._batch_dim)
        sizes.forward_single = None
        sizes.forward_broadcast = None
        sizes.forward_without_grad = None

    def _note_batch_size(self, path: str, batch_size: int) -> int | None:
        """Check a layer's output batch size against the forward's; return the size to expand the
        output to when the layer is a broadcast (None otherwise).

        The forward's batch size B is that of the first layer output whose batch size is not 1, or,
        before any such output, the batch size most of the wrapper's tensor inputs have (no tie).
        A layer output with 1 example while B != 1 is shared by every example (position embeddings
        looked up with ``position_ids`` of shape (1, T), a learned prefix): it is expanded to B so
        that its output gradient arrives per example. Any other difference is an error.

        During activation checkpointing's recomputation (``capture.recompute``), outside the wrapper's
        forward: a reentrant recomputation (whose first forward saw none of its layers) is checked against,
        and extends, the bookkeeping of the forward it recomputes; a non-reentrant one replays the first
        forward's decision (the output expanded to that forward's batch where it has 1 example) and records
        nothing. Elsewhere outside the wrapper's forward: None, nothing recorded.
        """
        if not self._flags.in_forward:
            recompute = checkpoint_recompute()
            if recompute is None:
                return None
            if recompute == NON_REENTRANT:
                forward_batch = self._forward_batch_size()
                return forward_batch if batch_size == 1 and forward_batch not in (None, 1) else None
        sizes = self._batch_sizes
        established = sizes.forward_batch
        if established is None:
            target = sizes.input_batch if batch_size == 1 else None
            if target is None or target == 1:
                sizes.forward_batch = (path, batch_size)
                if batch_size == 1:
                    sizes.forward_single = path  # batch 1 for now; a later layer may show a larger batch
                return None
            sizes.forward_batch = sizes.forward_broadcast = (path, target)
            return target
        if batch_size == established[1]:
            return None
        dim = self._layer_dim(path)  # for the messages below only
        if batch_size == 1:
            if sizes.forward_broadcast is None:
                sizes.forward_broadcast = (path, established[1])
            return established[1]
        if established[0] == sizes.forward_single:
            raise ValueError(
                f"the batch size differs between layers of one forward: {self._label(established[0])} got 1 "
                f"example (dim {dim}) but {self._label(path)}, later, got {batch_size}. A layer whose output is "
                f"shared by every example (broadcast) can only be separated per example once the batch size is "
                f"known: from an earlier layer, or from the inputs (most tensor inputs of the wrapper having the "
                f"batch size). Pass that layer's input with the batch size (e.g. position_ids of shape "
                f"(batch, seq_len)) or give every input the same batch size (batch_first={self.batch_first})."
            )
        if sizes.forward_broadcast is not None and established[0] == sizes.forward_broadcast[0]:
            raise ValueError(
                f"the batch size differs between layers of one forward: {self._label(established[0])} got 1 "
                f"example and was treated as shared by the {established[1]} examples the inputs suggest, but "
                f"{self._label(path)} got {batch_size} examples (dim {dim}). Give the wrapper's inputs the "
                f"batch size of the model (batch_first={self.batch_first})."
            )
        raise ValueError(self._mismatch_message(path, batch_size, dim, established))

    def _mismatch_message(self, path: str, batch_size: int, dim: int, established: tuple[str, int]) -> str:
        """The error for a layer whose size at its batch dim is neither the forward's batch size nor 1:
        what it can mean, and the way out of each, naming the module to run as a unit."""
        if "." in path:
            parent = path.rsplit(".", 1)[0]
            parent_type = type(self._module.get_submodule(parent))
            unit = (
                f"grad_samplers.register_per_sample_unit({parent_type.__module__}.{parent_type.__qualname__}) before "
                f"wrapping, so that {self._label(parent)} runs as one unit of the torch.func fallback, each example "
                f"alone (or the class of a module further up that holds the examples at dim {dim} of its input and "
                f"output)"
            )
        else:  # the root cannot be a unit: the layer must move into a module that can
            unit = (
                f"grad_samplers.register_per_sample_unit(<class>) on the class of a submodule that holds that layer "
                f"and has the examples at dim {dim} of its input and output (move the layer into one)"
            )
        return (
            f"the batch size differs between layers of one forward: {self._label(path)} has {batch_size} rows at "
            f"dim {dim}, where the engine reads a layer's examples, but {self._label(established[0])} had "
            f"{established[1]}. The engine does not guess which rows belong to which example. (1) If the inputs "
            f"differ: give every input of the wrapper the same batch size (batch_first={self.batch_first}). (2) If "
            f"that layer's output has no batch dim (a tensor shared by every example, like T5's relative position "
            f"bias (q_len, k_len, heads)) or folds another axis into it (Swin's windows, (batch * windows, ...)): "
            f"call {unit}. (3) If it runs sequence-first inside a batch-first model (or the reverse): give the "
            f"module that runs it a boolean batch_first attribute saying so (the layers inside it are then read at "
            f"that dim)."
        )

    @staticmethod
    def _batch_first(output_grad: torch.Tensor, activations: tuple, dim: int) -> tuple[torch.Tensor, tuple]:
        """A layer's output gradient and inputs with the example axis ``dim`` (the layer's,
        ``_layer_dim``) moved to dim 0 (views; as given when ``dim`` is 0). Inputs with no dim at the batch
        position are left as they are."""
        if dim == 0:
            return output_grad, activations
        return output_grad.movedim(dim, 0), tuple(
            a.movedim(dim, 0) if isinstance(a, torch.Tensor) and a.dim() > dim else a for a in activations
        )

    def _broadcast_activations(self, path: str, layer: nn.Module, args: tuple, batch_size: int) -> tuple:
        """A broadcast layer's inputs with their batch dimension of 1 expanded to ``batch_size`` (views):
        every example saw the same input."""
        dim = self._layer_dim(path)
        if isinstance(layer, nn.EmbeddingBag) and isinstance(args[0], torch.Tensor) and args[0].dim() == 1:
            raise ValueError(
                f"{module_label(path)} (EmbeddingBag with 1-D input and offsets) returned 1 bag in a forward of "
                f"{batch_size} examples; a bag shared by every example needs 2-D input (1, bag_size)"
            )
        return tuple(
            expand_batch(a, dim, batch_size) if isinstance(a, torch.Tensor) and a.dim() > dim and a.shape[dim] == 1 else a
            for a in args
        )


def declared_batch_dims(root: nn.Module, paths: list[str], default_dim: int) -> dict[str, int]:
    """For each module path in ``paths``: the dim holding the examples in that module's input and output.

    It is the layout the module itself or its nearest ancestor declares (a boolean ``batch_first``
    attribute: 0 if True, 1 if False; for ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``,
    their attention's, where torch keeps the argument), else ``default_dim`` (the wrapper's ``batch_first``). A declaration
    is the module's own statement about its inputs (``nn.TransformerEncoderLayer(batch_first=False)`` runs
    its linear layers on ``(T, B, E)``), not a guess from shapes; the independence check's row comparison
    verifies it on the first training forward of a bound wrapper (``capture.row_probe``).
    """
    dims: dict[str, int] = {}
    for path in paths:
        names = path.split(".") if path else []
        module, dim = root, _declared_dim(root, default_dim)
        for name in names:
            module = getattr(module, name)
            dim = _declared_dim(module, dim)
        dims[path] = dim
    return dims


def _declared_dim(module: nn.Module, inherited: int) -> int:
    declared = getattr(module, "batch_first", None)
    if declared is None and isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        # torch keeps these layers' batch_first argument on their attention only (and applies it to the
        # whole layer: its feed-forward and norms run on the same (T, B, E) or (B, T, E) tensors).
        declared = getattr(module.self_attn, "batch_first", None)
    if isinstance(declared, bool):
        return 0 if declared else 1
    return inherited


def input_batch_size(args: tuple, kwargs: dict, batch_dim: int) -> int | None:
    """The size at ``batch_dim`` that most tensor inputs of 2 or more dims have; None on a tie or none.

    1-D tensors do not vote: their one dim is as often a list of things (EmbeddingBag indices and offsets,
    lengths) as a batch. A tie is left undecided on purpose: ``(mask of shape (T, T), x of shape (1, T, E))``
    and ``(input_ids (B, T), position_ids (1, T))`` look alike, and guessing wrong would copy one example
    T times. Layers' outputs decide then (see ``GradSampleModule._note_batch_size``). (With a private
    loader, a forward whose batch exceeds the drawn batch is refused by the step contract as well.)
    """
    counts: dict[int, int] = {}
    if not kwargs and all(type(arg) is torch.Tensor for arg in args):
        leaves = args  # the usual model(x): the leaves tree_leaves gives, without its walk (at every forward)
    else:
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and leaf.dim() > batch_dim:
            counts[leaf.shape[batch_dim]] = counts.get(leaf.shape[batch_dim], 0) + 1
    if len(counts) < 2:  # (none, or one size: the usual model(x), without the sort below)
        return next(iter(counts), None)
    ranked = sorted(counts.items(), key=lambda item: item[1], reverse=True)
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return None
    return ranked[0][0]


def expand_batch(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``tensor`` expanded (a view, no copy) to ``size`` along ``dim``, where it has size 1: the output of a
    layer shared by every example, made per example. ``RuntimeError`` (from ``expand``) if ``tensor``'s
    size along ``dim`` is neither 1 nor ``size``."""
    shape = list(tensor.shape)
    shape[dim] = size
    return tensor.expand(shape)
