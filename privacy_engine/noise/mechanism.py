"""The base class of the noise mechanisms (``NoiseMechanism``).

Both mechanisms share one interface: the optimizer hands over the clipped, summed gradients of
all parameters (one tensor per parameter) and the mechanism adds this step's noise in place.

Layout of the randomness. Tensors are grouped by device (in order of first appearance) and,
within a device, laid end to end in one flat vector of ``total_numel`` entries. Each step draws
one flat standard-normal vector per device from that device's own ``torch.Generator`` and adds
the matching slice to each tensor. Both mechanisms draw the same way, so ``BandMFNoise`` with
coefficients ``(1.0,)`` adds exactly the numbers ``GaussianNoise`` adds for the same seed.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import dp_accounting
import torch

from accountants.events import EventSpec, Sampling
from privacy_engine.interrupts import deferred_signals
from privacy_engine.noise import counter_stream
from privacy_engine.noise import prefetch as noise_prefetch
from privacy_engine.noise.layout import (
    _SECURE_MODE_GENERATORS,
    _add_plan,
    _AddPlan,
    _derived_seed,
    _DeviceGroup,
    _global_generator_seed,
    _noise_dtype,
)
from privacy_engine.noise.secure_random import full_entropy_generator
from privacy_engine.noise.state import NoiseStateMixin
from privacy_engine.settings_checks import (
    check_max_grad_norm,
    check_noise_multiplier,
    check_noise_seed,
    check_noise_std,
    check_noise_stream,
    check_unseeded_in_secure_mode,
)

__all__ = ["NoiseMechanism"]

# The serial stream's chunks when one thread draws and another adds (NoiseMechanism._draw_into_tensors): a multiple of
# 16 (torch's normal_ fills 16 values at a time, so chunks draw the values of one whole draw); 1 MiB of float32, so the
# hand-over per chunk (~10 us) stays under 2% of its draw.
SERIAL_CHUNK_NUMEL = 1 << 18
# The serial stream's chunks when one thread draws and adds (torch.get_num_threads() == 1): drawn into the first
# ONE_THREAD_CHUNK_NUMEL entries of the noise vector, reused for every chunk, and added (and divided) into the tensors
# while they are in cache, so the step makes one pass over the gradients in memory instead of three (the noise
# vector's write, the add, the division) and never faults in the rest of the noise vector. A multiple of 16 (see
# SERIAL_CHUNK_NUMEL); 1 MiB of float32 (AMD EPYC, 1 MiB L2 per core: 2^16 to 2^19 measured, 2^18 and 2^19 cost least;
# smaller chunks pay the three ops' fixed cost per chunk).
ONE_THREAD_CHUNK_NUMEL = 1 << 18
# ... only for a device's noise of at least this many entries (both streams): below, the whole noise vector stays in
# the last-level cache (32 MiB on that EPYC) and its extra passes cost less than the chunks' ops (measured, 1 thread,
# against the whole draw: 1M entries +4-6%, 10M +2-5%, 100M -1 to -3%; a loaded 2-core machine).
ONE_THREAD_MIN_NUMEL = 1 << 24
# NoiseMechanism._add_in_noise_vector: for tensors of at most this many entries on average (the add and the copy cost
# two passes over the memory instead of one division pass; below, the per-tensor division's fixed cost dominates).
SMALL_TENSOR_NUMEL = 1 << 10


def _serial_chunk_bounds(numel: int, chunk_numel: int | None = None) -> list[tuple[int, int]]:
    """``chunk_numel``-entry chunks (default ``SERIAL_CHUNK_NUMEL``) of a flat vector; a last chunk under 16 entries
    joins the one before (torch draws fewer than 16 values another way, which would change the numbers)."""
    size = SERIAL_CHUNK_NUMEL if chunk_numel is None else chunk_numel
    bounds = [(start, min(start + size, numel)) for start in range(0, numel, size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < 16:
        bounds[-2:] = [(bounds[-2][0], numel)]
    return bounds


@functools.lru_cache(maxsize=32)
def _one_thread_add_plan(numels: tuple[int, ...], chunk_numel: int, counter: bool) -> _AddPlan:
    """The ``_AddPlan`` of tensors of ``numels`` entries drawn in chunks of ``chunk_numel`` on one thread: pieces as
    large as the chunks allow (one thread opens no intra-op team, so nothing needs them under ``GRAIN_NUMEL``), made
    once per layout (a pure function of plain integers, kept; a step of a large model would otherwise rebuild it)."""
    numel = sum(numels)
    bounds = counter_stream.chunk_bounds(numel) if counter else _serial_chunk_bounds(numel, chunk_numel)
    return _add_plan(numels, bounds, chunk_numel, chunk_numel)


def _exact_reciprocal(divisor: float) -> float | None:
    """``1 / divisor`` when ``x * (1 / divisor)`` equals ``x / divisor`` bit for bit for every float32 and float64
    ``x`` (NaN, infinities, zeros and subnormals included, flush-to-zero on or off): ``divisor`` a power of two from
    2^-60 to 2^60 (the reciprocal is then exact and normal, and both ops round the same real number); else ``None``."""
    mantissa, exponent = math.frexp(divisor)
    if mantissa == 0.5 and -59 <= exponent <= 61:
        return math.ldexp(1.0, 1 - exponent)
    return None


def _target_pieces(targets: list[torch.Tensor], plan: _AddPlan) -> list[torch.Tensor]:
    """Flat views of ``targets`` cut as ``plan`` cuts them, in layout order (a tensor of one piece: its flat view)."""
    pieces: list[torch.Tensor] = []
    for target, sizes in zip(targets, plan.tensor_piece_sizes):
        if len(sizes) == 1:
            pieces.append(target.view(-1))  # one op per small tensor, not two
        elif sizes:
            pieces.extend(target.view(-1).split(sizes))
    return pieces


def _commit_point(name: str) -> None:
    """Marks a point inside a step's commit; does nothing. Tests replace it to raise there."""


# The module's own _commit_point: a commit calls _commit_point only once a test replaced it (four calls per step spared).
_UNMARKED = _commit_point


def _without_scratch(group: _DeviceGroup) -> _DeviceGroup:
    """A copy of ``group`` without its scratch buffers (this step's and the next step's noise and their views)."""
    scratch = {"noise": None, "noise_views": [], "secure_scratch": None, "formed_ahead": False}
    return dataclasses.replace(group, **scratch, next_noise=None, next_views=[], next_scratch=None)


