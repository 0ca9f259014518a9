"""``nn.MultiheadAttention`` under fast clipping, decomposed: its input and output projections run as
gated linear maps (the three row blocks of ``in_proj_weight`` are disjoint, so their norms add), the
attention itself as in ``F.multi_head_attention_forward``. Calls the decomposition does not cover
(bias_k/bias_v, add_zero_attn, unusual shapes or masks) go to the ``torch.func`` fallback.

``AttentionDecomposition`` is a mixin of ``GhostClippingModule``. It reads ``_flags.inside_fallback`` and
feeds the batch-size bookkeeping (``_note_batch_size``); its gated pieces go through the gate
(``GatedLayers._gate_output``, which adds each call to ``_passes.pending``) and other calls through the
fallback (``_fallback_call``). It keeps no state of its own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from grad_samplers.linear import linear_squared_norms, linear_weighted_sums
from privacy_engine.capture.patched_forward import PatchedForward
from privacy_engine.clipping.ghost.uses import Rows, Use

__all__ = ["AttentionDecomposition"]


class AttentionDecomposition:
    """Mixin: the gated form of ``nn.MultiheadAttention``."""

    def _patch_attention(self, path: str, attention: nn.MultiheadAttention) -> None:
        # A PatchedForward, not a closure: the wrapped model stays picklable (torch.save).
        attention.forward = PatchedForward(self._attention_forward, path, attention, attention.forward)

    def _attention_forward(self, patched: PatchedForward, args: tuple, kwargs: dict):
        return self._decomposed_attention(patched.path, patched.module, patched.original, *args, **kwargs)

    def _decomposed_attention(self, path: str, attention: nn.MultiheadAttention, original, query, key, value,
                              key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True,
                              is_causal=False):  # fmt: skip
        """``attention``'s forward (``nn.MultiheadAttention``'s signature): decomposed in training mode."""
        call = (query, key, value)
        options = {
            "key_padding_mask": key_padding_mask,
            "need_weights": need_weights,
            "attn_mask": attn_mask,
            "average_attn_weights": average_attn_weights,
            "is_causal": is_causal,
        }
        if self._flags.inside_fallback or not (attention.training and torch.is_grad_enabled()):
            return original(*call, **options)
        params = {name: p for name, p in attention.named_parameters() if p.requires_grad}
        if not params:
            return original(*call, **options)
        if not _attention_decomposable(attention, query, key, value, key_padding_mask, attn_mask):
            return self._fallback_call(path, attention, original, call, options, params)
        return self._attention_call(path, attention, query, key, value, **options)

    def _gated_linear(self, path: str, layer: nn.Module, inputs: torch.Tensor, weight: nn.Parameter,
                      bias: nn.Parameter | None, weight_rows: Rows, bias_rows: Rows) -> torch.Tensor:
        """``F.linear(inputs, weight[rows], bias[rows])`` (batch first), gated: a piece of a layer."""
        weight_part = weight.detach() if weight_rows is None else weight.detach()[weight_rows]
        bias_part = None
        if bias is not None:
            bias_part = bias.detach() if bias_rows is None else bias.detach()[bias_rows]
        output = F.linear(inputs, weight_part, bias_part)
        train_weight = weight.requires_grad
        train_bias = bias is not None and bias.requires_grad
        if not (train_weight or train_bias):
            return output
        parts = []
        if train_weight:
            parts.append((weight, weight_rows))
        if train_bias:
            parts.append((bias, bias_rows))

        def keyed(weight_value, bias_value):
            result = {}
            if train_weight:
                result[weight] = weight_value
            if train_bias:
                result[bias] = bias_value
            return result

        def norms(activations, grads):
            return keyed(*linear_squared_norms(activations[0], grads, weight=train_weight, bias=train_bias))

        def sums(activations, grads, weights):
            return keyed(*linear_weighted_sums(activations[0], grads, weights, weight=train_weight, bias=train_bias))

        def per_sample(activations, grads):
            sequences = activations[0].reshape(grads.shape[0], -1, activations[0].shape[-1])
            flat_grads = grads.reshape(grads.shape[0], -1, grads.shape[-1])
            weight_value = torch.bmm(flat_grads.transpose(1, 2), sequences) if train_weight else None
            return keyed(weight_value, flat_grads.sum(dim=1) if train_bias else None)

        # batch_dim 0: the decomposition runs its projections batch first, whatever the module's layout.
        use = Use(path=path, layer=layer, parts=tuple(parts), activations=(inputs.detach(),),
                   norms=norms, sums=sums, grads=per_sample, batch_dim=0, stacks_users=True)
        return self._gate_output(use, output, True, (inputs,))

    def _attention_call(self, path, attention: nn.MultiheadAttention, query, key, value, *, key_padding_mask,
                        need_weights, attn_mask, average_attn_weights, is_causal):
        if not attention.batch_first:
            # Batch first from here on: the gated projections need the example axis in front.
            same_kv = key is value
            same_qk = query is key
            query = query.transpose(0, 1)
            key = query if same_qk else key.transpose(0, 1)
            value = key if same_kv else value.transpose(0, 1)
        batch_size, target_length, embed_dim = query.shape
        source_length = key.shape[1]
        heads, head_dim = attention.num_heads, attention.head_dim
        self._note_batch_size(path, batch_size)
        bias = attention.in_proj_bias
        rows = [slice(i * embed_dim, (i + 1) * embed_dim) for i in range(3)]
        if attention._qkv_same_embed_dim:
            weight = attention.in_proj_weight
            if query is key and key is value:
                projected = self._gated_linear(path, attention, query, weight, bias, None, None)
                q, k, v = projected.chunk(3, dim=-1)
            else:
                q, k, v = (
                    self._gated_linear(path, attention, x, weight, bias, r, r)
                    for x, r in zip((query, key, value), rows)
                )
        else:
            weights = (attention.q_proj_weight, attention.k_proj_weight, attention.v_proj_weight)
            q, k, v = (
                self._gated_linear(path, attention, x, w, bias, None, r)
                for x, w, r in zip((query, key, value), weights, rows)
            )
        q = q.reshape(batch_size, target_length, heads, head_dim).transpose(1, 2)
        k = k.reshape(batch_size, source_length, heads, head_dim).transpose(1, 2)
        v = v.reshape(batch_size, source_length, heads, head_dim).transpose(1, 2)

        mask, causal = _attention_mask(
            key_padding_mask, attn_mask, is_causal, need_weights, query.dtype, batch_size, heads, target_length, source_length
        )
        dropout_p = attention.dropout
        weights_out = None
        if need_weights:
            scores = torch.matmul(q * math.sqrt(1.0 / head_dim), k.transpose(-2, -1))
            if mask is not None:
                scores = scores + mask
            probabilities = torch.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                probabilities = F.dropout(probabilities, p=dropout_p)
            context = torch.matmul(probabilities, v)
            weights_out = probabilities.mean(dim=1) if average_attn_weights else probabilities
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal)
        context = context.transpose(1, 2).reshape(batch_size, target_length, embed_dim)
        out_proj = attention.out_proj
        output = self._gated_linear(f"{path}.out_proj" if path else "out_proj", out_proj, context,
                                    out_proj.weight, out_proj.bias, None, None)
        if not attention.batch_first:
            output = output.transpose(0, 1)
        return output, weights_out


def _attention_decomposable(attention: nn.MultiheadAttention, query, key, value, key_padding_mask, attn_mask) -> bool:
    """Whether the gated decomposition covers this call; otherwise the fallback runs it (and raises
    torch's own errors for malformed inputs)."""
    if attention.bias_k is not None or attention.bias_v is not None or attention.add_zero_attn:
        return False
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (query, key, value)):
        return False
    batch_axis = 0 if attention.batch_first else 1
    sequence_axis = 1 - batch_axis
    batch_size = query.shape[batch_axis]
    if key.shape[batch_axis] != batch_size or value.shape[batch_axis] != batch_size:
        return False
    if key.shape[sequence_axis] != value.shape[sequence_axis] or query.shape[-1] != attention.embed_dim:
        return False
    if key.shape[-1] != attention.kdim or value.shape[-1] != attention.vdim:
        return False
    for mask in (key_padding_mask, attn_mask):
        if mask is not None and not (mask.dtype == torch.bool or mask.is_floating_point()):
            return False
    source_length, target_length = key.shape[sequence_axis], query.shape[sequence_axis]
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (batch_size, source_length):
        return False
    allowed_mask_shapes = ((target_length, source_length), (batch_size * attention.num_heads, target_length, source_length))
    return attn_mask is None or tuple(attn_mask.shape) in allowed_mask_shapes


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


def _attention_mask(key_padding_mask, attn_mask, is_causal, need_weights, dtype, batch_size, heads, target_length,
                    source_length):
    """The additive mask ``(B or 1, H or 1, L, S)`` and causal flag, merged as ``F.multi_head_attention_forward``
    merges them."""
    key_padding_mask = _additive_mask(key_padding_mask, dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        return None, True
    attn_mask = _additive_mask(attn_mask, dtype)
    if key_padding_mask is not None:
        is_causal = False
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            attn_mask = attn_mask.view(1, 1, target_length, source_length)
        else:
            attn_mask = attn_mask.view(batch_size, heads, target_length, source_length)
    if key_padding_mask is not None:
        padding = key_padding_mask.view(batch_size, 1, 1, source_length)
        attn_mask = padding if attn_mask is None else attn_mask + padding
    return attn_mask, is_causal and attn_mask is None
