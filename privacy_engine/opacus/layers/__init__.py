"""``opacus.layers``: ``DPLSTM``, ``DPGRU``, ``DPRNN`` (the engine's recurrent layers,
``privacy_engine.opacus.recurrent``: torch's layers under Opacus's names, with exact per-sample gradients and
torch's state dict), ``DPMultiheadAttention`` and ``SequenceBias``.

Opacus's submodule paths work too: ``opacus.layers.dp_multihead_attention`` (``dp_multihead_attention.py``:
``DPMultiheadAttention``, ``SequenceBias``) and ``opacus.layers.dp_rnn`` (``dp_rnn.py``: the recurrent
layers).
"""

from __future__ import annotations

from privacy_engine.opacus.layers.dp_multihead_attention import DPMultiheadAttention, SequenceBias
from privacy_engine.opacus.layers.dp_rnn import DPGRU, DPLSTM, DPRNN

__all__ = ["DPGRU", "DPLSTM", "DPRNN", "DPMultiheadAttention", "SequenceBias"]
