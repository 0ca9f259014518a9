"""Drawing the next step's Gaussian noise ahead of time, on a background thread (CPU).

Noise does not depend on the data, so step ``t + 1``'s standard draw can be made while step ``t + 1``'s
forward and backward passes run. A ``NoiseMechanism`` asks for it right after a step is committed; the
draw runs on one background thread into a second flat buffer per device, from *shadow* copies of the
device's generators (same state), so the real generators are never touched by the background thread
and always show the state of the last committed step: ``state_dict``, a test reading
``generator.get_state()``, a failed step's rollback and ``load_state_dict`` see exactly what they would
see without prefetching. The next ``add_noise_`` takes the prefetched buffer only if nothing changed in
between: the same standard deviation, the same layout, and every real generator still in the state the
shadow copy started from; it then moves the real generators to the shadow copies' end state, which is
where drawing in place would have left them. Otherwise the prefetch is dropped and the step draws as
usual. Either way the step adds bit for bit the noise it would have added without prefetching (the same
``normal_`` calls on the same generator states into a buffer of the same size), so the seeded stream,
checkpoints and secure mode (its four OS-seeded generators are copied the same way) are unchanged.

Why only on CPU, and only with a spare core by default: a CUDA draw is already asynchronous (it is queued
on the stream), and on CPU the draw competes for cores with the step it overlaps. ``NoiseMechanism``'s
``prefetch=None`` prefetches a device's noise when torch's intra-op threads leave at least one of the
process's cores free (``spare_core()``) and the device has at least ``MIN_PREFETCH_NUMEL`` entries (below
that, handing the draw to another thread costs more than the draw: about 30 us against 4 ns per entry);
``prefetch=True`` always prefetches on CPU, ``False`` never does.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from privacy_engine.noise import counter_stream

__all__ = [
    "MIN_PREFETCH_NUMEL",
    "PendingDraw",
    "draw_and_form",
    "draw_standard_noise",
    "spare_core",
    "submit",
]

MIN_PREFETCH_NUMEL = 1 << 16

_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_pid: int | None = None


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def spare_core() -> bool:
    """Whether torch's intra-op threads leave one of this process's cores idle for a background draw."""
    return torch.get_num_threads() < _usable_cores()


def submit(function, *args) -> concurrent.futures.Future:
    """Run ``function(*args)`` on the one background noise thread of this process."""
    global _executor, _executor_pid
    with _lock:
        # A forked child inherits the executor object but not its thread: make a new one there.
        if _executor is None or _executor_pid != os.getpid():
            _executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="privacy-engine-noise")
            _executor_pid = os.getpid()
        return _executor.submit(function, *args)


def draw_standard_noise(
    out: torch.Tensor,
    scratch: torch.Tensor | None,
    generators: Sequence[torch.Generator] | Sequence[counter_stream.StreamKey],
    std: float,
    secure_mode: bool,
    *,
    step: int | None = None,
) -> None:
    """``out`` <- iid ``N(0, std^2)``: one ``normal_`` from ``generators[0]``, or in secure mode the sum of
    one draw at ``std / sqrt(k)`` from each of the ``k`` generators (exactly ``N(0, std^2)`` in
    distribution; ``scratch`` holds each further draw). Keys of the counter stream instead of generators:
    ``counter_stream.draw_counter_noise`` at ``step`` (the same sum of ``k`` draws in secure mode)."""
    if generators and isinstance(generators[0], counter_stream.StreamKey):
        if step is None:
            raise ValueError("the counter stream draws at a step: pass step")
        counter_stream.draw_counter_noise(out, scratch, generators, step, std)
        return
    if torch.is_grad_enabled():  # (a background thread: grad mode is per thread)
        with torch.no_grad():
            _draw_serial(out, scratch, generators, std, secure_mode)
    else:  # the step's own draw: DPOptimizer.step runs without grad, no context needed
        _draw_serial(out, scratch, generators, std, secure_mode)


def _draw_serial(
    out: torch.Tensor,
    scratch: torch.Tensor | None,
    generators: Sequence[torch.Generator],
    std: float,
    secure_mode: bool,
) -> None:
    """``draw_standard_noise`` on the serial stream (grad mode off)."""
    if not secure_mode:
        out.normal_(0.0, std, generator=generators[0])
    else:
        part_std = std / math.sqrt(len(generators))
        out.normal_(0.0, part_std, generator=generators[0])
        for generator in generators[1:]:
            scratch.normal_(0.0, part_std, generator=generator)
            out.add_(scratch)


def draw_and_form(
    out: torch.Tensor,
    scratch: torch.Tensor | None,
    generators: Sequence[torch.Generator],
    std: float,
    secure_mode: bool,
    form: Callable[[torch.Tensor], None] | None,
    step: int | None = None,
) -> None:
    """``draw_standard_noise`` (at ``step`` for the counter stream), then ``form(out)`` (BandMF: the next
    step's noise from the history), if given."""
    draw_standard_noise(out, scratch, generators, std, secure_mode, step=step)
    if form is not None:
        with torch.no_grad():
            form(out)


@dataclass(eq=False)
class PendingDraw:
    """One device's draw running (or done) in the background for the next step.

    ``buffer``: where the draw goes; ``start_states``: the real generators' states when the draw was
    submitted (the draw is valid only while they are unchanged); ``shadows``: the generators the
    background thread draws from; ``formed``: None for a plain draw, else what the mechanism's state
    was when the draw was also formed into the next step's noise (valid only while it is unchanged).
    """

    buffer: torch.Tensor
    std: float
    start_states: list[torch.Tensor]
    shadows: list[torch.Generator]
    future: concurrent.futures.Future
    formed: object = None
    counter_step: int | None = None  # the counter stream's step the draw is for (None: the serial stream)

    def wait(self) -> bool:
        """Block until the draw is done; whether it succeeded (an exception is swallowed: the step then
        draws in place, which raises the error again if it persists)."""
        try:
            self.future.result()
            return True
        except Exception:  # noqa: BLE001
            return False

    def matches(self, generators: Sequence[torch.Generator], std: float) -> bool:
        """Whether this draw is exactly what drawing now from ``generators`` at ``std`` would give."""
        return (
            std == self.std
            and len(generators) == len(self.start_states)
            and all(_same_state(g.get_state(), s) for g, s in zip(generators, self.start_states))
        )


def _same_state(state: torch.Tensor, start: torch.Tensor) -> bool:
    """Whether two generator states are the same bytes: a CPU state (the 5 KB Mersenne-Twister state, or a counter
    key) compared as bytes, about 2x cheaper than ``torch.equal``'s dispatch once per step; any other, by
    ``torch.equal``. Exact either way: equal bytes, equal length. (``is_cpu``: the test of ``device.type == "cpu"``
    without building two device objects; measured ~4 us per step inside a training loop.)"""
    if state.is_cpu and start.is_cpu and state.dtype == start.dtype == torch.uint8:
        return state.numpy().tobytes() == start.numpy().tobytes()
    return torch.equal(state, start)
