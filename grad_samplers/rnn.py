"""Exact per-sample gradients for recurrent layers: ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` (tanh and
relu) exactly as a user writes them (multi-layer, bidirectional, ``batch_first`` either way, dropout
between layers, LSTM projections, padded or ``PackedSequence`` input, with or without an initial
state), and any subclass of them.

Why not the ``torch.func`` fallback: the fused recurrent kernels (``aten::lstm`` and friends) have no
``vmap`` batching rule. A decomposed recurrence under ``vmap`` would work but is slow: per-example
weight copies turn every step's hidden-to-hidden product into B matrix-vector products and its weight
gradient into one ``(B, gates, hidden)`` outer product per step.

What runs instead, in training mode, is the decomposition in ``grad_samplers._recurrence`` (nothing in
the module changes: same parameters, same state dict): per layer-direction, the input projection of all
time steps at once through an autograd Function that delivers every parameter's per-example gradients
in backward, and the per-step cell in plain operations with the weights detached.

``PackedSequence`` input is unpacked to a padded batch in the caller's order (``lengths`` per
sequence); at steps past a sequence's length its state is frozen (``where``), so those steps receive
exactly zero gradient; the reverse direction reverses each sequence within its own length. The output
is packed again with the input's own ``batch_sizes``, ``sorted_indices`` and ``unsorted_indices``
(same data order as ``nn.LSTM``'s). The examples are the sequences, in the caller's order.

Where the layers are reached:

- as fallback modules (they own parameters and have no grad sampler): ``functorch_fallback`` hands their
  training-mode calls to ``recurrent_per_sample_forward`` (``register_per_sample_forward``), in hooks and
  ghost mode alike (ghost mode materialises these per-example gradients);
- inside another module that the ``vmap`` fallback differentiates (it owns parameters itself, e.g. a
  learned initial state): ``recurrent_vmap_forward``, the same decomposition in plain autograd, runs per
  example under that module's ``vmap`` (padded input only: a ``PackedSequence`` cannot be split there);
- the cells ``nn.LSTMCell``/``nn.GRUCell``/``nn.RNNCell`` in a user's own time loop: the ``vmap`` fallback
  over a decomposed cell (one step per call; the fused cell kernels have no batching rule).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from grad_samplers._recurrence import WEIGHT_NAMES, Direction, cell_step, recurrence
from grad_samplers.functorch_fallback import PerSampleGradCallback, per_sample_forward, register_per_sample_forward

__all__ = [
    "CELL_TYPES",
    "RECURRENT_TYPES",
    "recurrent_output_batch_size",
    "recurrent_per_sample_forward",
    "recurrent_vmap_forward",
]

RECURRENT_TYPES = (nn.LSTM, nn.GRU, nn.RNN)
CELL_TYPES = (nn.LSTMCell, nn.GRUCell, nn.RNNCell)


# ---------------------------------------------------------------------------------- packing
@dataclass(frozen=True)
class _PackedLayout:
    """Where each row of a ``PackedSequence``'s data sits in the padded (B, T) batch, caller's order."""

    sequence_of_row: torch.Tensor
    time_of_row: torch.Tensor
    lengths: torch.Tensor  # (B,), the caller's order
    steps: int

    @staticmethod
    def of(packed: PackedSequence) -> _PackedLayout:
        batch_sizes = packed.batch_sizes.to("cpu", torch.int64)
        steps, rows = batch_sizes.numel(), int(batch_sizes.sum())
        batch_size = int(batch_sizes[0])
        time_of_row = torch.repeat_interleave(torch.arange(steps), batch_sizes)
        starts = torch.cumsum(batch_sizes, 0) - batch_sizes
        rank_of_row = torch.arange(rows) - starts[time_of_row]  # position among the length-sorted sequences
        lengths_sorted = (batch_sizes.unsqueeze(0) > torch.arange(batch_size).unsqueeze(1)).sum(dim=1)
        device = packed.data.device
        if packed.sorted_indices is None:
            sequence_of_row, lengths = rank_of_row, lengths_sorted
        else:
            sorted_indices = packed.sorted_indices.to("cpu")
            sequence_of_row = sorted_indices[rank_of_row]
            lengths = torch.empty_like(lengths_sorted)
            lengths[sorted_indices] = lengths_sorted
        return _PackedLayout(sequence_of_row.to(device), time_of_row.to(device), lengths.to(device), steps)

    def pad(self, data: torch.Tensor) -> torch.Tensor:
        padded = data.new_zeros(self.lengths.numel(), self.steps, *data.shape[1:])
        return padded.index_put((self.sequence_of_row, self.time_of_row), data)

    def pack(self, padded: torch.Tensor, like: PackedSequence) -> PackedSequence:
        data = padded[self.sequence_of_row, self.time_of_row]
        return PackedSequence(data, like.batch_sizes, like.sorted_indices, like.unsorted_indices)


# ---------------------------------------------------------------------------------- entry points
def _bind(module_path: str, args: tuple, kwargs: dict):
    names = ("input", "hx")
    if len(args) > len(names) or any(name not in names for name in kwargs):
        raise TypeError(
            f"recurrent layer {module_path!r}: forward takes (input, hx=None); got {len(args)} positional "
            f"arguments and keywords {sorted(kwargs)}"
        )
    bound = dict(zip(names, args))
    for name, value in kwargs.items():
        if name in bound:
            raise TypeError(f"recurrent layer {module_path!r}: forward got {name!r} twice")
        bound[name] = value
    if "input" not in bound:
        raise TypeError(f"recurrent layer {module_path!r}: forward needs an input")
    return bound["input"], bound.get("hx")


def _check_state(module: nn.RNNBase, module_path: str, name: str, state, batch_size: int, size: int, dtype):
    expected = (module.num_layers * (2 if module.bidirectional else 1), batch_size, size)
    if not isinstance(state, torch.Tensor) or tuple(state.shape) != expected:
        shape = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
        raise ValueError(
            f"recurrent layer {module_path!r} ({type(module).__name__}): initial state {name} has shape {shape}; "
            f"expected {expected} (num_layers * num_directions, batch, {name} size), batch in dim 1 whatever "
            f"batch_first says"
        )
    if state.dtype != dtype:
        raise ValueError(
            f"recurrent layer {module_path!r}: initial state {name} is {state.dtype} but the input is {dtype}; "
            f"give both the same dtype"
        )


def _padded_input(module: nn.RNNBase, module_path: str, input):
    """(x (B, T, F) in the caller's order, packed layout or None)."""
    kind = type(module).__name__
    if isinstance(input, PackedSequence):
        layout = _PackedLayout.of(input)
        return layout.pad(input.data), layout
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"recurrent layer {module_path!r} ({kind}): input must be a tensor or a PackedSequence; "
                        f"got {type(input).__name__}")
    if input.dim() != 3:
        hint = " Add a batch dimension (a batch of one)." if input.dim() == 2 else ""
        raise ValueError(
            f"recurrent layer {module_path!r} ({kind}): per-sample gradients need a batched 3-D input "
            f"({'(batch, time, features)' if module.batch_first else '(time, batch, features)'}); got shape "
            f"{tuple(input.shape)}.{hint}"
        )
    if input.shape[1 if module.batch_first else 0] == 0:
        raise ValueError(f"recurrent layer {module_path!r} ({kind}): the input has no time steps (length 0)")
    return (input if module.batch_first else input.transpose(0, 1)), None