def _nothing_to_do() -> None:
    pass


_DTYPE = operator.attrgetter("dtype")
_IS_CPU = operator.attrgetter("is_cpu")
# A tensor's (shape, dtype, device) in one C call: compared with a layout's signature entry (torch.Size is a tuple).
_SIGNATURE_ENTRY = operator.attrgetter("shape", "dtype", "device")
_GET_STATE = operator.methodcaller("get_state")
_NUMEL = operator.attrgetter("numel")
_INF = math.inf
_SINGLE_OR_DOUBLE = frozenset((torch.float32, torch.float64))  # the dtypes _exact_reciprocal's guarantee covers
# Grad mode read and set as torch.no_grad() does (torch.set_grad_enabled), without its context object: a step's
# add_noise_ runs inside DPOptimizer.step, where grad mode is already off.
_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled


def _divide_(tensors: list[torch.Tensor], divide_by: float) -> None:
    """``torch._foreach_div_(tensors, divide_by)``, the same bits. On the CPU the divisor is handed over as a 0-dim
    float64 tensor holding it: torch wraps a Python number into exactly such a tensor for each tensor it divides
    (the same type promotion and the same division kernel, so the same roundings; checked bit for bit on float32,
    float64, bfloat16 and float16, with NaN, infinities, signed zeros and subnormals), and a 0-dim tensor given once
    spares that per tensor (measured on 100 small tensors: ~25% less, ~0.5 us per tensor). That tensor is kept for
    the next step's equal divisor (``_divisor_tensor``). A power of two (``_exact_reciprocal``: a batch size of 256, 8)
    dividing float32 / float64 CPU tensors is a multiplication by its exact reciprocal instead: the same bits (both
    ops round the same real number), at about half the division's cost (measured: 670K float32 entries in six
    tensors, 85 us against 46 us)."""
    if len(tensors) > 1 and all(map(_IS_CPU, tensors)):
        reciprocal = _exact_reciprocal(divide_by)
        if reciprocal is not None and all(map(_SINGLE_OR_DOUBLE.__contains__, map(_DTYPE, tensors))):
            torch._foreach_mul_(tensors, reciprocal)
        else:
            torch._foreach_div_(tensors, _divisor_tensor(divide_by))
    else:
        torch._foreach_div_(tensors, divide_by)


_last_divisor: tuple[float, torch.Tensor] | None = None  # _divisor_tensor's last (divisor, tensor)


def _divisor_tensor(divide_by: float) -> torch.Tensor:
    """``torch.full((), divide_by, dtype=torch.float64)``, the tensor of the last call when ``divide_by`` is the same
    positive float (an equal positive float is the same number, so the same tensor; only ever read: ``_divide_``
    divides by it), saving one op per step (the divisor is the expected batch size, the same at every step)."""
    global _last_divisor
    last = _last_divisor
    if last is not None and type(divide_by) is float and last[0] == divide_by:
        return last[1]
    divisor = torch.full((), divide_by, dtype=torch.float64)
    if type(divide_by) is float and divide_by > 0.0:
        _last_divisor = (divide_by, divisor)
    return divisor


