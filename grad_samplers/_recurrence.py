"""The decomposed recurrence behind ``grad_samplers.rnn``: a recurrent layer run step by step in plain
differentiable operations, with every parameter's per-example gradients captured in one backward.

In training mode (nothing in the module changes: same parameters, same state dict):

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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from grad_samplers._common import common_dtype
from grad_samplers.functorch_fallback import PerSampleGradCallback

# Slots of one layer-direction's parameters, in this order everywhere below.
WEIGHT_NAMES = ("weight_ih", "bias_ih", "weight_hh", "bias_hh", "weight_hr")
W_IH, B_IH, W_HH, B_HH, W_HR = range(5)


# ---------------------------------------------------------------------------------- capture
@dataclass(eq=False)
class Direction:
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
    def forward(ctx, direction: Direction, x, w_ih, b_ih, w_hh, b_hh, w_hr):
        ctx.direction = direction
        ctx.save_for_backward(x, w_ih)
        gates = F.linear(x, w_ih, b_ih)
        if w_hr is None:
            return gates
        probe = gates.new_zeros(x.shape[0], x.shape[1], w_hr.shape[0])
        return gates, probe

    @staticmethod
    def backward(ctx, grad_gates, grad_projected=None):
        direction: Direction = ctx.direction
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
        grads: list[torch.Tensor | None] = [None] * len(WEIGHT_NAMES)
        slots = {slot for slot, _ in direction.trainable}
        per_sample = _per_sample_gradients(direction, slots, x.to(dtype), grad_gates, grad_projected)
        direction.released = True
        direction.previous_hidden = direction.reset_gates = direction.cell_outputs = None
        for slot, param in direction.trainable:
            direction.on_per_sample_grad(param, per_sample[slot])
            grads[slot] = per_sample[slot].sum(dim=0)
        return (None, grad_x, *grads)


def _per_sample_gradients(direction: Direction, slots: set, x, grad_gates, grad_projected) -> dict:
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
def cell_step(mode: str, gates_x, h, c, w_hh, b_hh):
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


def _run_direction(mode: str, x, keep, h, c, weights: tuple, direction: Direction | None):
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
        cell_output, c_new, r = cell_step(mode, gates_t, h, c, w_hh, b_hh)
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
    dtype = common_dtype(*tensors)
    return torch.stack([tensor.to(dtype) for tensor in tensors], dim=dim)


def _reverse_within_lengths(values: torch.Tensor, reverse_index: torch.Tensor | None) -> torch.Tensor:
    """``values`` (B, T, F) with each sequence reversed in time within its own length (an involution)."""
    if reverse_index is None:
        return values.flip(1)
    return values.gather(1, reverse_index.unsqueeze(-1).expand(-1, -1, values.shape[-1]))


def recurrence(module: nn.RNNBase, x, lengths, h0, c0, weight_of: Callable[[str], torch.Tensor | None],
                make_direction: Callable[[str, tuple], Direction | None]):
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
            weights = tuple(weight_of(name + suffix) for name in WEIGHT_NAMES)
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


__all__ = ["WEIGHT_NAMES", "Direction", "cell_step", "recurrence"]
