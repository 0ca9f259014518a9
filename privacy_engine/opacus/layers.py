"""``opacus.layers``: ``DPLSTM``, ``DPGRU``, ``DPRNN`` (the engine's recurrent layers,
``privacy_engine.opacus.recurrent``: torch's layers under Opacus's names, with exact per-sample gradients and
torch's state dict) and ``DPMultiheadAttention``.

``DPMultiheadAttention(...)`` builds a plain ``nn.MultiheadAttention`` with Opacus's constructor
arguments (the same as torch's): the engine computes its exact per-sample gradients (the
``torch.func`` path, or fast clipping in ghost mode) without a rewritten layer. Its state dict is
torch's (``in_proj_weight``, ...), not that of Opacus's rewritten layer (``qlinear``, ``klinear``,
...), so Opacus ``DPMultiheadAttention`` checkpoints do not load into it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from privacy_engine.opacus._lazy import lazy_attribute

__all__ = ["DPGRU", "DPLSTM", "DPRNN", "DPMultiheadAttention"]  # noqa: F822  (names served by __getattr__)

_RECURRENT = ("DPLSTM", "DPGRU", "DPRNN")


class DPMultiheadAttention(nn.MultiheadAttention):
    """Opacus's name: calling it returns an ``nn.MultiheadAttention`` built with the same arguments
    (see the module docstring), so every path of the engine that knows torch's attention applies."""

    def __new__(cls, *args: Any, **kwargs: Any) -> nn.MultiheadAttention:
        # An instance of torch's class, not of this subclass: the engine treats exactly
        # nn.MultiheadAttention specially (layout, fast clipping), so the type must be torch's.
        return nn.MultiheadAttention(*args, **kwargs)


def __getattr__(name: str):
    if name in _RECURRENT:
        return lazy_attribute(name, "privacy_engine.opacus.recurrent", (name,), "a recurrent layer with exact per-sample gradients")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
