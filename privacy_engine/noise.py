"""Noise mechanisms: independent Gaussian noise (DP-SGD) and banded matrix factorisation (BandMF).

Both mechanisms share one interface: the optimizer hands over the clipped, summed gradients of
all parameters (one tensor per parameter) and the mechanism adds this step's noise in place.

Layout of the randomness. Tensors are grouped by device (in order of first appearance) and,
within a device, laid end to end in one flat vector of ``total_numel`` entries. Each step draws
one flat standard-normal vector per device from that device's own ``torch.Generator`` and adds
the matching slice to each tensor. Both mechanisms draw the same way, so ``BandMFNoise`` with
coefficients ``(1.0,)`` adds exactly the numbers ``GaussianNoise`` adds for the same seed.

BandMF (Choquette-Choo et al. 2023, arXiv:2306.08153; McKenna 2024, arXiv:2405.15913). The
strategy ``C`` is lower-triangular banded Toeplitz with ``C[i, j] = c[i - j]`` for
``0 <= i - j < b``. The mechanism releases the noisy gradients ``G + C^{-1} Z`` where ``Z`` has
iid ``N(0, s^2)`` entries, ``s = noise_multiplier * max_grad_norm * ||c||_2``. This is
post-processing of ``C G + Z``: each example that participates at steps at least ``b`` apart
(cyclic Poisson sampling with ``b`` groups guarantees this) changes each touched block of rows of
``C G`` by at most ``max_grad_norm * ||c||_2`` (the max column norm of ``C``), which ``Z``
hides with noise multiplier ``noise_multiplier``. Row ``t`` of ``C^{-1} Z`` is computed by
streaming: ``x_t = (z_t - sum_{j=1}^{b-1} c_j x_{t-j}) / c_0``, keeping the last ``b - 1`` noise
vectors in a ring buffer.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from privacy_engine import noise_prefetch
from privacy_engine.interrupts import deferred_keyboard_interrupt
from privacy_engine.secure_random import full_entropy_generator
from privacy_engine.strategy import validated_coefficients

__all__ = ["BandMFNoise", "GaussianNoise", "NoiseMechanism"]

# In secure mode each noise value is the sum of this many independent draws (each with std s / 2),
# one per generator, every generator's state set from OS entropy (``full_entropy_generator``: the
# whole 19937-bit Mersenne Twister state on CPU, 64 seed bits for Philox on CUDA). The sum is not
# there for entropy but against floating-point attacks: one sampler's outputs form a sparse,
# uneven set of floats that can betray the value the noise was added to; a sum of four blurs it.
_SECURE_MODE_GENERATORS = 4


def _global_generator_seed() -> int:
    """A 62-bit seed drawn from torch's global CPU generator (what ``torch.manual_seed`` sets)."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())


def _derived_seed(seed: int, device_index: int, generator_index: int, layout: int = 0) -> int:
    # SeedSequence spawns statistically independent streams for each (device, generator) pair
    # from one user seed; neighbouring integers as seeds would be correlated for some PRNGs.
    # ``layout`` counts layout restarts: each restart gets fresh streams (noise is never reused).
    key = (device_index, generator_index) if layout == 0 else (device_index, generator_index, layout)
    sequence = np.random.SeedSequence(entropy=seed, spawn_key=key)
    return int(sequence.generate_state(1, dtype=np.uint64)[0])


@functools.lru_cache(maxsize=None)
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
    history: torch.Tensor | None = None  # BandMF ring buffer, shape (b - 1, numel)
    ring_weights: torch.Tensor | None = None  # row p: coefficients rotated for ring position p
    noise_views: list[torch.Tensor] = field(default_factory=list)
    # The next step's draw, made ahead on a background thread (privacy_engine.noise_prefetch): its buffer,
    # views of it, secure-mode scratch, and the copies of the generators it is drawn from.
    next_noise: torch.Tensor | None = None
    next_views: list[torch.Tensor] = field(default_factory=list)
    next_scratch: torch.Tensor | None = None
    shadow_generators: list[torch.Generator] = field(default_factory=list)
    formed_ahead: bool = False  # group.noise already holds this step's formed noise (BandMF, drawn ahead)


