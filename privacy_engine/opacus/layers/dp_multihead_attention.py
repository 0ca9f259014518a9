"""``opacus.layers.dp_multihead_attention``: ``DPMultiheadAttention`` and ``SequenceBias``.

``DPMultiheadAttention(...)`` builds a plain ``nn.MultiheadAttention`` with Opacus's constructor
arguments (the same as torch's): the engine computes its exact per-sample gradients (the
``torch.func`` path, or fast clipping in ghost mode) without a rewritten layer. Its state dict is
torch's (``in_proj_weight``, ...), not that of Opacus's rewritten layer (``qlinear``, ``klinear``,
...), so Opacus ``DPMultiheadAttention`` checkpoints do not load into it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["DPMultiheadAttention", "SequenceBias"]


class DPMultiheadAttention(nn.MultiheadAttention):
    """Opacus's name: calling it returns an ``nn.MultiheadAttention`` built with the same arguments
    (see the module docstring), so every path of the engine that knows torch's attention applies."""

    def __new__(cls, *args: Any, **kwargs: Any) -> nn.MultiheadAttention:
        # An instance of torch's class, not of this subclass: the engine treats exactly
        # nn.MultiheadAttention specially (layout, fast clipping), so the type must be torch's.
        return nn.MultiheadAttention(*args, **kwargs)


class SequenceBias(nn.Module):
    """One learned vector appended to every sequence as an extra last position (Opacus's layer, used
    by attention's ``add_bias_kv``).

    Input ``(L, N, E)`` gives ``(L + 1, N, E)`` (``batch_first=False``, the default); with
    ``batch_first=True``, ``(N, L, E)`` gives ``(N, L + 1, E)``. ``bias`` has shape ``(E,)`` and starts
    from a standard normal draw. Its per-sample gradients come from the engine's generic
    ``torch.func`` path (no dedicated sampler is needed: each example's gradient is the output
    gradient at its appended position).
    """

    def __init__(self, embed_dim: int, batch_first: bool = False) -> None:
        super().__init__()
        if int(embed_dim) <= 0:
            raise ValueError(f"SequenceBias: embed_dim must be a positive integer; got {embed_dim!r}")
        self.batch_first = batch_first
        self.bias = nn.Parameter(torch.empty(int(embed_dim)))
        nn.init.normal_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with ``bias`` appended along the sequence dimension, once per example."""
        sequence_dim = 1 if self.batch_first else 0
        shape = list(x.shape)
        shape[sequence_dim] = 1
        appended = self.bias.to(x.dtype).expand(*shape[:-1], self.bias.shape[0])
        return torch.cat([x, appended], dim=sequence_dim)
