"""``opacus.distributed``: ``DifferentiallyPrivateDistributedDataParallel``, Opacus's name for the engine's
``PrivateDataParallel`` (``privacy_engine.training.distributed``): ``make_private`` recognises it, as it recognises torch's own
``DistributedDataParallel``. Importing this module never needs a process group; building the
wrapper does (as with Opacus)."""

from __future__ import annotations

from privacy_engine.opacus._lazy import lazy_attribute

__all__ = ["DifferentiallyPrivateDistributedDataParallel"]  # noqa: F822  (served by __getattr__ below)


def __getattr__(name: str):
    if name == "DifferentiallyPrivateDistributedDataParallel":
        return lazy_attribute(name, "privacy_engine.training.distributed", ("PrivateDataParallel",),
                              "distributed data parallel training")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