class NoiseMechanism(abc.ABC):
    """Adds privacy noise to the clipped gradient sums, one step at a time.

    Subclasses define the noise (``noise_std`` and how this step's noise is formed from fresh
    Gaussian draws); this base class owns validation, per-device generators, the flat layout of
    the tensors, and checkpointing.

    Secure mode. What it promises: no seed search recovers the noise. Each device's four
    generators get their state straight from the OS (``secure_random.full_entropy_generator``:
    19937 bits per CPU generator, 64 per CUDA generator, instead of the 32 bits torch's
    ``manual_seed`` keeps on CPU), and no seed or generator state is ever written to a
    ``state_dict``, so a checkpoint cannot reproduce future noise (a resumed secure run draws
    fresh OS-seeded generators). What it does not promise, and what to do about it:

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
            ``None``: one draw from torch's global generator (so ``torch.manual_seed`` makes the
            run reproducible, as with Opacus), recorded in ``state_dict`` for resuming.
        secure_mode: OS entropy only (a user ``seed`` raises ``ValueError``), as described above.
        prefetch: draw the next step's noise on a background thread while the current step's
            forward and backward passes run (CPU tensors only; one more flat buffer per device).
            ``None``: when torch's intra-op threads leave one of the process's cores free and a
            device holds at least ``noise_prefetch.MIN_PREFETCH_NUMEL`` entries; ``True``: always;
            ``False``: never. The noise added is bit for bit the same either way
            (``privacy_engine.noise_prefetch``).
    """

    def __init__(self, *, seed: int | None = None, secure_mode: bool = False, prefetch: bool | None = None) -> None:
        if secure_mode and seed is not None:
            raise ValueError(
                "seed must be None when secure_mode=True: secure mode draws its seeds from OS "
                "entropy so that nobody can reproduce the noise. Drop `seed`, or set "
                "secure_mode=False for a reproducible (not secure) run."
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        if seed is not None and seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        if prefetch is not None and not isinstance(prefetch, bool):
            raise ValueError(f"prefetch must be True, False or None (automatic), got {prefetch!r}")
        self.prefetch = prefetch
        self.secure_mode = bool(secure_mode)
        # No seed: one draw from torch's global generator, as Opacus's noise draws from it, so that
        # torch.manual_seed alone makes a run reproducible (never in secure mode).
        self._seed = None if secure_mode else (_global_generator_seed() if seed is None else int(seed))
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
        return state

    # ------------------------------------------------------------------ public interface
    def restart_layout(self) -> None:
        """Forget the layout (and BandMF's noise history): the next ``add_noise_`` lays the noise out
        over the tensors it is given, e.g. after parameters were unfrozen.

        Guarantee: the step count and the seeded stream continue (the new generators are derived
        from the seed and the number of restarts, so no noise value is drawn twice). For BandMF the
        correlation restarts: the strategy becomes block-diagonal, still b-banded with column norms
        at most ``||c||_2``, so the same accounting holds (each participation still touches at most
        b rows with that norm); only the noise cancellation across the restart is lost.
        """
        self._layout_restarts += 1
        self._signature = None
        self._wait_for_draws_ahead()
        self._draws_ahead = {}
        self._groups = []
        if hasattr(self, "_ring_position"):
            self._ring_position = 0

    @property
    def step(self) -> int:
        """Number of steps taken (calls to ``add_noise_``)."""
        return self._step

    @abc.abstractmethod
    def noise_std(self, noise_multiplier: float, max_grad_norm: float) -> float:
        """Standard deviation ``s`` of the fresh Gaussian draws ``z_t`` (see subclasses)."""

    def add_noise_(
        self,
        tensors: Sequence[torch.Tensor],
        noise_multiplier: float,
        max_grad_norm: float,
        *,
        on_commit: Callable[[], None] | None = None,
    ) -> None:
        """Add this step's noise in place to each tensor and advance the step index by one.

        ``tensors`` are the clipped gradient sums, one per parameter; they may differ in shape,
        dtype and device, but the list (shapes, dtypes, devices, order) must be the same at
        every step, because the mechanism's state is laid out over it.

        Guarantee: when ``noise_std > 0``, every call draws fresh Gaussian values for every
        entry of every tensor and adds exactly this step's noise of the mechanism (nothing is
        skipped, reused or scaled beyond what the mechanism defines); the step index advances
        by one per successful call, and a call rejected by validation changes nothing.

        Transactional: the noise is drawn and formed in scratch buffers and added to
        ``tensors``; only then is the step committed (``on_commit()``, then the BandMF history
        row, ring position and step index), with Ctrl-C held off (``deferred_keyboard_interrupt``).
        If anything raises before the commit (``KeyboardInterrupt`` included, ``on_commit``
        included), the generators are put back and the mechanism is exactly as before the call;
        ``tensors`` may then hold part of the noise and must be discarded. ``on_commit`` is
        where a caller records the release (the accountant): it runs only when the noise is in
        place and the step is committed if and only if it returns. A ``KeyboardInterrupt`` that
        arrives during the commit is raised after it: the step then counts as taken.

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
        =========================  ==============================================
        """
        scale = self._validated_noise_scale(noise_multiplier, max_grad_norm)
        std = self.noise_std(noise_multiplier, max_grad_norm)
        tensors = list(tensors)
        signature = self._check_tensors(tensors)
        self._before_step(scale)
        if not self._groups:
            self._initialise(tensors, signature)
        drawn = std > 0.0
        # Drawing advances the generators: their states are kept (a few KB) so that a failed
        # step can be undone; the noise itself is formed in scratch buffers, never in the history.
        generator_states = [[g.get_state() for g in group.generators] for group in self._groups] if drawn else []
        committed = False
        try:
            with torch.no_grad():
                if drawn:
                    for group in self._groups:
                        self._ensure_buffers(group)
                        self._fill_standard_noise(group, std)
                        row_scale = self._form_noise(group)
                        self._add_to_tensors(group, [tensors[i] for i in group.tensor_indices], row_scale)
                with deferred_keyboard_interrupt():
                    if on_commit is not None:
                        on_commit()
                    self._commit(drawn)
                    committed = True
        except BaseException:
            if not committed:
                for group, states in zip(self._groups, generator_states):
                    for generator, state in zip(group.generators, states):
                        generator.set_state(state)
            raise
        if drawn and self._prefetching():
            self._draw_ahead(std)

    def _commit(self, drawn: bool) -> None:
        """Make this step's noise part of the state (the only place a step changes it)."""
        if drawn:
            for group in self._groups:
                self._commit_noise(group)
        self._after_step()
        self._step += 1

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the noise sequence: step index, seed, generator states,
        and for BandMF the noise history and ring position. Plain types only (tensors, numbers,
        strings, lists, dicts): it loads with ``torch.load(..., weights_only=True)``.

        The returned tensors are CPU copies. Outside secure mode the state determines all future
        noise (seed and generator states): keep it as secret as the gradients. In secure mode no
        seed and no generator state is included (``"generator_states": None``): a resumed run
        draws fresh OS-seeded generators, so the state does not reproduce future noise; it still
        holds BandMF's history (past noise), needed to continue the correlated noise.
        """
        devices = []
        for group in self._groups:
            history = None if group.history is None else group.history.detach().cpu().clone()
            devices.append(
                {
                    "device": str(group.device),
                    "numel": group.numel,
                    "dtype": str(group.dtype),
                    "generator_states": None if self.secure_mode else [g.get_state() for g in group.generators],
                    "history": history,
                }
            )
        if self._pending_devices is not None:
            devices = self._pending_devices
        signature = self._pending_signature
        if self._signature is not None:
            signature = [
                (list(shape), str(dtype), str(device)) for shape, dtype, device in self._signature
            ]
        return {
            "mechanism": type(self).__name__,
            "step": self._step,
            "secure_mode": self.secure_mode,
            "seed": self._seed,
            "layout_restarts": self._layout_restarts,
            "signature": signature,
            "devices": devices,
            **self._extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from ``state_dict`` so the run continues with exactly the noise the
        uninterrupted run would have added (secure mode: the same history and ring position, with
        fresh OS-seeded generators). The tensors passed to the next ``add_noise_`` must match the
        saved ones (same shapes, dtypes, number of devices, order).

        Raises ``ValueError`` (and changes nothing) on anything ``check_state_dict`` rejects.
        """
        self.check_state_dict(state)
        devices = state["devices"]
        # Everything validated: from here on the state is changed.
        self._seed = state["seed"]
        self._layout_restarts = int(state.get("layout_restarts", 0))
        self._step = int(state["step"])
        self._load_extra_state(state)
        if self._groups:
            if devices:
                self._restore_devices(devices)
            else:
                # Saved before its first step: start over from the saved seed.
                self._groups = []
                self._signature = None
        else:
            self._pending_devices = list(devices) if devices else None
            self._pending_signature = state["signature"] if devices else None

    def reseed(self, seed: int | None = None) -> None:
        """Continue with new generators: the next noise is fresh, history and ring position stay.

        For a resume that is not exact (a checkpoint restored without the loader's state, or saved
        while a drawn batch was not yet released): the saved generators would produce the noise the
        interrupted run added, or was about to add, to other batches, and the same noise on two
        different batches reveals the difference of their gradients. Guarantee: every generator is
        replaced by a new one seeded from ``seed`` (``None``: a draw from torch's global generator
        other than the current seed); secure mode: from OS entropy (a ``seed`` raises ValueError).
        """
        if self.secure_mode and seed is not None:
            raise ValueError("seed must be None when secure_mode=True: secure mode draws its generators from the OS")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ValueError(f"seed must be a non-negative int or None, got {seed!r}")
        if not self.secure_mode:
            previous = self._seed
            self._seed = int(seed) if seed is not None else _global_generator_seed()
            while seed is None and self._seed == previous:
                self._seed = _global_generator_seed()
        for device_index, group in enumerate(self._groups):
            group.generators = self._new_generators(group.device, device_index)
        if self._pending_devices is not None:
            self._pending_devices = [dict(device, generator_states=None) for device in self._pending_devices]

    def check_state_dict(self, state: Any, tensors: Sequence[torch.Tensor] | None = None) -> None:
        """Raise ``ValueError`` naming the first problem (and what to do) unless
        ``load_state_dict(state)`` would restore it; changes nothing.

        ``tensors``: what the next ``add_noise_`` will receive (the parameters, whose gradients
        have their shapes and dtypes), to check the saved layout before the first step; once the
        mechanism has stepped, its own layout is used.

        ================================================  ================================
        state problem                                     error names
        ================================================  ================================
        not a dict / missing key                          the key
        another mechanism, coefficients, column norm.      mechanism / coefficients
        secure_mode differs                               secure_mode
        step, seed, ring position of the wrong type       the field
        other device count, sizes, dtypes, device type    the device
        generator state of the wrong kind or size         generator_states
        (a secure state holds none; a plain one must)
        history of the wrong shape                        history
        tensors of other shapes / dtypes                  the first differing tensor
        ================================================  ================================
        """
        if not isinstance(state, dict):
            raise ValueError(f"noise state must be a dict (from NoiseMechanism.state_dict()); got {type(state).__name__}")
        missing = [k for k in ("mechanism", "step", "secure_mode", "seed", "signature", "devices") if k not in state]
        if missing:
            raise ValueError(f"noise state is missing {missing}: it was not written by NoiseMechanism.state_dict()")
        if state["mechanism"] != type(self).__name__:
            raise ValueError(
                f"noise state was saved by a {state['mechanism']!r} mechanism and cannot be loaded into "
                f"{type(self).__name__}: build the run with the same noise mechanism as the saved one"
            )
        if not isinstance(state["secure_mode"], bool) or state["secure_mode"] != self.secure_mode:
            raise ValueError(
                f"noise state was saved with secure_mode={state['secure_mode']!r}, this mechanism has "
                f"secure_mode={self.secure_mode}; build the mechanism with the same secure_mode"
            )
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"noise state's step must be an int >= 0; got {step!r}")
        seed = state["seed"]
        if self.secure_mode and seed is not None:
            raise ValueError("a secure-mode noise state must not hold a seed; this one does (it was altered)")
        if not self.secure_mode and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"noise state's seed must be an int >= 0; got {seed!r}")
        restarts = state.get("layout_restarts", 0)
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise ValueError(f"noise state's layout_restarts must be an int >= 0; got {restarts!r}")
        self._check_extra_state(state)
        devices = state["devices"]
        if not isinstance(devices, list):
            raise ValueError(f"noise state's devices must be a list; got {type(devices).__name__}")
        if not devices:
            return  # saved before its first step: only the seed and counters are restored
        signature = self._checked_saved_signature(state["signature"], devices)
        if self._groups:
            layout, current = self._groups, [(list(shape), str(dtype)) for shape, dtype, _ in self._signature]
        elif tensors is not None:
            tensors = list(tensors)
            layout = self._layout(tensors)
            current = [(list(t.shape), str(t.dtype)) for t in tensors]
        else:
            layout, current = None, None
        if current is not None:
            saved = [(list(shape), dtype) for shape, dtype, _ in signature]
            if len(saved) != len(current):
                raise ValueError(
                    f"noise state was saved over {len(saved)} tensors, this run has {len(current)}: resume with the "
                    "same trainable parameters in the same order"
                )
            for index, (a, b) in enumerate(zip(saved, current)):
                if a != b:
                    raise ValueError(
                        f"noise state's tensor {index} was (shape {a[0]}, {a[1]}), this run's is (shape {b[0]}, "
                        f"{b[1]}): resume with the same trainable parameters in the same order"
                    )
        self._check_saved_devices(devices, layout)

    @staticmethod
    def _checked_saved_signature(signature: Any, devices: list) -> list:
        if not isinstance(signature, list) or not signature:
            raise ValueError("noise state has devices but no signature (the tensors it was laid out over)")
        for entry in signature:
            if (
                not isinstance(entry, (list, tuple))
                or len(entry) != 3
                or not isinstance(entry[0], (list, tuple))
                or not all(isinstance(n, int) and n >= 0 for n in entry[0])
                or not isinstance(entry[1], str)
                or not isinstance(entry[2], str)
            ):
                raise ValueError(f"noise state's signature entry {entry!r} is not (shape, dtype, device)")
        if sum(math.prod(entry[0]) for entry in signature) != sum(
            d.get("numel", -1) if isinstance(d, dict) else -1 for d in devices
        ):
            raise ValueError("noise state's signature and devices disagree on the number of entries (it was altered)")
        return signature

    # ------------------------------------------------------------------ subclass hooks
    def _before_step(self, noise_scale: float) -> None:
        """Validate step-dependent conditions before anything is changed.

        ``noise_scale`` is the validated ``noise_multiplier * max_grad_norm``."""

    def _after_step(self) -> None:
        """Update per-step state after the noise was added."""

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

    def _commit_noise(self, group: _DeviceGroup) -> None:
        """Keep what later steps need of this step's noise (``group.noise``), once it is committed."""

    def _history_rows(self) -> int:
        return 0

    def _make_ring_weights(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        return None

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _check_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _validated_noise_scale(noise_multiplier: float, max_grad_norm: float) -> float:
        """``noise_multiplier * max_grad_norm`` after checking both; 0.0 means no noise."""
        try:
            noise_multiplier = float(noise_multiplier)
            max_grad_norm = float(max_grad_norm)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"noise_multiplier and max_grad_norm must be real numbers, got "
                f"{noise_multiplier!r} and {max_grad_norm!r}"
            ) from error
        if not math.isfinite(noise_multiplier) or noise_multiplier < 0:
            raise ValueError(
                f"noise_multiplier must be finite and >= 0 (0 disables noise), got {noise_multiplier}"
            )
        if math.isnan(max_grad_norm) or max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0, got {max_grad_norm}")
        if noise_multiplier == 0.0:
            return 0.0
        if math.isinf(max_grad_norm):
            raise ValueError(
                "max_grad_norm is inf with noise_multiplier > 0: unclipped gradients have "
                "unbounded sensitivity and no finite noise makes them private. Set a finite "
                "max_grad_norm, or noise_multiplier=0 for non-private training."
            )
        scale = noise_multiplier * max_grad_norm
        if not math.isfinite(scale):
            raise ValueError(
                f"noise_multiplier * max_grad_norm overflows ({noise_multiplier} * {max_grad_norm})"
            )
        return scale

    def _check_tensors(
        self, tensors: list[torch.Tensor]
    ) -> tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]:
        if not tensors:
            raise ValueError("tensors is empty: pass the clipped gradient sum of every parameter")
        for index, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"tensors[{index}] is a {type(tensor).__name__}, not a torch.Tensor")
            if not tensor.is_floating_point():
                raise ValueError(
                    f"tensors[{index}] has dtype {tensor.dtype}; noise can only be added to "
                    "floating-point tensors"
                )
        signature = tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)
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
        if self.secure_mode:
            return [full_entropy_generator(device) for _ in range(_SECURE_MODE_GENERATORS)]
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
        if rows > 0:
            group.ring_weights = self._make_ring_weights(group.dtype, group.device)

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
            and (ahead.formed is None or ahead.formed == self._form_ahead_key(group))
        ):
            group.noise, group.next_noise = group.next_noise, group.noise
            group.noise_views, group.next_views = group.next_views, group.noise_views
            for generator, shadow in zip(group.generators, ahead.shadows):
                generator.set_state(shadow.get_state())
            group.formed_ahead = ahead.formed is not None
            return
        # Secure mode: the sum of four independent N(0, (s/2)^2) draws is exactly N(0, s^2) in distribution.
        noise_prefetch.draw_standard_noise(group.noise, group.secure_scratch, group.generators, std, self.secure_mode)

    # ------------------------------------------------------------------ drawing ahead (noise_prefetch)
    def _prefetching(self) -> bool:
        if self.prefetch is None:
            return noise_prefetch.spare_core() and any(g.numel >= noise_prefetch.MIN_PREFETCH_NUMEL for g in self._groups)
        return self.prefetch

    def _draw_ahead(self, std: float) -> None:
        """Start drawing the next step's noise (at this step's std) for every CPU device, in the background."""
        for group in self._groups:
            if group.device.type != "cpu" or id(group) in self._draws_ahead or group.noise is None:
                continue
            if self.prefetch is None and group.numel < noise_prefetch.MIN_PREFETCH_NUMEL:
                continue
            if group.next_noise is None:
                group.next_noise = torch.empty_like(group.noise)
                group.next_views = [
                    group.next_noise[view.storage_offset() : view.storage_offset() + view.numel()].view(view.shape)
                    for view in group.noise_views
                ]
                if self.secure_mode:
                    group.next_scratch = torch.empty_like(group.noise)
                group.shadow_generators = [torch.Generator(device=group.device) for _ in group.generators]
            states = [generator.get_state() for generator in group.generators]
            for shadow, state in zip(group.shadow_generators, states):
                shadow.set_state(state)
            form, formed = self._form_ahead(group)
            future = noise_prefetch.submit(noise_prefetch.draw_and_form, group.next_noise, group.next_scratch,
                                           group.shadow_generators, std, self.secure_mode, form)  # fmt: skip
            self._draws_ahead[id(group)] = noise_prefetch.PendingDraw(
                buffer=group.next_noise, std=std, start_states=states, shadows=group.shadow_generators, future=future,
                formed=formed,
            )  # fmt: skip

    def _wait_for_draws_ahead(self) -> None:
        for ahead in getattr(self, "_draws_ahead", {}).values():
            ahead.wait()

    @staticmethod
    def _add_to_tensors(group: _DeviceGroup, tensors: list[torch.Tensor], scale: float) -> None:
        same_dtype = [(t, v) for t, v in zip(tensors, group.noise_views) if t.dtype == group.dtype]
        other_dtype = [(t, v) for t, v in zip(tensors, group.noise_views) if t.dtype != group.dtype]
        if same_dtype:
            targets, noises = zip(*same_dtype)
            if scale == 1.0:
                torch._foreach_add_(list(targets), list(noises))
            else:
                torch._foreach_add_(list(targets), list(noises), alpha=scale)
        for target, noise in other_dtype:
            target.add_(noise.to(target.dtype) if scale == 1.0 else (noise * scale).to(target.dtype))

    def _check_saved_devices(self, devices: list[Any], groups: list[_DeviceGroup] | None = None) -> None:
        """Each saved device entry is well-formed and, when ``groups`` (a layout) is known, fits it."""
        expected_rows = self._history_rows()
        for number, saved in enumerate(devices):
            where = f"noise state's device {number}"
            if not isinstance(saved, dict) or not {"device", "numel", "dtype", "generator_states", "history"} <= set(saved):
                raise ValueError(f"{where} is not a device entry written by NoiseMechanism.state_dict()")
            try:
                device_type = torch.device(saved["device"]).type
            except (RuntimeError, TypeError) as error:
                raise ValueError(f"{where} names no device ({saved['device']!r})") from error
            numel = saved["numel"]
            if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
                raise ValueError(f"{where} has numel {numel!r}; expected an int >= 0")
            states = saved["generator_states"]
            if self.secure_mode and states is not None:
                raise ValueError(f"{where} holds generator states, which a secure-mode state never does (altered?)")
            if not self.secure_mode:
                if not isinstance(states, list) or len(states) != 1:
                    raise ValueError(f"{where}: generator_states must be a list of one generator state")
                size = _generator_state_size(device_type)
                for state in states:
                    if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1
                            and (size is None or state.numel() == size)):  # fmt: skip
                        raise ValueError(
                            f"{where}: generator_states must hold uint8 {device_type} generator states"
                            + ("" if size is None else f" of {size} bytes")
                        )
            history = saved["history"]
            if history is not None:
                if not expected_rows:
                    raise ValueError(f"{where} holds a noise history, which {type(self).__name__} has none of")
                if not isinstance(history, torch.Tensor) or not history.is_floating_point():
                    raise ValueError(f"{where}: history must be a floating-point tensor")
                if tuple(history.shape) != (expected_rows, numel):
                    raise ValueError(
                        f"{where}: history has shape {tuple(history.shape)}, expected {(expected_rows, numel)}"
                    )
        if groups is None:
            return
        if len(devices) != len(groups):
            raise ValueError(
                f"noise state covers {len(devices)} device(s), this run's parameters are on {len(groups)}: resume "
                "with the parameters on the same devices"
            )
        for saved, group in zip(devices, groups):
            if saved["numel"] != group.numel or saved["dtype"] != str(group.dtype):
                raise ValueError(
                    f"noise state has {saved['numel']} {saved['dtype']} noise entries for "
                    f"{saved['device']}, the tensors on {group.device} need {group.numel} "
                    f"{group.dtype}: resume with the same parameters"
                )
            if torch.device(saved["device"]).type != group.device.type:
                raise ValueError(
                    f"noise state's generators are for a {torch.device(saved['device']).type} device, "
                    f"the tensors are on {group.device.type}: generator states do not transfer "
                    "between device types; resume on the same kind of device"
                )

    def _restore_devices(self, devices: list[dict[str, Any]]) -> None:
        for device_index, (saved, group) in enumerate(zip(devices, self._groups)):
            if saved["generator_states"] is None:
                # Secure mode (no state is saved) or reseed(): new generators continue the run.
                group.generators = self._new_generators(group.device, device_index)
            else:
                for generator, generator_state in zip(group.generators, saved["generator_states"]):
                    generator.set_state(generator_state)
            if saved["history"] is not None:
                group.history = saved["history"].to(device=group.device, dtype=group.dtype).clone()
            elif group.history is not None:
                group.history.zero_()


