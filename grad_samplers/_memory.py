"""Allocation of large per-sample gradient tensors.

Per-sample gradients are big (batch x parameters: 684 MB for a 784-512-512-10 MLP at batch 256)
and freshly allocated at every backward. On Linux a fresh large block is mapped page by page at
first write: with 4 KiB pages that is one page fault per 4 KiB, which on the machines we measured
(virtual machines especially) costs several times the writing itself. Asking the kernel for
transparent huge pages (``madvise(MADV_HUGEPAGE)``, honoured when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``) cuts the faults 512-fold.

This is only a hint about how to back memory we own: contents, layout and lifetime of the tensor
are those of ``torch.empty``. Where the hint is unavailable (not Linux, no THP, not CPU) nothing
changes. Setting the environment variable ``THP_MEM_ALLOC_ENABLE=1`` before starting Python makes
PyTorch do the same for every large CPU tensor.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from collections.abc import Sequence

import torch

_THP_SETTINGS = "/sys/kernel/mm/transparent_hugepage"
# Below this a block spans too few huge pages to matter and the system call would dominate.
_MIN_ADVISED_BYTES = 4 << 20


def _read_setting(name: str) -> str:
    try:
        with open(f"{_THP_SETTINGS}/{name}") as setting:
            return setting.read().strip()
    except OSError:
        return ""


def _huge_page_bytes() -> int:
    size = _read_setting("hpage_pmd_size")
    return int(size) if size.isdigit() else 2 << 20


def _load_madvise():
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    if "[never]" in _read_setting("enabled"):
        return None  # the kernel would ignore the advice: save the system calls
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_HUGE_PAGE = _huge_page_bytes()
_madvise = _load_madvise()


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask the kernel to back ``tensor``'s not-yet-touched memory with huge pages; True if asked.

    Only the whole huge pages (2 MiB on x86-64) inside the tensor's own bytes are advised, so memory next to it
    (another allocation) is never affected. Call it before writing to the tensor.
    """
    if _madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    start = tensor.data_ptr()
    size = tensor.numel() * tensor.element_size()
    if size < _MIN_ADVISED_BYTES:
        return False
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    last = (start + size) // _HUGE_PAGE * _HUGE_PAGE
    if last <= first:
        return False
    return _madvise(first, last - first, mmap.MADV_HUGEPAGE) == 0


def empty_per_sample(shape: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape)``, huge-page backed where possible (for tensors that are written next)."""
    tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
    if _madvise is not None and tensor.numel() * tensor.element_size() >= _MIN_ADVISED_BYTES:
        advise_huge_pages(tensor)  # (a smaller block is never advised: skip the call and its checks)
    return tensor


def zeros_per_sample(shape: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape)``, huge-page backed where possible: ``empty_per_sample(...).zero_()`` for a block large
    enough to be advised, one ``torch.zeros`` (the same zeros, one op instead of two) below that."""
    shape = tuple(shape)
    if _madvise is None or math.prod(shape) * dtype.itemsize < _MIN_ADVISED_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return empty_per_sample(shape, dtype=dtype, device=device).zero_()


__all__ = ["advise_huge_pages", "empty_per_sample", "zeros_per_sample"]
