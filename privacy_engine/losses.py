"""Per-example losses: each example's loss depends on that example alone.

DP-SGD bounds the influence of one example by clipping *its* gradient; that bound assumes the gradient of
example ``i`` depends on example ``i`` only. A token loss averaged over every labelled token of the batch
(``nn.CrossEntropyLoss()(logits.view(-1, V), labels.view(-1))``, or a Hugging Face model called with
``labels=``) breaks it: one long example changes the weight of every other example's tokens, so adding or
removing it moves the released gradient by more than the clipping bound. The functions here normalise each
example by its own size, then reduce over examples.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

__all__ = ["per_example_token_cross_entropy"]

REDUCTIONS = ("mean", "sum", "none")


def per_example_token_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    shift: bool = False,
    reduction: str = "mean",
) -> torch.Tensor:
    """Token cross-entropy where each example is the mean over its own labelled tokens.

    Example ``i``'s loss is ``l_i = sum_t CE(logits[i, t], labels[i, t]) / n_i`` over its ``n_i`` positions
    whose label is not ``ignore_index`` -- exactly what the usual token-mean cross-entropy gives on a batch
    holding example ``i`` alone. ``reduction="mean"`` returns ``mean_i l_i`` (the batch reduction a wrapper
    with ``loss_reduction="mean"`` undoes per example), ``"sum"`` returns ``sum_i l_i``, ``"none"`` the
    ``(batch,)`` vector of ``l_i``.

    Guarantee: ``l_i`` (value and gradient) depends on ``logits[i]`` and ``labels[i]`` only, whatever the other
    examples' lengths or padding, so per-example clipping of its gradient bounds example ``i``'s influence on
    the step. With ``shift=True`` (causal language models: the logits at position ``t`` predict the label at
    ``t + 1``) the terms are ``CE(logits[i, t], labels[i, t + 1])`` for ``t < T - 1``, as Hugging Face's
    ``ForCausalLMLoss`` forms them.

    Low-precision logits (float16, bfloat16) are upcast to float32 for the loss; float32 and float64 are kept.

    ==================================  ===========================================================
    case                                result
    ==================================  ===========================================================
    example with no labelled token      ``l_i = 0`` with zero gradient (a batch of one gives NaN)
    every example unlabelled            0 (``"mean"`` or ``"sum"``)
    empty batch (0 examples)            0 for ``"mean"`` or ``"sum"``; an empty vector for ``"none"``
    ``shift=True`` and ``T = 1``        every ``l_i = 0`` (nothing to predict)
    NaN/Inf logits in example ``i``     ``l_i`` NaN/Inf; other examples unaffected
    label out of ``[0, V)``, not        the error of ``F.cross_entropy``
    ``ignore_index``
    ``logits`` shape not labels'        ``ValueError`` naming both shapes
    shape + ``(V,)``; float labels
    unknown ``reduction``               ``ValueError`` listing the allowed values
    ==================================  ===========================================================

    Args:
        logits: ``(batch, T, V)`` scores (or ``(batch, *positions, V)``: every dimension between the batch and
            the classes counts as token positions; with ``shift`` exactly one such dimension).
        labels: ``(batch, T)`` class indices, ``ignore_index`` where there is no label (padding).
        ignore_index: the label value of unlabelled positions.
        shift: compare ``logits[:, :-1]`` with ``labels[:, 1:]`` (next-token prediction).
        reduction: ``"mean"`` or ``"sum"`` over examples, or ``"none"``.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("logits and labels must be tensors")
    if labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"labels must hold class indices (an integer dtype); got {labels.dtype}")
    if logits.dim() != labels.dim() + 1 or logits.shape[:-1] != labels.shape or labels.dim() < 1:
        raise ValueError(
            f"logits must have shape labels.shape + (num_classes,) with a batch dimension first; got logits "
            f"{tuple(logits.shape)} and labels {tuple(labels.shape)}"
        )
    if shift:
        if labels.dim() != 2:
            raise ValueError(f"shift=True needs labels of shape (batch, T); got {tuple(labels.shape)}")
        logits, labels = logits[:, :-1], labels[:, 1:]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    batch, positions = labels.shape[0], math.prod(labels.shape[1:])
    flat_labels = labels.reshape(batch, positions)
    terms = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), flat_labels.reshape(-1), ignore_index=ignore_index, reduction="none"
    ).view(batch, positions)
    counts = (flat_labels != ignore_index).sum(dim=1)
    # cross_entropy gives exactly 0 at ignored positions, so the sum over an unlabelled example is 0 and
    # dividing by max(n_i, 1) makes it contribute 0 instead of the batch-of-one NaN.
    per_example = terms.sum(dim=1) / counts.clamp(min=1).to(terms.dtype)
    if reduction == "none":
        return per_example
    if reduction == "sum" or batch == 0:
        return per_example.sum()
    return per_example.mean()
