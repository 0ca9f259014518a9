"""A noise stream addressed by (key, step, chunk) that several threads can draw at once (``"counter-v1"``).

Why. torch's CPU ``normal_`` draws from one Mersenne Twister (MT19937) one value after another: the
stream cannot be split, so a step's noise takes one core however many there are. This stream cuts each
device's flat noise vector into chunks of ``CHUNK_NUMEL`` entries (fixed: the numbers do not depend on the
thread count) and gives every chunk of every step its own generator, so the chunks are drawn in parallel.

How a chunk's generator is made. A Philox4x64-10 counter-based generator (numpy's ``Philox``) keyed by
the run's 128-bit key produces, at counter ``(block, step, 0, 0)``, the 624 32-bit words of chunk
``c``'s MT19937 state (blocks ``78 c + 1`` to ``78 c + 78``: numpy's Philox steps its counter before each
block), low 32 bits of each 64-bit output first; torch's ``normal_`` then draws the chunk from that
state. Every (key, step, chunk) thus has its own full 19937-bit MT state, a different Philox counter
block for each (no two chunks, steps or keys share a Philox output), and the chunk is drawn by torch's
own Gaussian sampler (same speed per value as the serial stream). ``manual_seed`` is not used: on CPU
it keeps 32 bits, so per-chunk seeds would collide after about 2**16 chunks.

The key comes from the run's seed (``stream_key``: numpy's ``SeedSequence`` over the seed, the
device's index and the number of layout restarts) or, in secure mode, from ``os.urandom``
(``secure_stream_keys``: four 128-bit keys per device, never saved; each value is the sum of one draw
per key at ``std / 2``, as the serial stream's secure mode sums four generators).

Resuming needs no generator state: the key and the step index determine every value. On devices other
than the CPU the step's noise is one chunk drawn by the device's generator seeded with 64 bits of the
Philox stream (CUDA's generator is a parallel Philox already).
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import math
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from privacy_engine.noise.secure_random import _MT_WORDS, _MT_WORDS_OFFSET, _check_cpu_layout
from privacy_engine.settings_checks import NOISE_STREAMS

__all__ = [
    "CHUNK_NUMEL",
    "GRAIN_NUMEL",
    "NOISE_STREAMS",
    "STREAM_COUNTER",
    "STREAM_MT",
    "StreamKey",
    "chunk_bounds",
    "chunk_pool",
    "draw_counter_chunks",
    "draw_counter_noise",
    "drawing_threads",
    "run_on_threads",
    "secure_stream_keys",
    "stream_key",
]

# STREAM_MT: one serial torch generator per device (every checkpoint written before the counter stream);
# STREAM_COUNTER: this module. The names are settings_checks' (check_noise_stream refuses any other).
STREAM_MT, STREAM_COUNTER = NOISE_STREAMS

# Entries per chunk: part of the stream's definition (never depends on threads). 2**17 (512 KiB of float32):
# the per-chunk cost (its MT state, slicing, the pool: ~20 us measured) stays a few per cent of its draw
# (~0.45 ms), and a 0.7M-parameter model still has 6 chunks to share between threads (2**18: ~2% faster at
# 1 thread, 3 chunks).
CHUNK_NUMEL = 1 << 17
_BLOCKS_PER_CHUNK = _MT_WORDS // 8  # Philox4x64 blocks (4 x 64 bits) per 624 32-bit MT words: 78
_KEY_TAG = 0x636F756E74  # separates this stream's keys from every other SeedSequence use of the seed


class StreamKey:
    """The 128-bit Philox key of one device's counter stream.

    It stands where the serial stream keeps a ``torch.Generator`` (``group.generators``) and answers
    ``get_state`` / ``set_state`` alike (16 bytes, uint8), so rollback and ``state_dict`` treat both
    streams the same; unlike a generator's, its state never changes when drawing (the step index is the
    counter)."""

    __slots__ = ("key",)

    def __init__(self, key: np.ndarray) -> None:
        self.key = np.ascontiguousarray(key, dtype=np.uint64).copy()
        if self.key.shape != (2,):
            raise ValueError(f"a counter-stream key is 2 uint64 words, got shape {self.key.shape}")

    def get_state(self) -> torch.Tensor:
        """The key as 16 uint8 values (a copy)."""
        return torch.from_numpy(self.key.view(np.uint8).copy())

    def set_state(self, state: torch.Tensor) -> None:
        """Set the key from 16 uint8 values (as ``get_state`` returns them)."""
        if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.shape == (16,)):
            raise ValueError("a counter-stream key state is a uint8 tensor of 16 values")
        self.key = state.numpy().copy().view(np.uint64)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StreamKey) and bool(np.array_equal(self.key, other.key))

    def __hash__(self) -> int:
        return hash(self.key.tobytes())

    def __repr__(self) -> str:
        return "StreamKey(<128 bits>)"


def stream_key(seed: int, device_index: int, layout_restarts: int = 0) -> StreamKey:
    """The key of device ``device_index``'s counter stream for a run seeded with ``seed`` (a layout
    restart gets a new key, so no value is drawn twice)."""
    sequence = np.random.SeedSequence(entropy=int(seed), spawn_key=(_KEY_TAG, int(device_index), int(layout_restarts)))
    return StreamKey(sequence.generate_state(2, dtype=np.uint64))


def secure_stream_keys(count: int) -> list[StreamKey]:
    """``count`` keys straight from the OS's cryptographic generator (secure mode; never saved)."""
    return [StreamKey(np.frombuffer(os.urandom(16), dtype=np.uint64)) for _ in range(count)]


