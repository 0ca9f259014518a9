"""Exact per-sample gradients for recurrent layers: ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` (tanh and
relu) exactly as a user writes them (multi-layer, bidirectional, ``batch_first`` either way, dropout
between layers, LSTM projections, padded or ``PackedSequence`` input, with or without an initial
state), and their Opacus-named subclasses ``privacy_engine.layers.DPLSTM``/``DPGRU``/``DPRNN``.

Why not the ``torch.func`` fallback: the fused recurrent kernels (``aten::lstm`` and friends) have no
``vmap`` batching rule. A decomposed recurrence under ``vmap`` would work but is slow: per-example
weight copies turn every step's hidden-to-hidden product into B matrix-vector products and its weight
gradient into one ``(B, gates, hidden)`` outer product per step.

What runs instead, in training mode (nothing in the module changes: same parameters, same state dict):

- each layer-direction's input projection for all time steps at once, ``gx = x W_ih^T + b_ih`` of
  shape ``(B, T, gates)``, computed by an autograd Function (``_InputProjection``) that takes every
  parameter of that layer-direction as an input;
- the per-step cell on ``gx[:, t] + h W_hh^T + b_hh`` in plain differentiable operations, with the
  weights *detached*, so autograd forms no per-step weight gradient.

Every gate pre-activation of step t is ``gx[:, t] + (h W_hh^T + b_hh)``, so the gradient the Function
receives for ``gx`` is the gradient of every pre-activation at every step, delivered once, after the
whole recurrence has been differentiated. Each example's gradients are then one batched product over
time per parameter (``h_{t-1}`` is the state step t started from; GRU's candidate gate multiplies
its hidden part by the reset gate r, so that part's gradient is ``dgx_n * r``; with projections
``m_t`` is the cell output before ``W_hr`` and ``dh_t`` the gradient of the projected state, read
from a zero probe added to each step's state):

=========  ======================================
parameter  example b's gradient
=========  ======================================
W_ih       sum_t dgx[b, t] x[b, t]^T
b_ih       sum_t dgx[b, t]
W_hh       sum_t dgh[b, t] h_{t-1}[b]^T
b_hh       sum_t dgh[b, t]
W_hr       sum_t dh[b, t] m[b, t]^T
=========  ======================================

and the Function returns their sums as the parameters' ordinary gradients. Dropout between layers is
drawn once, in this forward, so the per-example gradients are those of the forward that ran and sum to
the real gradient.

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
# Slots of one layer-direction's parameters, in this order everywhere below.
_WEIGHT_NAMES = ("weight_ih", "bias_ih", "weight_hh", "bias_hh", "weight_hr")
W_IH, B_IH, W_HH, B_HH, W_HR = range(5)


# ---------------------------------------------------------------------------------- capture
@dataclass(eq=False)
class _Direction:
    """One layer-direction of one forward call: what its backward needs, filled during forward."""

    mode: str
    path: str
    trainable: tuple[tuple[int, torch.Tensor], ...]  # (slot, the parameter object to report)
    on_per_sample_grad: PerSampleGradCallback
    previous_hidden: torch.Tensor | None = None  # (B, T, H_out): the state each step started from
    reset_gates: torch.Tensor | None = None  # GRU: (B, T, H)
    cell_outputs: torch.Tensor | None = None  # LSTM with projections: (B, T, H), before W_hr
    released: bool = False  # set once backward has delivered the per-sample gradients


class _InputProjection(torch.autograd.Function):
    """``gx = F.linear(x, W_ih, b_ih)`` (and a zero probe for projected states); in backward, the
    per-example gradients of every parameter of this layer-direction (see the module docstring), which
    go to the direction's callback, and their sums as the parameters' gradients."""

    @staticmethod
    def forward(ctx, direction: _Direction, x, w_ih, b_ih, w_hh, b_hh, w_hr):
        ctx.direction = direction
        ctx.save_for_backward(x, w_ih)
        gates = F.linear(x, w_ih, b_ih)
        if w_hr is None:
            return gates
        probe = gates.new_zeros(x.shape[0], x.shape[1], w_hr.shape[0])
        return gates, probe

    @staticmethod
    def backward(ctx, grad_gates, grad_projected=None):
        direction: _Direction = ctx.direction
        if direction.released:
            raise RuntimeError(
                f"recurrent layer {direction.path!r}: a second backward pass ran through the same forward "
                f"(retain_graph=True); its per-sample gradients were already delivered. Run a new forward "
                f"for each backward."
            )
        x, w_ih = ctx.saved_tensors
        dtype = w_ih.dtype  # under autocast the gradients may arrive in a lower precision
        grad_gates = grad_gates.to(dtype)
        grad_x = torch.matmul(grad_gates, w_ih).to(x.dtype) if ctx.needs_input_grad[1] else None
        grads: list[torch.Tensor | None] = [None] * len(_WEIGHT_NAMES)
        slots = {slot for slot, _ in direction.trainable}
        per_sample = _per_sample_gradients(direction, slots, x.to(dtype), grad_gates, grad_projected)
        direction.released = True
        direction.previous_hidden = direction.reset_gates = direction.cell_outputs = None
        for slot, param in direction.trainable:
            direction.on_per_sample_grad(param, per_sample[slot])
            grads[slot] = per_sample[slot].sum(dim=0)
        return (None, grad_x, *grads)


def _per_sample_gradients(direction: _Direction, slots: set, x, grad_gates, grad_projected) -> dict:
    """Slot -> ``(B, *param.shape)``: example b's gradient, summed over time steps."""
    dtype = grad_gates.dtype
    result = {}
    if W_IH in slots:
        result[W_IH] = torch.bmm(grad_gates.transpose(1, 2), x)
    if B_IH in slots:
        result[B_IH] = grad_gates.sum(dim=1)
    if W_HH in slots or B_HH in slots:
        grad_hidden_gates = grad_gates
        if direction.mode == "GRU":
            # n = tanh(gx_n + r * (W_hn h + b_hn)): the hidden part of the candidate gate is scaled by r.
            hidden_size = grad_gates.shape[-1] // 3
            candidate = grad_gates[..., 2 * hidden_size :] * direction.reset_gates.to(dtype)
            grad_hidden_gates = torch.cat((grad_gates[..., : 2 * hidden_size], candidate), dim=-1)
        if W_HH in slots:
            result[W_HH] = torch.bmm(grad_hidden_gates.transpose(1, 2), direction.previous_hidden.to(dtype))
        if B_HH in slots:
            result[B_HH] = grad_hidden_gates.sum(dim=1)
    if W_HR in slots:
        result[W_HR] = torch.bmm(grad_projected.to(dtype).transpose(1, 2), direction.cell_outputs.to(dtype))
    return result