def recurrent_per_sample_forward(
    module: nn.RNNBase,
    original_forward: Callable,
    args: tuple,
    kwargs: dict,
    *,
    params: dict[str, torch.Tensor],
    batch_dim: int,
    module_path: str,
    on_per_sample_grad: PerSampleGradCallback,
):
    """One training-mode call of ``nn.LSTM``/``nn.GRU``/``nn.RNN`` (same contract as
    ``functorch_fallback.per_sample_forward``): the layer's output, and in backward
    ``on_per_sample_grad(param, grads)`` for every tensor of ``params`` (names relative to the module;
    stand-ins are fine), ``grads`` of shape ``(B, *param.shape)`` with B the number of sequences.

    Guarantee: the output equals the module's own forward (up to float rounding; dropout drawn here,
    independently of the fused kernel's generator), and ``grads[b]`` is the exact gradient of the loss
    with respect to the parameters through sequence b alone, so ``grads.sum(0)`` is the ordinary gradient
    (which the parameters receive). Where the examples sit is read from the module (``batch_first``; a
    ``PackedSequence``'s sequences, in the caller's order; dim 1 of the initial states), not from
    ``batch_dim``.

    ======================================  ===============================================
    case                                    behaviour
    ======================================  ===============================================
    PackedSequence (sorted or not)          output packed like ``nn.LSTM``'s (same data
                                            order, batch_sizes, sorted/unsorted indices)
    steps past a sequence's length          state frozen, zero gradient
    hx omitted                              zeros, as ``nn.LSTM``
    hx given (requires grad or not)         used as is; its gradient flows back
    dropout between layers, module.train()  drawn once here; gradients follow that draw
    module.eval() inside a training model   no dropout, per-sample gradients as usual
    frozen parameter                        used, not reported
    empty batch (B = 0, padded input)       ``(0, *param.shape)`` per-sample gradients
    unbatched (2-D) or other-rank input     ``ValueError`` (add a batch dimension)
    zero time steps                         ``ValueError``
    hx of the wrong shape or dtype          ``ValueError`` naming the state
    backward twice on one forward           ``RuntimeError``
    ======================================  ===============================================
    """
    del original_forward, batch_dim  # the decomposition replaces the forward; the module says where B is
    input, hx = _bind(module_path, args, kwargs)
    x, layout, h0, c0 = _prepare(module, module_path, input, hx)

    def weight_of(name: str):
        return params[name] if name in params else module._parameters.get(name)

    def make_direction(suffix: str, weights: tuple) -> Direction:
        trainable = tuple(
            (slot, params[name + suffix]) for slot, name in enumerate(WEIGHT_NAMES) if name + suffix in params
        )
        return Direction(module.mode, module_path, trainable, on_per_sample_grad)

    lengths = None if layout is None else layout.lengths
    output, h_n, c_n = recurrence(module, x, lengths, h0, c0, weight_of, make_direction)
    return _finish(module, input, layout, output, h_n, c_n)