def chunk_bounds(numel: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each chunk of a flat vector of ``numel`` entries: ``CHUNK_NUMEL`` each, the last
    one shorter."""
    return [(start, min(start + CHUNK_NUMEL, numel)) for start in range(0, numel, CHUNK_NUMEL)]


def _philox_words(key: StreamKey, step: int, first_block: int, blocks: int) -> np.ndarray:
    """``4 * blocks`` uint64 words of Philox4x64-10 under ``key`` at counters ``(first_block + 1 + i, step, 0, 0)``."""
    # numpy's Philox adds one to the counter before each block, so block ``b`` comes from counter ``b + 1``:
    # the same shift for every call, so the words stay exactly addressable by (step, block).
    bit_generator = np.random.Philox(key=key.key, counter=np.array([first_block, step, 0, 0], dtype=np.uint64))
    return bit_generator.random_raw(4 * blocks)


@functools.cache
def _cpu_state_template() -> np.ndarray:
    """A fresh CPU generator's state (no cached normal value), whose MT words are overwritten per chunk."""
    _check_cpu_layout()
    state = torch.Generator().get_state().numpy().copy()
    state[8:12] = np.array([1], dtype=np.int32).view(np.uint8)  # left = 1: the next draw twists all words
    state[12:16] = np.array([1], dtype=np.int32).view(np.uint8)  # seeded
    state[16:24] = 0  # next = 0
    return state


def _chunk_states(words: np.ndarray, chunks: int) -> np.ndarray:
    """One CPU generator state per chunk (rows, uint8): a fresh state whose 624 MT19937 words are the chunk's
    624 32-bit Philox values (``words``: 312 uint64 per chunk, low half first)."""
    template = _cpu_state_template()
    states = np.tile(template, (chunks, 1))
    mt_words = np.empty((chunks, _MT_WORDS), dtype=np.uint64)
    per_chunk = words.reshape(chunks, _MT_WORDS // 2)
    mt_words[:, 0::2] = per_chunk & np.uint64(0xFFFFFFFF)
    mt_words[:, 1::2] = per_chunk >> np.uint64(32)
    states[:, _MT_WORDS_OFFSET : _MT_WORDS_OFFSET + 8 * _MT_WORDS] = mt_words.view(np.uint8)
    states[:, 0:8] = 0  # initial_seed(): no seed reproduces this stream
    return states


_pool_lock = threading.Lock()
_pools: dict[tuple[int, int], concurrent.futures.ThreadPoolExecutor] = {}  # (pid, workers) -> pool


def drawing_threads() -> int:
    """Threads a counter-stream draw uses: torch's intra-op thread count (``torch.set_num_threads``)."""
    return max(1, torch.get_num_threads())


def chunk_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """This process's pool of ``workers`` threads for noise chunks (kept; one per size, made on first use)."""
    return _executor(workers)


def _executor(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    with _pool_lock:
        # One pool per size, kept (a thread count switched back and forth reuses them). A forked child inherits
        # the pool objects, not their threads: it makes its own, under its own pid.
        key = (os.getpid(), workers)
        if key not in _pools:
            _pools[key] = concurrent.futures.ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="privacy-engine-chunks"
            )
        return _pools[key]


def draw_counter_noise(
    out: torch.Tensor,
    scratch: torch.Tensor | None,
    keys: Sequence[StreamKey],
    step: int,
    std: float,
    *,
    threads: int | None = None,
) -> None:
    """``out`` (flat, contiguous) <- step ``step``'s iid ``N(0, std^2)`` values of the stream(s) ``keys``.

    Guarantee: the values depend only on (keys, step, ``out.numel()``, dtype, std), never on the number of
    threads or the order the chunks are drawn in; chunk ``c`` holds entries ``[c * CHUNK_NUMEL, ...)``.
    One key: one draw per entry. Several keys (secure mode): the sum of one draw per key at
    ``std / sqrt(len(keys))`` (exactly ``N(0, std^2)`` in distribution); ``scratch`` (same shape as ``out``)
    holds the further draws.

    ============================  ==================================================
    case                          result
    ============================  ==================================================
    ``out`` empty                 nothing drawn
    ``step`` < 0                  ValueError
    ``out`` not flat/contiguous   ValueError
    non-CPU ``out``               one chunk, the device's generator seeded with 64
                                  Philox bits of (key, step)
    ============================  ==================================================
    """
    _check_draw(step, keys)
    if out.dim() != 1 or not out.is_contiguous():
        raise ValueError("out must be a flat contiguous tensor (the device's noise vector)")
    if out.numel() == 0:
        return
    part_std = std / math.sqrt(len(keys)) if len(keys) > 1 else std
    if out.device.type != "cpu":
        _draw_device(out, scratch, keys, step, part_std)
        return

    def destination(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return out[start:end], None if scratch is None else scratch[start:end]

    _draw_chunks(out.numel(), keys, step, part_std, destination, None, threads)


def draw_counter_chunks(
    numel: int,
    dtype: torch.dtype,
    keys: Sequence[StreamKey],
    step: int,
    std: float,
    consume: Callable[[int, torch.Tensor], None],
    *,
    threads: int | None = None,
) -> None:
    """Step ``step``'s values of the stream(s) ``keys`` for a flat CPU vector of ``numel`` entries of ``dtype``, one
    chunk at a time and without the vector: each chunk is drawn into a buffer of the drawing thread (kept between
    calls, so no page is faulted in per step) and handed to ``consume(index, chunk)`` on that thread, while the
    chunk is still in the core's cache; the buffer is drawn over again once ``consume`` returns.

    Guarantee: ``chunk`` holds exactly entries ``[index * CHUNK_NUMEL, ...)`` of what ``draw_counter_noise`` draws
    into a vector of ``numel`` entries for the same arguments (bit for bit, at any thread count); every chunk is
    consumed exactly once, unless ``consume`` raises: then no further chunk is started and the first exception is
    raised once every drawing thread has stopped (chunks already consumed stay consumed). ``consume`` runs on up
    to ``threads`` threads at once (each on its own chunks): what it writes must not overlap between chunks, and it
    should keep each torch call under ``GRAIN_NUMEL`` entries (a larger one starts torch's intra-op threads from
    every drawing thread).

    ==================  ===========================================
    case                result
    ==================  ===========================================
    ``numel`` = 0       nothing drawn, ``consume`` never called
    ``step`` < 0        ValueError
    ``consume`` raises  drawing stops; its exception is raised
    ==================  ===========================================
    """
    _check_draw(step, keys)
    if numel == 0:
        return
    part_std = std / math.sqrt(len(keys)) if len(keys) > 1 else std
    extra = len(keys) > 1

    def destination(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        buffer, extra_buffer = _thread_chunk_buffers(dtype, extra)
        return buffer[: end - start], None if extra_buffer is None else extra_buffer[: end - start]

    _draw_chunks(numel, keys, step, part_std, destination, consume, threads)


# torch runs an elementwise op of at most this many entries on the calling thread (at::internal::GRAIN_SIZE); a
# larger one opens an OpenMP team from the calling thread, and a team opened from each drawing thread puts
# 2 x threads threads on the cores, whose workers then spin-wait for milliseconds after the op (libgomp's
# default), taking the cores the other drawing threads need.
GRAIN_NUMEL = 1 << 15

_thread_buffers = threading.local()


def _thread_chunk_buffers(dtype: torch.dtype, extra: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This thread's chunk buffer of ``dtype`` (and, for several keys, a second one for the further draws)."""
    buffers = getattr(_thread_buffers, "by_dtype", None)
    if buffers is None:
        buffers = _thread_buffers.by_dtype = {}
    pair = buffers.get(dtype)
    if pair is None or (extra and pair[1] is None):
        main = torch.empty(CHUNK_NUMEL, dtype=dtype) if pair is None else pair[0]
        pair = buffers[dtype] = (main, torch.empty(CHUNK_NUMEL, dtype=dtype) if extra else None)
    return pair[0], pair[1] if extra else None


def _device_generator(device: torch.device) -> torch.Generator:
    """This thread's generator for ``device``, kept between steps (no generator is made per step on the device);
    every use reseeds it. One per thread: two threads drawing at once must not reseed each other's generator."""
    generators = getattr(_thread_buffers, "device_generators", None)
    if generators is None:
        generators = _thread_buffers.device_generators = {}
    generator = generators.get(device)
    if generator is None:
        generator = generators[device] = torch.Generator(device=device)
    return generator


def _check_draw(step: int, keys: Sequence[StreamKey]) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not keys:
        raise ValueError("keys is empty: a counter stream needs at least one key")


def _draw_chunks(
    numel: int,
    keys: Sequence[StreamKey],
    step: int,
    part_std: float,
    destination: Callable[[int, int], tuple[torch.Tensor, torch.Tensor | None]],
    consume: Callable[[int, torch.Tensor], None] | None,
    threads: int | None,
) -> None:
    """Draw every chunk of step ``step`` into ``destination(start, end)`` (the chunk's tensor and, for several keys,
    one for the further draws), then ``consume(index, chunk)`` if given, on ``threads`` threads."""
    bounds = chunk_bounds(numel)
    # Every chunk's MT state for this step, one Philox call per key (2.5 KB of words per chunk).
    states = [_chunk_states(_philox_words(key, step, 0, _BLOCKS_PER_CHUNK * len(bounds)), len(bounds)) for key in keys]

    def draw_chunk(index: int, generator: torch.Generator) -> None:
        start, end = bounds[index]
        piece, extra = destination(start, end)
        for number, key_states in enumerate(states):
            # A separate tensor per row: torch's set_state reads from the start of a tensor's storage and
            # ignores a view's offset (it crashed on a row of a 2-D tensor, torch 2.x), while
            # torch.from_numpy of a numpy row starts its storage at the row.
            generator.set_state(torch.from_numpy(key_states[index]))
            if number == 0:
                piece.normal_(0.0, part_std, generator=generator)
            else:
                extra.normal_(0.0, part_std, generator=generator)
                # In pieces on this thread (see GRAIN_NUMEL); an elementwise add, so the same bits as one add.
                torch._foreach_add_(piece.split(GRAIN_NUMEL), extra.split(GRAIN_NUMEL))
        if consume is not None:
            consume(index, piece)

    generators = threading.local()

    def draw(index: int) -> None:
        generator = getattr(generators, "generator", None)
        if generator is None:
            generator = generators.generator = torch.Generator()
        draw_chunk(index, generator)

    run_on_threads(len(bounds), draw, threads=threads)


def run_on_threads(count: int, task: Callable[[int], None], *, threads: int | None = None) -> None:
    """``task(0)`` ... ``task(count - 1)`` on ``threads`` threads (default ``drawing_threads()``): this thread and
    pool threads take the next index in turn until none is left (a thread that is slow or preempted takes fewer),
    each under ``torch.no_grad``. torch's kernels release the GIL, so the tasks' kernels run on that many cores.

    Guarantee: every index runs exactly once, unless a task raises: then no further index is started and the first
    exception is raised once every thread has stopped (so nothing runs after the raise)."""
    next_index = itertools.count()  # shared by the workers: next() is atomic under the GIL
    stop = threading.Event()  # set by the first worker that fails: the others start no further task

    def work() -> None:
        try:
            with torch.no_grad():  # grad mode is per thread
                while not stop.is_set() and (index := next(next_index)) < count:
                    task(index)
        except BaseException:
            stop.set()
            raise

    workers = min(threads if threads is not None else drawing_threads(), count)
    if workers <= 1:
        work()
        return
    helpers = [_executor(workers - 1).submit(work) for _ in range(workers - 1)]
    try:
        work()
    finally:
        stop.set()  # also when this thread was interrupted: the helpers stop after their current task
        errors = [future.exception() for future in helpers]  # waits for every helper
    for error in errors:
        if error is not None:
            raise error


def _draw_device(
    out: torch.Tensor, scratch: torch.Tensor | None, keys: Sequence[StreamKey], step: int, std: float
) -> None:
    generator = _device_generator(out.device)
    with torch.no_grad():
        for number, key in enumerate(keys):
            # manual_seed also restarts the generator's offset: the draw is what a fresh generator would give.
            generator.manual_seed(int(_philox_words(key, step, 0, 1)[0]))
            target = out if number == 0 else scratch
            target.normal_(0.0, std, generator=generator)
            if number > 0:
                out.add_(scratch)
