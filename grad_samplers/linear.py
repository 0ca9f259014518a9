"""nn.Linear: the weight's per-sample gradient is the outer product of output gradient and input,
summed over any dimensions between the batch and the features."""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from grad_samplers.registry import register_grad_sampler


@register_grad_sampler(nn.Linear)
def linear_grad_sample(layer: nn.Linear, activations, backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    inputs = activations[0]
    batch_size = backprops.shape[0]
    per_sample: Dict[nn.Parameter, torch.Tensor] = {}
    if inputs.dim() == 2:
        # One row per example: a batched outer product, written directly in its final layout.
        if layer.weight.requires_grad:
            per_sample[layer.weight] = backprops.unsqueeze(2) * inputs.unsqueeze(1)
        if layer.bias is not None and layer.bias.requires_grad:
            per_sample[layer.bias] = backprops
        return per_sample
    grads = backprops.reshape(batch_size, -1, backprops.shape[-1])
    if layer.weight.requires_grad:
        per_sample[layer.weight] = torch.bmm(grads.transpose(1, 2), inputs.reshape(batch_size, -1, inputs.shape[-1]))
    if layer.bias is not None and layer.bias.requires_grad:
        per_sample[layer.bias] = grads.sum(dim=1)
    return per_sample