class NoiseMechanism(NoiseStateMixin, abc.ABC):
    """Adds privacy noise to the clipped gradient sums, one step at a time.

    Subclasses define the noise (``noise_std`` and how this step's noise is formed from fresh
    Gaussian draws) and state its privacy event (``privacy_event``: what the accountant records and
    composes; a subclass that states none is refused before it adds any noise); this base class owns
    validation, per-device generators, the flat layout of the tensors, and checkpointing
    (``NoiseStateMixin``, in ``state.py``). It knows no particular mechanism: one that keeps state
    across steps (BandMF's history and ring) uses the neutral hooks below.

    Secure mode. What it promises: no seed search recovers the noise. Each device's four
    generators get their state straight from the OS (``secure_random.full_entropy_generator``:
    19937 bits per CPU generator, 64 per CUDA generator, instead of the 32 bits torch's
    ``manual_seed`` keeps on CPU), and no seed or generator state is ever written to a
    ``state_dict``, so a checkpoint cannot reproduce future noise (a resumed secure run draws
    fresh OS-seeded generators). On the counter stream (``noise_stream="counter-v1"``) the four
    generators are four 128-bit Philox keys from the OS (each chunk's Mersenne Twister state is
    Philox output under a secret key), likewise never saved. What it does not promise, and what to
    do about it:

    * The generators (Mersenne Twister on CPU, Philox on CUDA) are statistically strong, not
      cryptographically secure; full-entropy state rules out seed search, not a structural
      attack from many exact outputs (the outputs are only ever seen summed four at a time and
      added to gradients).
    * Floating-point attacks on Gaussian sampling (Mironov 2012 for Laplace; Holohan & Braghin
      2021, Jin et al. 2022 for Gaussian samplers): the floats a sampler can produce are sparse
      and uneven, so the exact bits of ``gradient + noise`` can say more about the gradient than
      the real-valued analysis allows. Summing four draws blurs the pattern (a mitigation, not a
      proof). A user who needs more: release only post-processed values that discard low bits
      (round the trained weights to a coarse grid before publishing them), keep intermediate
      checkpoints private, and keep float64 gradients so the noise is drawn in float64.
    * BandMF's ``state_dict`` still holds its history (past noise, which with the released
      gradients reveals past clipped gradients): keep a checkpoint as secret as the data.

    Args:
        seed: seeds every generator reproducibly (each device gets its own derived stream).
            ``None``: one draw from torch's global generator, made lazily when the first step lays
            out its noise (not when the mechanism is built), so ``torch.manual_seed`` called any time
            before the first step makes the run repeat, as with Opacus; recorded in ``state_dict``
            once drawn (a state saved before it holds ``seed=None`` and draws at its first step too).
        secure_mode: OS entropy only (a user ``seed`` raises ``ValueError``), as described above.
        prefetch: draw the next step's noise on a background thread while the current step's
            forward and backward passes run (CPU tensors only; one more flat buffer per device).
            ``None``: when torch's intra-op threads leave one of the process's cores free and a
            device holds at least ``noise_prefetch.MIN_PREFETCH_NUMEL`` entries; ``True``: always;
            ``False``: never. The noise added is bit for bit the same either way
            (``privacy_engine.noise.prefetch``).
        noise_stream: which random stream the standard draws come from. ``"mt19937"`` (default): one
            serial torch generator per device, the stream of every run and checkpoint before
            ``"counter-v1"``. ``"counter-v1"``: the counter-keyed stream of
            ``privacy_engine.noise.counter_stream``, drawn on ``torch.get_num_threads()`` threads with the
            same numbers at any thread count. The distribution (iid Gaussian) and so the privacy guarantee
            are the same; the seeded numbers differ. A loaded ``state_dict`` continues on the stream it was
            saved with (a state without a stream name is ``"mt19937"``).
    """

    def __init__(
        self, *, seed: int | None = None, secure_mode: bool = False, prefetch: bool | None = None,
        noise_stream: str = counter_stream.STREAM_MT,
    ) -> None:  # fmt: skip
        check_unseeded_in_secure_mode("seed", seed, secure_mode=secure_mode)
        check_noise_seed(seed, name="seed")
        if prefetch is not None and not isinstance(prefetch, bool):
            raise ValueError(f"prefetch must be True, False or None (automatic), got {prefetch!r}")
        self.noise_stream = check_noise_stream(noise_stream)
        self.prefetch = prefetch
        self.secure_mode = bool(secure_mode)
        # No seed: one draw from torch's global generator, as Opacus's noise draws from it, so that
        # torch.manual_seed alone makes a run reproducible (never in secure mode). Drawn at the first step
        # (_new_generators), not here: a torch.manual_seed between make_private and training must count.
        self._seed = None if secure_mode or seed is None else int(seed)
        self._step = 0
        self._layout_restarts = 0  # see restart_layout
        self._signature: tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...] | None = None
        self._groups: list[_DeviceGroup] = []
        self._pending_devices: list[dict[str, Any]] | None = None
        self._pending_signature: list | None = None
        self._draws_ahead: dict[int, noise_prefetch.PendingDraw] = {}  # id(device group) -> next step's draw

    def __getstate__(self) -> dict[str, Any]:
        # A draw running in the background is not part of the state (a copy draws in place).
        self._wait_for_draws_ahead()
        state = dict(self.__dict__)
        state["_draws_ahead"] = {}
        # The scratch buffers are left out (the next step makes them again): pickle copies each view of the
        # noise vector as a tensor of its own, and a copy that added through such stale views would add the
        # last step's noise again instead of its fresh draw.
        state["_groups"] = [_without_scratch(group) for group in self._groups]
        return state

    # ------------------------------------------------------------------ public interface
    def seed_lazily_from(self, generator: torch.Generator) -> None:
        """Draw this mechanism's seed from ``generator`` (one draw, when the first step lays out the noise)
        instead of from torch's global generator: a ``generator.manual_seed(...)`` made after the optimizer is
        built still makes the run repeat, as with Opacus's ``DPOptimizer(generator=g)``.

        ``ValueError`` in secure mode (OS randomness is never seeded) or when a seed was given or already
        drawn; ``TypeError`` unless ``generator`` is a CPU ``torch.Generator``."""
        if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
            raise TypeError(f"seed_lazily_from needs a CPU torch.Generator, got {generator!r}")
        if self.secure_mode:
            raise ValueError("seed_lazily_from: secure mode draws its noise from the OS and is never seeded")
        if self._seed is not None:
            raise ValueError("seed_lazily_from: this mechanism already has a seed (given, or drawn at a step)")
        self._seed_source = generator

    def restart_layout(self) -> None:
        """Forget the layout (and any history of past noise): the next ``add_noise_`` lays the noise
        out over the tensors it is given, e.g. after parameters were unfrozen.

        Guarantee: the step count and the seeded stream continue (the new generators are derived
        from the seed and the number of restarts, so no noise value is drawn twice). A mechanism
        with correlated noise restarts its correlation (see ``BandMFNoise.restart_layout``).
        """
        self._layout_restarts += 1
        self._signature = None
        self._wait_for_draws_ahead()
        self._draws_ahead = {}
        self._groups = []

    @property
    def step(self) -> int:
        """Number of steps taken (calls to ``add_noise_``)."""
        return self._step

    @abc.abstractmethod
    def noise_std(self, noise_multiplier: float, max_grad_norm: float) -> float:
        """Standard deviation ``s`` of the fresh Gaussian draws ``z_t`` (see subclasses)."""

    # ------------------------------------------------------------------ what the mechanism states
    def privacy_event(self) -> EventSpec:
        """This mechanism's privacy event as plain data (``accountants.events.EventSpec``): a registered
        event kind, the cyclic sampling it needs (``num_bands``) and the kind's parameters. The accountant
        records exactly this and composes the kind's builder's event; nothing is inferred from the type.
        The base class states none: a subclass that does not override this is refused (``TypeError``
        naming it and what to implement) by ``DPOptimizer`` / ``make_private`` before anything is
        released or counted. A new analysis: register its builder in the mechanism's own module."""
        name = type(self).__name__
        raise TypeError(
            f"{name} does not state its privacy event, so no accountant can account for it (it is not taken "
            f"for DP-SGD). Implement {name}.privacy_event(self) -> accountants.events.EventSpec: "
            "EventSpec() if every step adds fresh iid N(0, (noise_multiplier * max_grad_norm)^2) noise to every "
            "entry (DP-SGD's event), otherwise EventSpec(kind=...) naming an event builder registered with "
            "accountants.events.register_event_kind that returns the dp_accounting DpEvent of its steps. "
            "Nothing was released or counted."
        )

    def dp_event(self, *, noise_multiplier: float, sampling: Sampling, steps: int = 1) -> dp_accounting.DpEvent:
        """The dp-accounting event of ``steps`` steps of this mechanism at ``noise_multiplier``, with
        batches drawn as ``sampling`` says: the builder of ``privacy_event()``'s kind
        (``accountants.events.build_event``), the very event an accountant composes for these steps.
        Raises what ``privacy_event`` raises for a mechanism that states none."""
        return self.privacy_event().dp_event(noise_multiplier=noise_multiplier, sampling=sampling, steps=steps)

    def add_noise_(
        self,
        tensors: Sequence[torch.Tensor],
        noise_multiplier: float,
        max_grad_norm: float,
        *,
        on_commit: Callable[[], None] | None = None,
        divide_by: float | None = None,
    ) -> None:
        """Add this step's noise in place to each tensor and advance the step index by one.

        ``divide_by``: also divide each tensor by this number (the optimizer's expected batch size), in the
        same pass over memory as the noise (the sum plus noise is rounded, then divided: the same two roundings
        as adding and dividing in two passes). ``None``: no division. A positive finite number, else
        ``ValueError`` before anything changes.

        ``tensors`` are the clipped gradient sums, one per parameter; they may differ in shape,
        dtype and device, but the list (shapes, dtypes, devices, order) must be the same at
        every step, because the mechanism's state is laid out over it.

        Guarantee: when ``noise_std > 0``, every call draws fresh Gaussian values for every
        entry of every tensor and adds exactly this step's noise of the mechanism (nothing is
        skipped, reused or scaled beyond what the mechanism defines); the step index advances
        by one per successful call, and a call rejected by validation changes nothing.

        Transactional, all or nothing against any exception: the noise is drawn and formed in
        scratch buffers and added to ``tensors``; only then is the step committed (the history
        rows, ``on_commit()``, then the mechanism's counters and step index). Guarantee: when
        ``add_noise_`` returns or raises, either the step happened whole (noise state advanced,
        ``on_commit`` returned) or not at all (generators, history, counters and step index
        exactly as before the call, and ``on_commit`` either not called or raised). Exceptions
        raised inside the commit (``on_commit``'s included) undo it; signal handlers (SIGINT's
        ``KeyboardInterrupt``, a SIGTERM handler's ``SystemExit``, a SIGALRM handler's
        ``TimeoutError``) are held off during it (``interrupts.deferred_signals``) and raise right
        after, the step then counting as taken. ``tensors`` hold part of the noise after a step
        that did not happen and must be discarded. ``on_commit`` is where a caller records the
        release (the accountant): it runs only when the noise is in place, and it must itself be
        all or nothing (the mechanism cannot undo what it did before raising).

        =========================  ==============================================
        case                       result
        =========================  ==============================================
        noise_multiplier = 0       no noise: tensors unchanged, step advances
        noise_multiplier < 0/NaN   ValueError, nothing changed
        max_grad_norm = 0          std 0: tensors unchanged, step advances
        max_grad_norm = inf        ValueError if noise_multiplier > 0
        max_grad_norm < 0/NaN      ValueError, nothing changed
        tensors empty / not float  ValueError, nothing changed
        shapes differ from step 0  ValueError, nothing changed
        exception before commit    re-raised, mechanism unchanged
        exception in the commit    re-raised, mechanism unchanged (undone)
        signal in the commit       step completes, then the handler's exception
        =========================  ==============================================
        """
        scale = self._validated_noise_scale(noise_multiplier, max_grad_norm)
        std = self.noise_std(noise_multiplier, max_grad_norm)
        # (A float in (0, inf) passes at once, compared in bytecode; anything else takes the full check.)
        if divide_by is not None and not (type(divide_by) is float and 0.0 < divide_by < _INF) and (
            isinstance(divide_by, bool) or not isinstance(divide_by, (int, float))
            or not math.isfinite(divide_by) or divide_by <= 0
        ):  # fmt: skip
            raise ValueError(f"divide_by must be a positive finite number (the expected batch size), got {divide_by!r}")
        tensors = list(tensors)
        signature = self._check_tensors(tensors)
        self._before_step(scale)
        std = self._draw_std(std)
        if not self._groups:
            self._initialise(tensors, signature)
        groups = self._groups
        drawn = std > 0.0
        # Drawing advances the generators: their states are kept (a few KB) so that a failed
        # step can be undone; the noise itself is formed in scratch buffers, never in the history.
        generator_states = [list(map(_GET_STATE, group.generators)) for group in groups] if drawn else []
        committed = False
        grad_enabled = _grad_enabled()  # torch.no_grad() around the draw and the commit, as it sets and restores it
        if grad_enabled:
            _set_grad_enabled(False)
        try:
            if drawn:
                whole = len(groups) == 1  # one device: its indices are 0..n-1 in order (_layout)
                for group in groups:
                    if group.noise is None:
                        self._ensure_buffers(group)
                    targets = tensors if whole else [tensors[i] for i in group.tensor_indices]
                    if self._draws_into_tensors(group, targets):
                        self._draw_into_tensors(group, targets, std, divide_by)
                        continue
                    # Otherwise one add (and division) after the whole draw. (A first per-chunk add on the
                    # drawing threads cost 4-6 ms more per 10M at 2 threads: each chunk's add opened its own
                    # intra-op team; _draw_into_tensors cuts its ops below torch's grain size instead.)
                    self._fill_standard_noise(group, std)
                    row_scale = self._form_noise(group)
                    if divide_by is not None and row_scale == 1.0 and self._adds_in_noise_vector(group, targets):
                        self._add_in_noise_vector(group, targets, divide_by)
                        continue
                    self._add_to_tensors(group, targets, row_scale, divide_by)
            elif divide_by is not None:
                _divide_(tensors, divide_by)
            with deferred_signals():
                self._commit(drawn, on_commit)
                committed = True
                if _commit_point is not _UNMARKED:
                    _commit_point("committed")
        except BaseException:
            if not committed:
                for group, states in zip(self._groups, generator_states):
                    for generator, state in zip(group.generators, states):
                        generator.set_state(state)
            raise
        finally:
            _set_grad_enabled(grad_enabled)  # (as torch.no_grad() restores it: to the mode it found)
        if drawn and self._prefetching():
            self._draw_ahead(std)

    def _commit(self, drawn: bool, on_commit: Callable[[], None] | None) -> None:
        """Make this step's noise part of the state and record it (the only place a step changes either).

        All or nothing against any exception: everything that can raise (the history rows, each with the row
        it overwrites kept aside, and ``on_commit``, the accountant's record) runs first and is undone if
        anything raises; the new counters are computed into locals before ``on_commit``, and once it returns
        only plain assignments remain. Signal handlers are held off by the caller (``deferred_signals``)."""
        undo: list[Callable[[], None]] = []
        marked = _commit_point is not _UNMARKED  # (a test's points: called at each, else none is)
        try:
            if marked:
                _commit_point("start")
            if drawn:
                for group in self._groups:
                    undo.append(self._commit_noise(group))
                    if marked:
                        _commit_point("history_written")
            advance = self._advance()
            if marked:
                _commit_point("counters_computed")
            if on_commit is not None:
                on_commit()
        except BaseException:
            for undo_row in reversed(undo):
                undo_row()
            raise
        # Nothing below can raise: the step is recorded, so the state must follow it.
        if advance is not _nothing_to_do:
            advance()
        self._step += 1

    # ------------------------------------------------------------------ subclass hooks
    # Neutral extension points: a mechanism that keeps state across steps (correlated noise) overrides
    # these; the base class knows no mechanism. Per-device rows of past noise live in ``group.history``
    # (``_history_rows`` of them, saved and restored here); anything else per device, in
    # ``group.mechanism_buffers``, declared by the mechanism.
    def _advance(self) -> Callable[[], None]:
        """This step's change of the mechanism's own counters, computed without changing anything: the
        returned function applies it once the step is recorded, and must not raise. Default: none."""
        return _nothing_to_do

    def _before_step(self, noise_scale: float) -> None:
        """Validate step-dependent conditions before anything is changed.

        ``noise_scale`` is the validated ``noise_multiplier * max_grad_norm``."""

    def _draw_std(self, std: float) -> float:
        """The std this step's fresh draws are made at, given ``noise_std`` of this step's arguments (called
        right after ``_before_step``). Default: ``std`` itself. A mechanism whose draws keep one scale while
        the released rows are rescaled (``BandMFNoise.clip_norm_may_change``) returns that scale here and the
        rescaling from ``_form_noise``."""
        return std

    def _form_noise(self, group: _DeviceGroup) -> float:
        """Turn ``group.noise`` (iid N(0, s^2)) into this step's noise; return a scale to apply
        when adding it to the tensors. Must not change the mechanism's state (see ``_commit``)."""
        return 1.0

    def _form_ahead(self, group: _DeviceGroup) -> tuple[Callable[[torch.Tensor], None] | None, object]:
        """For a draw made ahead (after a commit): a function turning the next step's standard draw into its
        noise as ``_form_noise`` would, computed from the state as it is now, and the key of that state
        (``_form_ahead_key``); ``(None, None)``: formed at the step instead."""
        return None, None

    def _form_ahead_key(self, group: _DeviceGroup) -> object:
        """What ``_form_ahead``'s function reads of the mechanism's state (a draw formed ahead is used only
        while it is unchanged)."""
        return None

    def _commit_noise(self, group: _DeviceGroup) -> Callable[[], None]:
        """Keep what later steps need of this step's noise (``group.noise``); return a function that
        undoes it exactly (called if the commit fails later)."""
        return _nothing_to_do

    def _history_rows(self) -> int:
        """Rows of past noise kept per device (``group.history``, shape ``(rows, numel)``, zeros at the
        start of a layout, saved in ``state_dict``); 0: none."""
        return 0

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _check_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _validated_noise_scale(noise_multiplier: float, max_grad_norm: float) -> float:
        """``noise_multiplier * max_grad_norm`` after checking both; 0.0 means no noise (the settings'
        own checks, ``privacy_engine.settings_checks``).

        Two floats in (0, inf) whose product is finite are the usual step: the checks would pass them
        (``check_noise_multiplier`` and ``check_max_grad_norm`` return such a float as it is) and return that
        product (``check_noise_std``), so it is returned at once; anything else (0, inf, NaN, negative, another
        type, an overflowing product) takes the checks, which refuse what they refuse."""
        if type(noise_multiplier) is float and type(max_grad_norm) is float and (
            0.0 < noise_multiplier < _INF and 0.0 < max_grad_norm < _INF
        ):
            scale = noise_multiplier * max_grad_norm
            if scale < _INF:
                return scale
        noise_multiplier = check_noise_multiplier(noise_multiplier)
        return check_noise_std(noise_multiplier, check_max_grad_norm(max_grad_norm))

    def _check_tensors(
        self, tensors: list[torch.Tensor]
    ) -> tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]:
        """The (shape, dtype, device) of every tensor, checked: torch tensors of a floating dtype, and once the noise is
        laid out, exactly the signature of its layout; ``TypeError`` / ``ValueError`` naming the first that is not."""
        signature = self._signature
        # The usual step: the very tensors of the layout (each check below passes). Torch tensors first (the TypeError
        # below names what is not), then each (shape, dtype, device) against the layout's in one C-level pass (a
        # torch.Size equals the tuple of its sizes).
        if (
            signature is not None
            and len(tensors) == len(signature)
            and all(map(isinstance, tensors, itertools.repeat(torch.Tensor)))
            and tuple(map(_SIGNATURE_ENTRY, tensors)) == signature
        ):
            return signature
        if not tensors:
            raise ValueError("tensors is empty: pass the clipped gradient sum of every parameter")
        entries = []  # one pass over the tensors (a step's fixed cost grows with their number)
        for index, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"tensors[{index}] is a {type(tensor).__name__}, not a torch.Tensor")
            if not tensor.is_floating_point():
                raise ValueError(
                    f"tensors[{index}] has dtype {tensor.dtype}; noise can only be added to "
                    "floating-point tensors"
                )
            entries.append((tuple(tensor.shape), tensor.dtype, tensor.device))
        signature = tuple(entries)
        if self._signature is not None and signature != self._signature:
            reference = self._signature
            if len(signature) != len(reference):
                detail = f"{len(reference)} tensors at the first step, {len(signature)} now"
            else:
                index = next(i for i, (a, b) in enumerate(zip(signature, reference)) if a != b)
                detail = (
                    f"tensors[{index}] was (shape {list(reference[index][0])}, "
                    f"{reference[index][1]}, {reference[index][2]}), now (shape "
                    f"{list(signature[index][0])}, {signature[index][1]}, {signature[index][2]})"
                )
            raise ValueError(
                "tensors must be the same list (shapes, dtypes, devices, order) at every step, "
                f"because the noise state is laid out over them: {detail}. Build a new "
                "mechanism if the set of parameters changed."
            )
        saved = self._pending_signature
        if self._signature is None and saved is not None:
            current = [(list(shape), str(dtype), str(device)) for shape, dtype, device in signature]
            if [(list(a), b) for a, b, _ in current] != [(list(a), b) for a, b, _ in saved]:
                raise ValueError(
                    "tensors do not match the (shapes, dtypes) saved in the loaded state: "
                    "resume with the same parameters in the same order"
                )
        return signature

    # ------------------------------------------------------------------ state handling
    def _initialise(self, tensors: list[torch.Tensor], signature: tuple) -> None:
        groups = self._layout(tensors)
        for device_index, group in enumerate(groups):
            group.generators = self._new_generators(group.device, device_index)
        pending = self._pending_devices
        if pending is not None:
            self._check_saved_devices(pending, groups)
        self._groups = groups
        self._signature = signature
        self._shapes = [tuple(t.shape) for t in tensors]
        if pending is not None:
            self._restore_devices(pending)
            self._pending_devices = None
            self._pending_signature = None

    @staticmethod
    def _layout(tensors: list[torch.Tensor]) -> list[_DeviceGroup]:
        """The tensors grouped by device and laid end to end per device (no generators yet)."""
        by_device: dict[torch.device, list[int]] = {}
        for index, tensor in enumerate(tensors):
            by_device.setdefault(tensor.device, []).append(index)
        groups = []
        for device, indices in by_device.items():
            offsets, numel = [], 0
            for index in indices:
                offsets.append(numel)
                numel += tensors[index].numel()
            dtype = _noise_dtype([tensors[i].dtype for i in indices])
            groups.append(_DeviceGroup(device=device, tensor_indices=indices, offsets=offsets, numel=numel,
                                       dtype=dtype, generators=[]))  # fmt: skip
        return groups

    def _new_generators(self, device: torch.device, device_index: int) -> list[torch.Generator]:
        """The device's generators: torch generators (``"mt19937"``) or the keys of the counter stream, which
        stand in their place (``counter_stream.StreamKey``: same ``get_state``/``set_state``)."""
        counter = getattr(self, "noise_stream", counter_stream.STREAM_MT) == counter_stream.STREAM_COUNTER
        if self.secure_mode:
            if counter:
                return counter_stream.secure_stream_keys(_SECURE_MODE_GENERATORS)
            return [full_entropy_generator(device) for _ in range(_SECURE_MODE_GENERATORS)]
        if self._seed is None:  # the lazy draw (see __init__ and seed_lazily_from)
            source = getattr(self, "_seed_source", None)
            self._seed = _global_generator_seed() if source is None else _global_generator_seed(source)
        if counter:
            return [counter_stream.stream_key(self._seed, device_index, self._layout_restarts)]
        generator = torch.Generator(device=device)
        generator.manual_seed(_derived_seed(self._seed, device_index, 0, self._layout_restarts))
        return [generator]

    def _ensure_buffers(self, group: _DeviceGroup) -> None:
        if group.noise is not None:
            return
        group.noise = torch.empty(group.numel, dtype=group.dtype, device=group.device)
        if self.secure_mode:
            group.secure_scratch = torch.empty_like(group.noise)
        group.noise_views = [
            group.noise[offset : offset + math.prod(self._shapes[i])].view(self._shapes[i])
            for i, offset in zip(group.tensor_indices, group.offsets)
        ]
        rows = self._history_rows()
        if rows > 0 and group.history is None:
            group.history = torch.zeros(rows, group.numel, dtype=group.dtype, device=group.device)

    def _fill_standard_noise(self, group: _DeviceGroup, std: float) -> None:
        """``group.noise`` <- this step's iid N(0, std^2) draw: the one made ahead in the background if it is
        exactly what drawing now gives (the generators then move on as drawing would have moved them), else
        drawn now. Changes the generators only as drawing in place does (add_noise_'s rollback covers both)."""
        group.formed_ahead = False
        ahead = self._draws_ahead.pop(id(group), None)
        if (
            ahead is not None
            and ahead.wait()
            and ahead.buffer is group.next_noise
            and ahead.matches(group.generators, std)
            and ahead.counter_step in (None, self._step)
            and (ahead.formed is None or ahead.formed == self._form_ahead_key(group))
        ):
            group.noise, group.next_noise = group.next_noise, group.noise
            group.noise_views, group.next_views = group.next_views, group.noise_views
            for generator, shadow in zip(group.generators, ahead.shadows):
                generator.set_state(shadow.get_state())
            group.formed_ahead = ahead.formed is not None
            return
        # Secure mode: the sum of four independent N(0, (s/2)^2) draws is exactly N(0, s^2) in distribution.
        noise_prefetch.draw_standard_noise(group.noise, group.secure_scratch, group.generators, std, self.secure_mode,
                                           step=self._step)  # fmt: skip

    # ------------------------------------------------------------------ the draw added chunk by chunk
    def _draws_into_tensors(self, group: _DeviceGroup, targets: list[torch.Tensor]) -> bool:
        """Whether this step's noise is added chunk by chunk as it is drawn (``_draw_into_tensors``): on the CPU, with
        no draw made ahead for the step, by a mechanism that neither forms nor keeps its noise and replaces none of
        the steps it stands in for (``_hooks_as_defined_here``), into plain contiguous tensors of the noise's dtype
        (so every entry gets the very ops of ``_add_to_tensors``), when the noise has more than one chunk
        (``counter_stream.CHUNK_NUMEL``; ``SERIAL_CHUNK_NUMEL``, at one thread ``ONE_THREAD_CHUNK_NUMEL``) and, at one
        thread, at least ``ONE_THREAD_MIN_NUMEL`` entries; on the serial stream also outside secure mode (one
        generator)."""
        if group.device.type != "cpu" or id(group) in self._draws_ahead:
            return False
        one_thread = torch.get_num_threads() < 2
        if one_thread and group.numel < ONE_THREAD_MIN_NUMEL:
            return False  # one draw, one add, one division: they cost less while the vector stays in cache
        if isinstance(group.generators[0], counter_stream.StreamKey):
            if group.numel <= counter_stream.CHUNK_NUMEL:
                return False  # one chunk, drawn on this thread: cutting the tensors into views only costs
        elif self.secure_mode or group.numel <= (ONE_THREAD_CHUNK_NUMEL if one_thread else SERIAL_CHUNK_NUMEL):
            return False  # (one chunk: nothing to overlap or keep in cache; cutting the tensors only costs)
        return (
            self._hooks_as_defined_here()
            and all(
                type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == group.dtype and t.is_contiguous()
                for t in targets
            )
        )

    def _hooks_as_defined_here(self) -> bool:
        """Whether the steps ``_draw_into_tensors`` stands in for (``_fill_standard_noise``, ``_form_noise``,
        ``_add_to_tensors``, ``_commit_noise``) are this class's own, replaced neither by a subclass nor on the
        object: a mechanism that forms or keeps its noise needs the noise vector, and a replaced step must run."""
        # (Each test spelled out: checked at every step, a generator over the pairs cost more than the tests.)
        return (
            self._add_to_tensors is NoiseMechanism._add_to_tensors
            and getattr(self._fill_standard_noise, "__func__", None) is NoiseMechanism._fill_standard_noise
            and getattr(self._form_noise, "__func__", None) is NoiseMechanism._form_noise
            and getattr(self._commit_noise, "__func__", None) is NoiseMechanism._commit_noise
        )

    def _draw_into_tensors(
        self, group: _DeviceGroup, targets: list[torch.Tensor], std: float, divide_by: float | None
    ) -> None:
        """Draw this step's noise and add it (then divide, if ``divide_by``) into ``targets`` chunk by chunk.

        Counter stream: each chunk is added on the thread that drew it, while it is in that core's cache
        (``counter_stream.draw_counter_chunks``). Serial stream: this thread draws the chunks in order into the
        noise vector (``SERIAL_CHUNK_NUMEL`` entries each, a multiple of 16: torch's ``normal_`` then draws exactly
        the values and leaves exactly the generator state of one draw of the whole vector) and one pool thread adds
        each chunk as soon as it is drawn, so the add is hidden behind the draw.

        Why: one add over the whole noise vector after the draw is a second pass over memory that nothing overlaps,
        and each add opens torch's OpenMP team, whose worker then spins for milliseconds on the core the next draw
        needs (on a loaded machine the team's barrier waits for a preempted thread: 3-4x the step's CPU time was
        measured). Every op here is cut into pieces of at most ``counter_stream.GRAIN_NUMEL`` entries, which torch
        runs on the calling thread. Guarantee: the same bits as ``_fill_standard_noise`` then ``_add_to_tensors``
        (the same values, added and divided by elementwise ops, whose results do not depend on how the tensors
        are cut); an exception stops the draw and is raised once no thread touches the tensors any more.

        One thread (``torch.get_num_threads() == 1``): ``_draw_and_add_on_this_thread``."""
        if torch.get_num_threads() < 2:
            self._draw_and_add_on_this_thread(group, targets, std, divide_by)
            return
        counter = isinstance(group.generators[0], counter_stream.StreamKey)
        chunk_numel = counter_stream.CHUNK_NUMEL if counter else SERIAL_CHUNK_NUMEL
        bounds = counter_stream.chunk_bounds(group.numel) if counter else _serial_chunk_bounds(group.numel)
        plan = group.add_plan
        if plan is None or plan.chunk_numel != chunk_numel:
            plan = group.add_plan = _add_plan([t.numel() for t in targets], bounds, counter_stream.GRAIN_NUMEL,
                                              chunk_numel)  # fmt: skip
        pieces = _target_pieces(targets, plan)

        def add_chunk(index: int, chunk: torch.Tensor) -> None:
            first, last = plan.chunk_pieces[index]
            chunk_targets = pieces[first:last]
            with torch.no_grad():  # grad mode is per thread
                torch._foreach_add_(chunk_targets, chunk.split(plan.chunk_piece_sizes[index]))
                if divide_by is not None:
                    torch._foreach_div_(chunk_targets, divide_by)

        group.formed_ahead = False
        if counter:
            counter_stream.draw_counter_chunks(group.numel, group.dtype, group.generators, self._step, std, add_chunk)
            return
        noise, generator, pool = group.noise, group.generators[0], counter_stream.chunk_pool(1)
        adds: list[concurrent.futures.Future] = []
        try:
            for index, (start, end) in enumerate(bounds):
                chunk = noise[start:end]
                chunk.normal_(0.0, std, generator=generator)
                adds.append(pool.submit(add_chunk, index, chunk))
            concurrent.futures.wait(adds)
        except BaseException:  # the draw failed or this thread was interrupted: no add may run after the raise
            for add in adds:
                add.cancel()
            concurrent.futures.wait(adds)
            raise
        for add in adds:
            add.result()  # all done: the first failed add's exception (the step is undone)

    def _draw_and_add_on_this_thread(
        self, group: _DeviceGroup, targets: list[torch.Tensor], std: float, divide_by: float | None
    ) -> None:
        """``_draw_into_tensors`` at one thread: each chunk is drawn into a buffer that stays in the core's cache and
        added (then divided, if ``divide_by``) into its pieces of ``targets`` right away, on this thread.

        Why: drawing the whole noise vector, then adding it, then dividing makes three passes over memory of the
        vector's size (the draw's write, the add's reads and write, the division's read and write); here the
        gradients are read and written once and the noise never leaves the cache. Serial stream: the chunks
        (``ONE_THREAD_CHUNK_NUMEL`` entries, a multiple of 16) are drawn in order into the first entries of
        ``group.noise``, reused for every chunk (the rest of the vector is never touched, so its pages are never
        faulted in; it does not hold the step's noise afterwards: nothing reads it for a mechanism that neither
        forms nor keeps its noise). Counter stream: ``counter_stream.draw_counter_chunks`` on this thread (its
        own chunk buffer). Guarantee: the same bits and, on the serial stream, the same generator state after
        the step as one draw of the whole vector, one ``_add_to_tensors`` and one division (torch's ``normal_``
        fills 16 values at a time, so chunks of a multiple of 16 entries, with a last chunk of at least 16, draw
        exactly the values of one whole draw; adding and dividing are elementwise, so cutting the tensors
        changes no result). An exception stops the draw with the tensors partly noised (``add_noise_`` then
        restores the generators and the caller discards the tensors)."""
        counter = isinstance(group.generators[0], counter_stream.StreamKey)
        chunk_numel = counter_stream.CHUNK_NUMEL if counter else ONE_THREAD_CHUNK_NUMEL
        plan = _one_thread_add_plan(tuple(t.numel() for t in targets), chunk_numel, counter)
        pieces = _target_pieces(targets, plan)
        # Dividing by a power of two is multiplying by its exact reciprocal, which rounds every value alike (the same
        # real number) at about half a division's cost (measured in cache, where the division's cost no longer hides
        # behind memory).
        reciprocal = None if divide_by is None else _exact_reciprocal(divide_by)

        def add_chunk(index: int, chunk: torch.Tensor) -> None:
            first, last = plan.chunk_pieces[index]
            if last - first == 1:  # the common case (a chunk inside one tensor): two plain ops, no lists
                piece = pieces[first]
                piece.add_(chunk)
                if reciprocal is not None:
                    piece.mul_(reciprocal)
                elif divide_by is not None:
                    piece.div_(divide_by)
                return
            chunk_targets = pieces[first:last]
            torch._foreach_add_(chunk_targets, chunk.split(plan.chunk_piece_sizes[index]))
            if reciprocal is not None:
                torch._foreach_mul_(chunk_targets, reciprocal)
            elif divide_by is not None:
                torch._foreach_div_(chunk_targets, divide_by)

        group.formed_ahead = False
        if counter:
            counter_stream.draw_counter_chunks(group.numel, group.dtype, group.generators, self._step, std,
                                               add_chunk, threads=1)  # fmt: skip
            return
        scratch, generator = group.noise, group.generators[0]
        for index, (start, end) in enumerate(_serial_chunk_bounds(group.numel, chunk_numel)):
            chunk = scratch[: end - start]
            chunk.normal_(0.0, std, generator=generator)
            add_chunk(index, chunk)

    # ------------------------------------------------------------------ drawing ahead (noise.prefetch)
    def _prefetching(self) -> bool:
        if self.prefetch is None:
            # The sizes first: spare_core() asks the OS for this process's cores (a system call per step).
            groups = self._groups
            return bool(groups) and max(map(_NUMEL, groups)) >= noise_prefetch.MIN_PREFETCH_NUMEL and (
                noise_prefetch.spare_core()
            )
        return self.prefetch

    def _draw_ahead(self, std: float) -> None:
        """Start drawing the next step's noise (at this step's std) for every CPU device, in the background."""
        for group in self._groups:
            if group.device.type != "cpu" or id(group) in self._draws_ahead or group.noise is None:
                continue
            if self.prefetch is None and group.numel < noise_prefetch.MIN_PREFETCH_NUMEL:
                continue
            counter = isinstance(group.generators[0], counter_stream.StreamKey)
            if group.next_noise is None:
                group.next_noise = torch.empty_like(group.noise)
                group.next_views = [
                    group.next_noise[view.storage_offset() : view.storage_offset() + view.numel()].view(view.shape)
                    for view in group.noise_views
                ]
                if self.secure_mode:
                    group.next_scratch = torch.empty_like(group.noise)
            states = [generator.get_state() for generator in group.generators]
            if counter:
                # A key does not change when drawing: the draw ahead uses the keys themselves at the next step.
                shadows = list(group.generators)
            else:
                if len(group.shadow_generators) != len(group.generators):
                    group.shadow_generators = [torch.Generator(device=group.device) for _ in group.generators]
                shadows = group.shadow_generators
                for shadow, state in zip(shadows, states):
                    shadow.set_state(state)
            form, formed = self._form_ahead(group)
            future = noise_prefetch.submit(noise_prefetch.draw_and_form, group.next_noise, group.next_scratch,
                                           shadows, std, self.secure_mode, form, self._step)  # fmt: skip
            self._draws_ahead[id(group)] = noise_prefetch.PendingDraw(
                buffer=group.next_noise, std=std, start_states=states, shadows=shadows, future=future,
                formed=formed, counter_step=self._step if counter else None,
            )  # fmt: skip

    def _wait_for_draws_ahead(self) -> None:
        for ahead in getattr(self, "_draws_ahead", {}).values():
            ahead.wait()

    def _adds_in_noise_vector(self, group: _DeviceGroup, targets: list[torch.Tensor]) -> bool:
        """Whether this step's add and division run in the flat noise vector (``_add_in_noise_vector``): on the CPU,
        for many small tensors (at most ``SMALL_TENSOR_NUMEL`` entries each on average: one division per tensor cost
        ~1.5-2 us, far more than its entries), all of the noise's dtype, by a mechanism that neither forms nor keeps
        its noise and replaces none of the steps it stands in for (``_hooks_as_defined_here``: nothing reads the
        noise vector after the add)."""
        return (
            len(targets) > 2
            and group.numel <= SMALL_TENSOR_NUMEL * len(targets)
            and group.device.type == "cpu"
            and all(map(group.dtype.__eq__, map(_DTYPE, targets)))
            and self._hooks_as_defined_here()
        )

    @staticmethod
    def _add_in_noise_vector(group: _DeviceGroup, targets: list[torch.Tensor], divide_by: float) -> None:
        """``_add_to_tensors(group, targets, 1.0, divide_by)``, the same bits, in three ops instead of one add and one
        division per tensor: each tensor is added into its view of the noise vector (``noise + sum``: the same
        rounding as ``sum + noise``, addition being commutative in IEEE arithmetic, and the noise is finite), the
        whole vector is divided at once, and each tensor takes its view back (a copy). The noise vector then holds
        the released values, not the noise (only for a mechanism that reads it no more, ``_adds_in_noise_vector``)."""
        views = group.noise_views
        torch._foreach_add_(views, targets)
        group.noise.div_(divide_by)
        torch._foreach_copy_(targets, views)

    @staticmethod
    def _add_to_tensors(group: _DeviceGroup, tensors: list[torch.Tensor], scale: float,
                        divide_by: float | None = None) -> None:  # fmt: skip
        """Add ``scale`` times the noise to the tensors, then divide them by ``divide_by`` (if given)."""
        if all(map(group.dtype.__eq__, map(_DTYPE, tensors))):  # the usual case: every tensor of the noise's dtype
            targets = tensors if type(tensors) is list else list(tensors)
            if scale == 1.0:
                torch._foreach_add_(targets, group.noise_views)
            else:
                torch._foreach_add_(targets, group.noise_views, alpha=scale)
            if divide_by is not None:
                _divide_(targets, divide_by)
            return
        same_dtype = [(t, v) for t, v in zip(tensors, group.noise_views) if t.dtype == group.dtype]
        other_dtype = [(t, v) for t, v in zip(tensors, group.noise_views) if t.dtype != group.dtype]
        if same_dtype:
            targets, noises = zip(*same_dtype)
            if scale == 1.0:
                torch._foreach_add_(list(targets), list(noises))
            else:
                torch._foreach_add_(list(targets), list(noises), alpha=scale)
            if divide_by is not None:
                _divide_(list(targets), divide_by)
        for target, noise in other_dtype:
            target.add_(noise.to(target.dtype) if scale == 1.0 else (noise * scale).to(target.dtype))
            if divide_by is not None:
                target.div_(divide_by)
