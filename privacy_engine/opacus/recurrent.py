"""Recurrent layers under the names Opacus users know: ``DPLSTM``, ``DPGRU``, ``DPRNN`` (served as
``privacy_engine.opacus.layers``' names, as Opacus's ``opacus.layers``).

Plain ``nn.LSTM``/``nn.GRU``/``nn.RNN`` already get exact per-sample gradients here (see
``grad_samplers.rnn``), so these classes are only the torch layers under another name: subclasses with
the same parameters, the same forward and the same state dict as ``nn.LSTM`` & co. (a pretrained torch
layer's state dict loads into them and theirs into a torch layer). The constructors take Opacus's
arguments in Opacus's order (for ``DPRNN`` that order differs from ``nn.RNN``'s: ``nonlinearity`` comes
last), plus torch's ``device`` and ``dtype`` keywords.

Differences from Opacus: ``DPLSTM(proj_size > 0)`` works (Opacus raises ``NotImplementedError``); state
dicts saved by Opacus versions whose DP layers had per-cell submodules (keys ``l0.ih.weight``,
``l0_reverse.hh.bias``) load too, into these classes directly, or into torch layers after
``torch_rnn_state_dict(state_dict)``.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["DPGRU", "DPLSTM", "DPRNN", "torch_rnn_state_dict"]

# l{layer}[_reverse].{ih|hh}.{weight|bias}: Opacus's per-cell key (before its parameters were renamed).
_OPACUS_CELL_KEY = re.compile(r"(?P<scope>^|.*\.)l(?P<layer>\d+)(?P<reverse>_reverse)?\.(?P<matrix>ih|hh)\.(?P<kind>weight|bias)$")


def _torch_key(key: str) -> str:
    match = _OPACUS_CELL_KEY.match(key)
    if match is None:
        return key
    return f"{match['scope']}{match['kind']}_{match['matrix']}_l{match['layer']}{match['reverse'] or ''}"


def torch_rnn_state_dict(state_dict: Mapping[str, torch.Tensor]) -> OrderedDict:
    """``state_dict`` with Opacus's per-cell recurrent keys (``lstm.l0.ih.weight``, ``l1_reverse.hh.bias``)
    renamed to torch's (``lstm.weight_ih_l0``, ``bias_hh_l1_reverse``); every other key unchanged.

    For loading an old Opacus DPLSTM/DPGRU/DPRNN checkpoint into a model built from ``nn.LSTM`` & co.
    (this module's ``DPLSTM`` & co. accept such keys without it). Raises ``ValueError`` if two keys would
    get the same name (the state dict has both spellings of one parameter)."""
    renamed: OrderedDict = OrderedDict()
    for key, value in state_dict.items():
        new_key = _torch_key(key)
        if new_key in renamed:
            raise ValueError(f"state dict has both {key!r} and {new_key!r}: two values for one parameter")
        renamed[new_key] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        renamed._metadata = metadata
    return renamed


class _AcceptsOpacusKeys:
    """Loads Opacus's per-cell keys (``l0.ih.weight``) under this layer's prefix as torch's names."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # ``state_dict`` is load_state_dict's own copy: renaming in it changes nothing of the caller's.
        for key in [k for k in state_dict if k.startswith(prefix)]:
            new_key = prefix + _torch_key(key[len(prefix) :])
            if new_key != key and new_key not in state_dict:
                state_dict[new_key] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class DPLSTM(_AcceptsOpacusKeys, nn.LSTM):
    """``nn.LSTM`` under Opacus's name (same parameters, forward and state dict); arguments as Opacus's
    ``DPLSTM``. Exact per-sample gradients come from ``grad_samplers.rnn``, as for ``nn.LSTM``."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(
            input_size, hidden_size, num_layers=num_layers, bias=bias, batch_first=batch_first, dropout=dropout,
            bidirectional=bidirectional, proj_size=proj_size, device=device, dtype=dtype,
        )


class DPGRU(_AcceptsOpacusKeys, nn.GRU):
    """``nn.GRU`` under Opacus's name; arguments as Opacus's ``DPGRU`` (``proj_size`` must be 0)."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        *,
        device=None,
        dtype=None,
    ) -> None:
        if proj_size:
            raise ValueError(f"DPGRU: proj_size must be 0 (only LSTM has projections); got {proj_size}")
        super().__init__(
            input_size, hidden_size, num_layers=num_layers, bias=bias, batch_first=batch_first, dropout=dropout,
            bidirectional=bidirectional, device=device, dtype=dtype,
        )


class DPRNN(_AcceptsOpacusKeys, nn.RNN):
    """``nn.RNN`` under Opacus's name; arguments as Opacus's ``DPRNN``: ``nonlinearity`` ("tanh" or
    "relu") comes last, after ``proj_size`` (which must be 0), not fourth as in ``nn.RNN``."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        nonlinearity: str = "tanh",
        *,
        device=None,
        dtype=None,
    ) -> None:
        if isinstance(bias, str):
            raise TypeError(
                f"DPRNN takes Opacus's argument order (input_size, hidden_size, num_layers, bias, batch_first, "
                f"dropout, bidirectional, proj_size, nonlinearity); got bias={bias!r}, which looks like nn.RNN's "
                f"order. Pass nonlinearity={bias!r} as a keyword."
            )
        if proj_size:
            raise ValueError(f"DPRNN: proj_size must be 0 (only LSTM has projections); got {proj_size}")
        super().__init__(
            input_size, hidden_size, num_layers=num_layers, nonlinearity=nonlinearity, bias=bias,
            batch_first=batch_first, dropout=dropout, bidirectional=bidirectional, device=device, dtype=dtype,
        )
