"""``opacus.layers.dp_rnn``: ``DPLSTM``, ``DPGRU``, ``DPRNN``, the engine's recurrent layers
(``privacy_engine.opacus.recurrent``: torch's layers under Opacus's names, exact per-sample gradients,
torch's state dict). A version of the engine without them serves stand-ins that raise
``NotImplementedError`` when used (``privacy_engine.opacus._lazy``)."""

from __future__ import annotations

from privacy_engine.opacus._lazy import lazy_attribute

__all__ = ["DPGRU", "DPLSTM", "DPRNN"]

_WHAT = "a recurrent layer with exact per-sample gradients"
DPLSTM = lazy_attribute("DPLSTM", "privacy_engine.opacus.recurrent", ("DPLSTM",), _WHAT)
DPGRU = lazy_attribute("DPGRU", "privacy_engine.opacus.recurrent", ("DPGRU",), _WHAT)
DPRNN = lazy_attribute("DPRNN", "privacy_engine.opacus.recurrent", ("DPRNN",), _WHAT)