def recurrent_vmap_forward(module: nn.RNNBase, *args, **kwargs):
    """The layer's forward in plain differentiable operations (no fused kernel, no per-sample capture):
    what runs when the layer sits inside another module that the ``vmap`` fallback differentiates (that
    module owns parameters itself, e.g. a learned initial state). There each call sees one example."""
    input, hx = _bind(type(module).__name__, args, kwargs)
    if isinstance(input, PackedSequence):
        raise TypeError(
            f"a {type(module).__name__} inside a module that owns parameters itself runs under that module's "
            f"torch.func fallback (vmap), where a PackedSequence cannot be split into examples. Move that "
            f"module's own parameters into a child module (e.g. nn.Linear, or a small module holding the "
            f"learned state) so that the recurrent layer is differentiated on its own, or pass padded input."
        )
    x, layout, h0, c0 = _prepare(module, type(module).__name__, input, hx)
    output, h_n, c_n = recurrence(module, x, None, h0, c0, lambda name: getattr(module, name, None),
                                   lambda suffix, weights: None)
    return _finish(module, input, layout, output, h_n, c_n)


def _prepare(module: nn.RNNBase, module_path: str, input, hx):
    """(x (B, T, F) in the caller's order, packed layout or None, h_0 or None, c_0 or None), checked."""
    x, layout = _padded_input(module, module_path, input)
    dtype = x.dtype
    weight_dtype = module.weight_ih_l0.dtype
    if dtype != weight_dtype and not _autocast_enabled(x.device.type):
        raise ValueError(
            f"recurrent layer {module_path!r}: the input is {dtype} but the layer's weights are {weight_dtype}; "
            f"convert one of them"
        )
    batch_size = x.shape[0]
    h0 = c0 = None
    if hx is not None:
        if module.mode == "LSTM":
            if not (isinstance(hx, tuple) and len(hx) == 2):
                raise ValueError(f"recurrent layer {module_path!r} (LSTM): hx must be a tuple (h_0, c_0)")
            h0, c0 = hx
            _check_state(module, module_path, "c_0", c0, batch_size, module.hidden_size, dtype)
        else:
            h0 = hx
        _check_state(module, module_path, "h_0", h0, batch_size, module.proj_size or module.hidden_size, dtype)
    return x, layout, h0, c0