# ---------------------------------------------------------------------------------- recurrence
def _step(mode: str, gates_x, h, c, w_hh, b_hh):
    """One cell step from the input part of the gate pre-activations: (cell output, new c, reset gate).

    The cell output is the new hidden state, before any projection (LSTM ``m_t``)."""
    hidden_part = F.linear(h, w_hh, b_hh)
    if mode == "LSTM":
        gates = gates_x + hidden_part
        hidden_size = gates.shape[-1] // 4
        sigmoids = torch.sigmoid(gates)  # i, f, o (g's sigmoid is computed and unused: one op, not three)
        i, f, _, o = sigmoids.split(hidden_size, dim=-1)
        g = torch.tanh(gates[..., 2 * hidden_size : 3 * hidden_size])
        c_new = f * c + i * g
        return o * torch.tanh(c_new), c_new, None
    if mode == "GRU":
        hidden_size = gates_x.shape[-1] // 3
        x_rz, x_n = gates_x.split((2 * hidden_size, hidden_size), dim=-1)
        h_rz, h_n = hidden_part.split((2 * hidden_size, hidden_size), dim=-1)
        r, z = torch.sigmoid(x_rz + h_rz).chunk(2, dim=-1)
        n = torch.tanh(x_n + r * h_n)
        return n + z * (h - n), None, r
    pre_activation = gates_x + hidden_part
    return (torch.tanh(pre_activation) if mode == "RNN_TANH" else torch.relu(pre_activation)), None, None


def _run_direction(mode: str, x, keep, h, c, weights: tuple, direction: _Direction | None):
    """The recurrence of one layer-direction over ``x`` (B, T, F), forward in time.

    ``keep``: (B, T) bool, False past a sequence's end (its state is then frozen), or None. With a
    ``direction`` the weights' gradients come from ``_InputProjection`` (per-example and summed) and the
    recurrence uses them detached; without, it is plain autograd on the weights (usable under ``vmap``).
    Returns the outputs (B, T, H_out) and the final h and c."""
    w_ih, b_ih, w_hh, b_hh, w_hr = weights
    if direction is not None:
        projected = _InputProjection.apply(direction, x, w_ih, b_ih, w_hh, b_hh, w_hr)
        gates_x, probe = projected if w_hr is not None else (projected, None)
        w_hh, w_hr = w_hh.detach(), None if w_hr is None else w_hr.detach()
        b_hh = None if b_hh is None else b_hh.detach()
    else:
        gates_x, probe = F.linear(x, w_ih, b_ih), None
    steps = gates_x.unbind(dim=1)  # its backward stacks the steps' gradients once (a slice per step would not)
    probes = probe.unbind(dim=1) if probe is not None else None
    outputs, previous, reset_gates, cell_outputs = [], [], [], []
    for t, gates_t in enumerate(steps):
        previous.append(h)
        cell_output, c_new, r = _step(mode, gates_t, h, c, w_hh, b_hh)
        h_new = cell_output
        if w_hr is not None:
            h_new = F.linear(cell_output, w_hr)
            if probes is not None:
                h_new = h_new + probes[t]
            cell_outputs.append(cell_output)
        if r is not None:
            reset_gates.append(r)
        if keep is not None:
            keep_t = keep[:, t].unsqueeze(1)
            h_new = torch.where(keep_t, h_new, h)
            if c_new is not None:
                c_new = torch.where(keep_t, c_new, c)
        outputs.append(h_new)
        h, c = h_new, c_new
    if direction is not None:
        with torch.no_grad():
            direction.previous_hidden = _stack(previous, dim=1)
            if reset_gates:
                direction.reset_gates = _stack(reset_gates, dim=1)
            if cell_outputs:
                direction.cell_outputs = _stack(cell_outputs, dim=1)
    return _stack(outputs, dim=1), h, c


