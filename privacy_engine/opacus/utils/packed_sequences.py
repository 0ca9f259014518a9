"""``opacus.utils.packed_sequences``: helpers for ``PackedSequence`` inputs of recurrent layers."""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

__all__ = ["compute_seq_lengths"]


def compute_seq_lengths(batch_sizes: torch.Tensor) -> list[int]:
    """The length of each sequence of a ``PackedSequence`` from its ``batch_sizes``, longest first
    (the order ``pack_padded_sequence`` sorts them in): sequence ``i`` lasts as many time steps as have
    more than ``i`` sequences."""
    sizes = [int(size) for size in batch_sizes]
    if not sizes:
        return []
    return [sum(1 for size in sizes if size > index) for index in range(sizes[0])]


def _gen_packed_data(minibatch_size: int, max_seq_length: int, input_dim: int, batch_first: bool,
                     sorted_: bool = False) -> PackedSequence:  # fmt: skip
    """A random ``PackedSequence`` of ``minibatch_size`` sequences with lengths drawn from
    ``1..max_seq_length`` and standard normal entries of size ``input_dim`` (drawn from torch's
    global generator); ``sorted_`` packs them already sorted longest first."""
    lengths = torch.randint(1, max_seq_length + 1, (minibatch_size,)).tolist()
    if sorted_:
        lengths = sorted(lengths, reverse=True)
    padded = torch.zeros(minibatch_size, max_seq_length, input_dim)
    for index, length in enumerate(lengths):
        padded[index, :length] = torch.randn(length, input_dim)
    if not batch_first:
        padded = padded.transpose(0, 1)
    return pack_padded_sequence(padded, lengths, batch_first=batch_first, enforce_sorted=sorted_)
