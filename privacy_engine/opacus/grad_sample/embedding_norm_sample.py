"""``opacus.grad_sample.embedding_norm_sample``: per-example gradient norms of an ``nn.Embedding``
without forming the per-example gradients, on the engine's sampler (``grad_samplers.embedding``)."""

from __future__ import annotations

import torch
from torch import nn

from grad_samplers.embedding import embedding_norm_sample

__all__ = ["compute_embedding_norm_sample"]


def compute_embedding_norm_sample(layer: nn.Embedding, activations, backprops: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
    """``{layer.weight: (batch,) L2 norms}`` of each example's gradient of the embedding weight
    (``activations``: the layer's inputs, ``activations[0]`` the indices; ``backprops``: the output
    gradient, batch first). Opacus's function returns norms; the engine's sampler returns squared
    norms, whose square root (rounding below zero clamped) this is. A frozen weight gives ``{}``;
    ``padding_idx`` lookups contribute nothing; ``scale_grad_by_freq=True`` raises ``ValueError``."""
    squared = embedding_norm_sample(layer, activations, backprops)
    return {param: torch.sqrt(torch.clamp(values, min=0)) for param, values in squared.items()}
