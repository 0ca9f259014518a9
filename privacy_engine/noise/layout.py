"""The flat layout of the noise over the tensors, and the seeds of each device's generators.

Tensors are grouped by device (in order of first appearance) and, within a device, laid end to end
in one flat vector of ``numel`` entries (a ``_DeviceGroup``). Each device draws from its own
``torch.Generator`` streams, derived from one seed (or, in secure mode, set from the OS).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# In secure mode each noise value is the sum of this many independent draws (each with std s / 2),
# one per generator, every generator's state set from OS entropy (``full_entropy_generator``: the
# whole 19937-bit Mersenne Twister state on CPU, 64 seed bits for Philox on CUDA). The sum is not
# there for entropy but against floating-point attacks: one sampler's outputs form a sparse,
# uneven set of floats that can betray the value the noise was added to; a sum of four blurs it.
_SECURE_MODE_GENERATORS = 4


def _global_generator_seed(generator: torch.Generator | None = None) -> int:
    """A 62-bit seed drawn from ``generator`` (default: torch's global CPU generator, what
    ``torch.manual_seed`` sets)."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64, generator=generator).item())


def _derived_seed(seed: int, device_index: int, generator_index: int, layout: int = 0) -> int:
    # SeedSequence spawns statistically independent streams for each (device, generator) pair
    # from one user seed; neighbouring integers as seeds would be correlated for some PRNGs.
    # ``layout`` counts layout restarts: each restart gets fresh streams (noise is never reused).
    key = (device_index, generator_index) if layout == 0 else (device_index, generator_index, layout)
    sequence = np.random.SeedSequence(entropy=seed, spawn_key=key)
    return int(sequence.generate_state(1, dtype=np.uint64)[0])


@functools.cache
def _generator_state_size(device_type: str) -> int | None:
    """Bytes in a ``get_state()`` of a generator on this device type (None if none can be made here)."""
    try:
        return int(torch.Generator(device=device_type).get_state().numel())
    except (RuntimeError, TypeError):
        return None


def _noise_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    # Half-precision noise would lose the small differences BandMF relies on to cancel noise
    # across steps, so noise is at least float32, and float64 if any tensor needs it.
    return torch.float64 if torch.float64 in dtypes else torch.float32


@dataclass(eq=False)
class _DeviceGroup:
    """The tensors on one device and the state that draws their noise."""

    device: torch.device
    tensor_indices: list[int]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    generators: list[torch.Generator]
    noise: torch.Tensor | None = None  # this step's flat noise, shape (numel,)
    secure_scratch: torch.Tensor | None = None
    history: torch.Tensor | None = None  # past noise rows the mechanism keeps, shape (rows, numel), saved
    mechanism_buffers: Any = None  # the mechanism's other per-device buffers, of a type it declares
    noise_views: list[torch.Tensor] = field(default_factory=list)
    # The next step's draw, made ahead on a background thread (privacy_engine.noise.prefetch): its buffer,
    # views of it, secure-mode scratch, and the copies of the generators it is drawn from.
    next_noise: torch.Tensor | None = None
    next_views: list[torch.Tensor] = field(default_factory=list)
    next_scratch: torch.Tensor | None = None
    shadow_generators: list[torch.Generator] = field(default_factory=list)
    formed_ahead: bool = False  # group.noise already holds this step's formed noise (drawn and formed ahead)
    add_plan: _AddPlan | None = None  # how a chunked draw is added into the tensors (NoiseMechanism._draw_into_tensors)


@dataclass(frozen=True)
class _AddPlan:
    """How a device's flat noise, drawn chunk by chunk, is added into its tensors piece by piece (plain integers).

    The tensors are cut into pieces (flat, in layout order) so that no piece spans two tensors or two chunks or
    holds more than ``max_piece`` entries: ``tensor_piece_sizes[k]`` are tensor ``k``'s piece sizes, in order; the
    pieces of chunk ``c`` are pieces ``chunk_pieces[c][0]`` to ``chunk_pieces[c][1] - 1`` of all tensors' pieces
    in layout order, and ``chunk_piece_sizes[c]`` their sizes (they tile the chunk)."""

    tensor_piece_sizes: tuple[tuple[int, ...], ...]
    chunk_pieces: tuple[tuple[int, int], ...]
    chunk_piece_sizes: tuple[tuple[int, ...], ...]
    chunk_numel: int = 0  # the chunk size the plan was made for (a stream switched on resume needs a new plan)


def _add_plan(
    numels: Sequence[int], bounds: Sequence[tuple[int, int]], max_piece: int, chunk_numel: int = 0
) -> _AddPlan:
    """The ``_AddPlan`` of tensors of ``numels`` entries laid end to end, drawn in chunks ``bounds`` (``(start, end)``,
    tiling ``sum(numels)``; ``chunk_numel``: their nominal size, recorded), with pieces of at most ``max_piece``
    entries."""
    tensor_piece_sizes, piece_chunks, piece_sizes = [], [], []
    chunk, offset = 0, 0
    for numel in numels:
        sizes, position = [], 0
        while position < numel:
            while bounds[chunk][1] <= offset + position:
                chunk += 1
            end = min(numel, position + max_piece, bounds[chunk][1] - offset)
            sizes.append(end - position)
            piece_chunks.append(chunk)
            position = end
        tensor_piece_sizes.append(tuple(sizes))
        piece_sizes.extend(sizes)
        offset += numel
    chunk_pieces, chunk_piece_sizes, first = [], [], 0
    for index in range(len(bounds)):
        last = first
        while last < len(piece_chunks) and piece_chunks[last] == index:
            last += 1
        chunk_pieces.append((first, last))
        chunk_piece_sizes.append(tuple(piece_sizes[first:last]))
        first = last
    return _AddPlan(tuple(tensor_piece_sizes), tuple(chunk_pieces), tuple(chunk_piece_sizes), chunk_numel)
