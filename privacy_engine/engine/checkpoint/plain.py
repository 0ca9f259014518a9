"""Plain data: what a checkpoint may hold, so that it loads with ``torch.load(weights_only=True)``."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

__all__ = ["check_plain"]

_PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_PLAIN_HINT = (
    "a checkpoint holds only tensors, numbers, strings, None, lists, tuples and dicts, so that it loads "
    "with torch.load(weights_only=True) and cannot run code; convert it (a dataclass with "
    "dataclasses.asdict, a torch.Generator with get_state(), a numpy array with torch.from_numpy, an "
    "object with its state_dict())"
)


def check_plain(value: Any, name: str = "checkpoint") -> None:
    """Raise ``TypeError`` naming the first entry of ``value`` that is not plain data.

    Plain data: ``None``, bool, int, float, complex, str, bytes, ``torch.dtype``,
    ``torch.device``, ``torch.Size``, tensors (``torch.Tensor`` / ``nn.Parameter``, their Python
    attributes plain too), and dict / OrderedDict / list / tuple of plain data (keys plain
    scalars or tuples of them). Exactly what ``torch.load(weights_only=True)`` rebuilds.

    ===============================  ======================================
    value                            result
    ===============================  ======================================
    plain data (nested)              returns None
    numpy array / scalar, dataclass  TypeError naming it (e.g. ``x['a'][2]``)
    namedtuple, defaultdict, enum    TypeError (subclasses pickle by class)
    a container that holds itself    TypeError
    ===============================  ======================================
    """
    _check_plain(value, name, set())


def _check_plain(value: Any, where: str, open_containers: set[int]) -> None:
    kind = type(value)
    if kind in _PLAIN_SCALARS or kind in (torch.dtype, torch.device, torch.Size):
        return
    if kind in (torch.Tensor, nn.Parameter):
        for attribute, item in vars(value).items():
            _check_plain(item, f"{where}.{attribute}", open_containers)
        return
    if kind not in (dict, OrderedDict, list, tuple):
        raise TypeError(f"{where} is a {kind.__module__}.{kind.__qualname__}: {_PLAIN_HINT}")
    if id(value) in open_containers:
        raise TypeError(f"{where} contains itself; a checkpoint must be a tree of plain data")
    open_containers.add(id(value))
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            if type(key) not in _PLAIN_SCALARS and type(key) is not tuple:
                raise TypeError(f"{where} has a key of type {type(key).__qualname__}: {_PLAIN_HINT}")
            if type(key) is tuple:
                _check_plain(key, f"{where} key {key!r}", open_containers)
            _check_plain(item, f"{where}[{key!r}]", open_containers)
    else:
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]", open_containers)
    open_containers.discard(id(value))