class GaussianNoise(NoiseMechanism):
    """DP-SGD noise: iid ``N(0, (noise_multiplier * max_grad_norm)^2)`` on every entry.

    Guarantee: with per-example gradients clipped to L2 norm ``max_grad_norm`` and summed, each
    step is the Gaussian mechanism with noise multiplier ``noise_multiplier`` (sensitivity
    ``max_grad_norm`` under add/remove of one example). Noise is independent across entries,
    tensors and steps.

    Args:
        seed: reproducible noise (per device, a derived stream). ``None``: seeded from torch's global
            generator (see ``NoiseMechanism``).
        secure_mode: OS-entropy seeds only (``seed`` must be None); see ``NoiseMechanism``.
    """

    def noise_std(self, noise_multiplier: float, max_grad_norm: float) -> float:
        """``noise_multiplier * max_grad_norm``; 0 when ``noise_multiplier`` is 0.

        ========================  =====================
        case                      result
        ========================  =====================
        noise_multiplier = 0      0.0 (no noise)
        max_grad_norm = inf       ValueError if sigma>0
        negative / NaN input      ValueError
        ========================  =====================
        """
        return self._validated_noise_scale(noise_multiplier, max_grad_norm)

    def __repr__(self) -> str:
        return f"GaussianNoise(secure_mode={self.secure_mode}, step={self.step})"