def _finish(module: nn.RNNBase, input, layout, output, h_n, c_n):
    if layout is not None:
        output = layout.pack(output, input)
    elif not module.batch_first:
        output = output.transpose(0, 1)
    return output, ((h_n, c_n) if module.mode == "LSTM" else h_n)


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 takes no device type
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


def recurrent_output_batch_size(module: nn.RNNBase, output) -> int | None:
    """The number of examples (sequences) in a recurrent layer's output."""
    first = output[0] if isinstance(output, tuple) and output else output
    if isinstance(first, PackedSequence):
        return int(first.batch_sizes[0])
    if isinstance(first, torch.Tensor) and first.dim() == 3:
        return first.shape[0 if module.batch_first else 1]
    return None


register_per_sample_forward(
    *RECURRENT_TYPES, output_batch_size=recurrent_output_batch_size, vmap_forward=recurrent_vmap_forward
)(recurrent_per_sample_forward)


# ---------------------------------------------------------------------------------- cells
def _cell_forward(cell: nn.RNNCellBase, input, hx=None):
    """``nn.LSTMCell``/``nn.GRUCell``/``nn.RNNCell``'s forward in plain operations (the fused cell
    kernels have no ``vmap`` batching rule: ``aten::lstm_cell`` fails, the others loop per example)."""
    if isinstance(cell, nn.LSTMCell):
        mode = "LSTM"
    elif isinstance(cell, nn.GRUCell):
        mode = "GRU"
    else:
        mode = "RNN_TANH" if cell.nonlinearity == "tanh" else "RNN_RELU"
    unbatched = input.dim() == 1
    if unbatched:
        input = input.unsqueeze(0)
    zeros = input.new_zeros(input.shape[0], cell.hidden_size)
    if mode == "LSTM":
        h, c = hx if hx is not None else (zeros, zeros)
    else:
        h, c = (hx if hx is not None else zeros), None
    if unbatched and hx is not None:
        h, c = h.unsqueeze(0), None if c is None else c.unsqueeze(0)
    gates_x = F.linear(input, cell.weight_ih, cell.bias_ih)
    h_new, c_new, _ = cell_step(mode, gates_x, h, c, cell.weight_hh, cell.bias_hh)
    if unbatched:
        h_new, c_new = h_new.squeeze(0), None if c_new is None else c_new.squeeze(0)
    return (h_new, c_new) if mode == "LSTM" else h_new


def cell_per_sample_forward(
    module: nn.RNNCellBase, original_forward: Callable, args: tuple, kwargs: dict, *, batch_dim: int, **contract
):
    """One training-mode call of a recurrent cell (``per_sample_forward``'s contract; ``contract`` holds its
    other keywords): the ``vmap`` fallback over ``_cell_forward`` (exact; each example's gradient of one
    step). The batch is dim 0 of the cell's input and states, whatever the wrapper's ``batch_first``."""
    del original_forward, batch_dim
    return per_sample_forward(module, partial(_cell_forward, module), args, kwargs, batch_dim=0, **contract)


def cell_output_batch_size(module: nn.RNNCellBase, output) -> int | None:
    """Rows of a cell's output (its first tensor when 2-D), or None for an unbatched call."""
    first = output[0] if isinstance(output, tuple) else output
    return first.shape[0] if isinstance(first, torch.Tensor) and first.dim() == 2 else None


register_per_sample_forward(*CELL_TYPES, output_batch_size=cell_output_batch_size, vmap_forward=_cell_forward)(
    cell_per_sample_forward
)
