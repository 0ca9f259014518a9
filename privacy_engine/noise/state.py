"""Saving, checking and restoring a noise mechanism's state: ``state_dict``, ``check_state_dict``,
``load_state_dict`` and ``reseed`` of every ``NoiseMechanism`` (mixed into the base class).

The state is made of plain types (tensors, numbers, strings, lists, dicts), so it loads with
``torch.load(..., weights_only=True)``: the step index, the seed and generator states (none in secure
mode), the layout it was saved over, the history of past noise a mechanism keeps (``_history_rows`` per
device) and the mechanism's own fields (``_extra_state``: BandMF's coefficients and ring position).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from privacy_engine.noise import counter_stream
from privacy_engine.noise.layout import _generator_state_size, _global_generator_seed
from privacy_engine.settings_checks import check_noise_seed, check_unseeded_in_secure_mode

if TYPE_CHECKING:
    from privacy_engine.noise.layout import _DeviceGroup

logger = logging.getLogger(__name__)

__all__ = ["NoiseStateMixin"]


class NoiseStateMixin:
    """The checkpointing half of ``NoiseMechanism`` (which defines every attribute used here)."""

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
            "noise_stream": self.noise_stream,
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
        saved ones (same shapes, dtypes, number of devices, order). The run continues on the stream the
        state was saved with (``noise_stream``; ``"mt19937"`` for a state that names none, i.e. one written
        before the counter stream existed), whatever stream this mechanism was built with.

        Raises ``ValueError`` (and changes nothing) on anything ``check_state_dict`` rejects.
        """
        self.check_state_dict(state)
        devices = state["devices"]
        # Everything validated: from here on the state is changed.
        self._seed = state["seed"]
        self._layout_restarts = int(state.get("layout_restarts", 0))
        stream = state.get("noise_stream", counter_stream.STREAM_MT)
        if stream != self.noise_stream:
            logger.warning("the loaded noise state continues on its own noise stream %r, not on %r (the stream "
                           "this mechanism was built with): a run keeps one stream", stream, self.noise_stream)  # fmt: skip
            self.noise_stream = stream
            self._wait_for_draws_ahead()
            self._draws_ahead = {}
            for device_index, group in enumerate(self._groups):
                # The other stream's generators (or keys); restored from the saved state just below.
                group.generators = self._new_generators(group.device, device_index)
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
        A state loaded before the first step (``load_state_dict`` on a mechanism that has not laid out
        its noise yet) keeps the new generators' states in its place, so the first step, and a
        ``state_dict`` saved before it, continue with them. ValueError, with nothing changed, if that
        saved state is for a device type on which no generator can be made here.
        """
        check_unseeded_in_secure_mode("seed", seed, secure_mode=self.secure_mode)
        check_noise_seed(seed, name="seed")
        previous = self._seed
        if not self.secure_mode:
            self._seed = int(seed) if seed is not None else _global_generator_seed()
            while seed is None and self._seed == previous:
                self._seed = _global_generator_seed()
        if self._pending_devices is not None:
            # A state loaded before the first step: its saved generator states are replaced by those of
            # the new generators, so the pending state stays one the first step (and a checkpoint written
            # before it) accepts; secure mode saves none and draws from the OS at the first step.
            try:
                self._pending_devices = [
                    dict(device, generator_states=self._fresh_generator_states(device["device"], device_index))
                    for device_index, device in enumerate(self._pending_devices)
                ]
            except ValueError:
                self._seed = previous  # nothing changed
                raise
        for device_index, group in enumerate(self._groups):
            group.generators = self._new_generators(group.device, device_index)

    def _fresh_generator_states(self, saved_device: str, device_index: int) -> list[torch.Tensor] | None:
        """States of the generators ``_new_generators`` makes for the device ``saved_device`` names (any
        device of its type: a generator's state does not depend on the index); None in secure mode."""
        if self.secure_mode:
            return None
        device_type = torch.device(saved_device).type
        try:
            generators = self._new_generators(torch.device(device_type), device_index)
        except (RuntimeError, TypeError) as error:
            raise ValueError(
                f"the saved noise state is for a {device_type} device, where no generator can be made here: resume "
                f"on the same kind of device ({error})"
            ) from error
        return [generator.get_state() for generator in generators]

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
        a noise stream this version does not know         noise_stream
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
        stream = state.get("noise_stream", counter_stream.STREAM_MT)
        if stream not in counter_stream.NOISE_STREAMS:
            raise ValueError(
                f"noise state's noise_stream is {stream!r}; this version knows {list(counter_stream.NOISE_STREAMS)}: "
                "resume with the version of privacy_engine that wrote it (or a newer one)"
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
        # seed None outside secure mode: saved before the first step of a mechanism whose seed is drawn lazily.
        lazy = seed is None and state["devices"] == []
        if not self.secure_mode and not lazy and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
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
        self._check_saved_devices(devices, layout, stream=stream)

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
    def _check_saved_devices(
        self, devices: list[Any], groups: list[_DeviceGroup] | None = None, *, stream: str | None = None
    ) -> None:
        """Each saved device entry is well-formed and, when ``groups`` (a layout) is known, fits it. ``stream``:
        the noise stream the entries were saved with (default: this mechanism's)."""
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
                counter = (stream or self.noise_stream) == counter_stream.STREAM_COUNTER
                size = 16 if counter else _generator_state_size(device_type)
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