class BandMFNoise(NoiseMechanism):
    """Banded matrix-factorisation noise: step ``t`` adds row ``t`` of ``C^{-1} Z``.

    ``C`` is the ``b``-banded lower-triangular Toeplitz strategy with ``C[i, j] = c[i - j]``;
    ``Z`` has iid ``N(0, s^2)`` entries with ``s = noise_multiplier * max_grad_norm * ||c||_2``.

    Guarantee: the sequence of noisy gradients equals ``C^{-1} (C G + Z)``, post-processing of
    the Gaussian mechanism on ``C G``. If every example participates in steps at least ``b``
    apart (cyclic Poisson sampling with ``b`` groups), one participation changes ``C G`` by at
    most ``max_grad_norm * ||c||_2`` (the largest column norm of ``C``) in L2, so the mechanism
    is as private as DP-SGD with the same ``noise_multiplier`` on that participation pattern.
    The coefficients may have any positive scale: the noise does not depend on it.

    Column normalisation (``column_normalize_for_steps=n``, as in JAX Privacy and McKenna 2024):
    for a run of exactly ``n`` steps, the last ``b - 1`` columns of the ``n x n`` matrix ``C``
    are truncated and have smaller norms. Rescaling every column to norm ``||c||_2`` keeps the
    sensitivity and multiplies row ``t`` of ``C^{-1}`` by ``||c[:min(b, n - t)]||_2 / ||c||_2``
    (<= 1, = 1 for ``t <= n - b``): less noise in the final ``b - 1`` steps for the same
    guarantee. Steps beyond ``n`` are then undefined and raise ``RuntimeError``.

    ``noise_multiplier * max_grad_norm`` must be the same at every step: the guarantee above is
    for rows of ``Z`` with one scale.

    =====================================  ============================================
    case                                   result
    =====================================  ============================================
    coefficients = (c_0,)                  GaussianNoise noise (identical for c_0 = 1)
    coefficients not 1-D / non-finite      ValueError naming coefficients
    c_0 <= 0                               ValueError naming coefficients
    noise_multiplier = 0 at every step     no noise, step advances
    noise scale changes between steps      ValueError, nothing changed
    step >= column_normalize_for_steps     RuntimeError, nothing changed
    secure_mode with a seed                ValueError
    =====================================  ============================================
    """

    def __init__(
        self,
        coefficients: Sequence[float] | np.ndarray | torch.Tensor,
        *,
        seed: int | None = None,
        secure_mode: bool = False,
        column_normalize_for_steps: int | None = None,
        prefetch: bool | None = None,
    ) -> None:
        if isinstance(coefficients, torch.Tensor):
            coefficients = coefficients.detach().cpu().double().numpy()
        self.coefficients = validated_coefficients(coefficients)
        if column_normalize_for_steps is not None and (
            isinstance(column_normalize_for_steps, bool)
            or not isinstance(column_normalize_for_steps, (int, np.integer))
            or column_normalize_for_steps < 1
        ):
            raise ValueError(
                "column_normalize_for_steps must be None or a positive int (the number of steps "
                f"of the run), got {column_normalize_for_steps!r}"
            )
        super().__init__(seed=seed, secure_mode=secure_mode, prefetch=prefetch)
        self.column_normalize_for_steps = (
            None if column_normalize_for_steps is None else int(column_normalize_for_steps)
        )
        self.num_bands = int(self.coefficients.size)
        self.sensitivity = float(np.linalg.norm(self.coefficients))
        self._ring_position = 0
        self._fixed_scale: float | None = None  # noise_multiplier * max_grad_norm of step 0
        self._row_scale_tail = self._column_scales()

    def _column_scales(self) -> list[float]:
        """Row scales of the normalised ``C^{-1}`` for the last ``min(b - 1, n)`` steps."""
        n = self.column_normalize_for_steps
        if n is None:
            return []
        prefix_norms = np.sqrt(np.cumsum(self.coefficients**2)) / self.sensitivity
        # Step t of n keeps coefficients c_0..c_{min(b-1, n-1-t)} in its column.
        tail = [float(prefix_norms[min(self.num_bands - 1, n - 1 - t)]) for t in range(n)]
        return tail[max(0, n - (self.num_bands - 1)) :]

    def _row_scale(self, step: int) -> float:
        n = self.column_normalize_for_steps
        if n is None:
            return 1.0
        first_tail_step = n - len(self._row_scale_tail)
        return 1.0 if step < first_tail_step else self._row_scale_tail[step - first_tail_step]

    def noise_std(self, noise_multiplier: float, max_grad_norm: float) -> float:
        """``s = noise_multiplier * max_grad_norm * ||c||_2``, the std of the fresh draws ``z_t``.

        The noise actually added at step ``t`` has covariance ``s^2 (C^{-1} C^{-T})[t, t]`` per
        entry (``s^2 / c_0^2`` at step 0). Edge cases as ``GaussianNoise.noise_std``.
        """
        return self._validated_noise_scale(noise_multiplier, max_grad_norm) * self.sensitivity

    def _before_step(self, noise_scale: float) -> None:
        fixed = self._fixed_scale
        if fixed is not None and not math.isclose(noise_scale, fixed, rel_tol=1e-9):
            raise ValueError(
                "BandMFNoise needs the same noise_multiplier * max_grad_norm at every step "
                f"(first step: {fixed}, now: {noise_scale}): the guarantee covers rows of Z "
                "with one scale"
            )
        self._this_step_scale = noise_scale
        n = self.column_normalize_for_steps
        if n is not None and self._step >= n:
            raise RuntimeError(
                f"the strategy was column-normalised for column_normalize_for_steps={n} steps "
                f"and step {self._step + 1} was requested; build the mechanism with the real "
                "number of steps"
            )

    def _after_step(self) -> None:
        if self._fixed_scale is None:
            self._fixed_scale = self._this_step_scale
        if self.num_bands > 1:
            self._ring_position = (self._ring_position + 1) % (self.num_bands - 1)

    def _history_rows(self) -> int:
        return self.num_bands - 1

    def _make_ring_weights(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # Ring slot (p - j) mod (b - 1) holds x_{t-j} when the next write goes to slot p, so the
        # weights for position p are the coefficients c_1..c_{b-1} rotated accordingly; one
        # precomputed row per position keeps host-to-device copies out of the step.
        slots = self.num_bands - 1
        weights = np.zeros((slots, slots))
        for position in range(slots):
            for lag in range(1, self.num_bands):
                weights[position, (position - lag) % slots] = self.coefficients[lag]
        return torch.as_tensor(weights, dtype=dtype, device=device)

    def _form_noise(self, group: _DeviceGroup) -> float:
        if group.formed_ahead:
            group.formed_ahead = False  # formed in the background from this very state (_form_ahead)
        else:
            self._form_into(group.noise, group.history, group.ring_weights, self._ring_position)
        return self._row_scale(self._step)

    def _form_into(
        self, noise: torch.Tensor, history: torch.Tensor | None, ring_weights: torch.Tensor | None, position: int
    ) -> None:
        c_0 = float(self.coefficients[0])
        if self.num_bands == 1:
            if c_0 != 1.0:
                noise.div_(c_0)
        else:
            # x_t = (z_t - sum_j c_j x_{t-j}) / c_0 in one pass over the history (one gemv).
            noise.addmv_(history.t(), ring_weights[position], beta=1.0 / c_0, alpha=-1.0 / c_0)

    def _form_ahead(self, group: _DeviceGroup) -> tuple[Callable[[torch.Tensor], None] | None, object]:
        # The history and ring position are those of the next step once this step is committed; the same
        # gemv on the same data gives the same bits on any thread.
        form = functools.partial(
            self._form_into, history=group.history, ring_weights=group.ring_weights, position=self._ring_position
        )
        return form, self._form_ahead_key(group)

    def _form_ahead_key(self, group: _DeviceGroup) -> object:
        history = group.history
        return (self._ring_position, None if history is None else (id(history), history._version))

    def _commit_noise(self, group: _DeviceGroup) -> None:
        # x_t replaces x_{t-b+1} (no longer needed) in the ring, only now that the step is taken.
        if self.num_bands > 1:
            group.history[self._ring_position].copy_(group.noise)

    def _extra_state(self) -> dict[str, Any]:
        return {
            "coefficients": self.coefficients.tolist(),
            "column_normalize_for_steps": self.column_normalize_for_steps,
            "ring_position": self._ring_position,
            "noise_scale": self._fixed_scale,
        }

    def _check_extra_state(self, state: dict[str, Any]) -> None:
        saved = np.asarray(state["coefficients"], dtype=np.float64)
        if saved.shape != self.coefficients.shape or not np.array_equal(saved, self.coefficients):
            raise ValueError(
                "state was saved with different coefficients; build BandMFNoise with the "
                "coefficients of the saved run"
            )
        if state["column_normalize_for_steps"] != self.column_normalize_for_steps:
            raise ValueError(
                f"state was saved with column_normalize_for_steps="
                f"{state['column_normalize_for_steps']}, this mechanism has "
                f"{self.column_normalize_for_steps}"
            )

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._ring_position = int(state["ring_position"])
        self._fixed_scale = state["noise_scale"]

    def __repr__(self) -> str:
        return (
            f"BandMFNoise(num_bands={self.num_bands}, column_normalize_for_steps="
            f"{self.column_normalize_for_steps}, secure_mode={self.secure_mode}, step={self.step})"
        )