def _stack(tensors: list, dim: int) -> torch.Tensor:
    """``torch.stack``, promoting first where dtypes differ (under autocast a state may start in float32
    and continue in a lower precision)."""
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return torch.stack([tensor.to(dtype) for tensor in tensors], dim=dim)


def _reverse_within_lengths(values: torch.Tensor, reverse_index: torch.Tensor | None) -> torch.Tensor:
    """``values`` (B, T, F) with each sequence reversed in time within its own length (an involution)."""
    if reverse_index is None:
        return values.flip(1)
    return values.gather(1, reverse_index.unsqueeze(-1).expand(-1, -1, values.shape[-1]))


def _recurrence(module: nn.RNNBase, x, lengths, h0, c0, weight_of: Callable[[str], torch.Tensor | None],
                make_direction: Callable[[str, tuple], _Direction | None]):
    """The whole layer on a padded batch ``x`` (B, T, F) in the caller's order: output (B, T, D*H_out),
    h_n (L*D, B, H_out), c_n (LSTM) or None."""
    mode = module.mode
    batch_size, steps = x.shape[0], x.shape[1]
    directions = 2 if module.bidirectional else 1
    keep = reverse_index = None
    if lengths is not None:
        time = torch.arange(steps, device=x.device)
        keep = time.unsqueeze(0) < lengths.unsqueeze(1)
        reverse_index = torch.where(keep, lengths.unsqueeze(1) - 1 - time, time)
    layer_input = x
    final_h, final_c = [], []
    for layer in range(module.num_layers):
        direction_outputs = []
        for direction in range(directions):
            suffix = f"_l{layer}" + ("_reverse" if direction else "")
            weights = tuple(weight_of(name + suffix) for name in _WEIGHT_NAMES)
            index = layer * directions + direction
            h = h0[index] if h0 is not None else x.new_zeros(batch_size, module.proj_size or module.hidden_size)
            c = None
            if mode == "LSTM":
                c = c0[index] if c0 is not None else x.new_zeros(batch_size, module.hidden_size)
            sequence = layer_input if direction == 0 else _reverse_within_lengths(layer_input, reverse_index)
            outputs, h, c = _run_direction(mode, sequence, keep, h, c, weights, make_direction(suffix, weights))
            direction_outputs.append(outputs if direction == 0 else _reverse_within_lengths(outputs, reverse_index))
            final_h.append(h)
            final_c.append(c)
        layer_input = direction_outputs[0] if directions == 1 else torch.cat(direction_outputs, dim=2)
        if layer < module.num_layers - 1 and module.dropout > 0 and module.training:
            layer_input = F.dropout(layer_input, p=module.dropout, training=True)
    h_n = _stack(final_h, dim=0)
    c_n = _stack(final_c, dim=0) if mode == "LSTM" else None
    return layer_input, h_n, c_n


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

    def make_direction(suffix: str, weights: tuple) -> _Direction:
        trainable = tuple(
            (slot, params[name + suffix]) for slot, name in enumerate(_WEIGHT_NAMES) if name + suffix in params
        )
        return _Direction(module.mode, module_path, trainable, on_per_sample_grad)

    lengths = None if layout is None else layout.lengths
    output, h_n, c_n = _recurrence(module, x, lengths, h0, c0, weight_of, make_direction)
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
    output, h_n, c_n = _recurrence(module, x, None, h0, c0, lambda name: getattr(module, name, None),
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
    h_new, c_new, _ = _step(mode, gates_x, h, c, cell.weight_hh, cell.bias_hh)
    if unbatched:
        h_new, c_new = h_new.squeeze(0), None if c_new is None else c_new.squeeze(0)
    return (h_new, c_new) if mode == "LSTM" else h_new


def cell_per_sample_forward(
    module: nn.RNNCellBase,
    original_forward: Callable,
    args: tuple,
    kwargs: dict,
    *,
    params: dict[str, torch.Tensor],
    batch_dim: int,
    module_path: str,
    on_per_sample_grad: PerSampleGradCallback,
):
    """One training-mode call of a recurrent cell: the ``vmap`` fallback over ``_cell_forward`` (exact;
    each example's gradient of one step). The batch is dim 0 of the cell's input and states, whatever
    the wrapper's ``batch_first``."""
    del original_forward, batch_dim
    return per_sample_forward(module, partial(_cell_forward, module), args, kwargs, params=params, batch_dim=0,
                              module_path=module_path, on_per_sample_grad=on_per_sample_grad)


def cell_output_batch_size(module: nn.RNNCellBase, output) -> int | None:
    first = output[0] if isinstance(output, tuple) else output
    return first.shape[0] if isinstance(first, torch.Tensor) and first.dim() == 2 else None


register_per_sample_forward(*CELL_TYPES, output_batch_size=cell_output_batch_size, vmap_forward=_cell_forward)(
    cell_per_sample_forward
)
