"""``opacus.utils.tensor_utils.unfold2d``: the patches of a 2-D convolution's input, as ``torch.nn.functional.unfold``
gives them, with Opacus's keyword arguments (``padding`` may also be ``"same"`` or ``"valid"``)."""

from __future__ import annotations

import torch
from torch.nn import functional

__all__ = ["unfold2d"]


def unfold2d(input: torch.Tensor, *, kernel_size: tuple[int, int], padding: str | tuple[int, int],
             stride: tuple[int, int], dilation: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """The sliding ``kernel_size`` patches of ``input`` (``(..., C, H, W)``) as columns: ``(N, C * kH * kW,
    L)``, equal to ``torch.nn.functional.unfold`` with the same arguments. ``padding="same"`` pads
    ``dilation * (k - 1)`` in total per dimension (the smaller half first, as ``nn.Conv2d`` does);
    ``"valid"`` pads nothing; any other string raises ``ValueError``."""
    if isinstance(padding, str):
        if padding == "valid":
            padding = (0, 0)
        elif padding == "same":
            total_h, total_w = (dilation[0] * (kernel_size[0] - 1), dilation[1] * (kernel_size[1] - 1))
            left_h, left_w = total_h // 2, total_w // 2
            input = functional.pad(input, (left_w, total_w - left_w, left_h, total_h - left_h))
            padding = (0, 0)
        else:
            raise ValueError(f"padding must be 'same', 'valid' or a pair of ints; got {padding!r}")
    channels, height, width = input.shape[-3:]
    batched = input.reshape(-1, channels, height, width)
    return functional.unfold(batched, kernel_size=kernel_size, dilation=dilation, padding=padding, stride=stride)
