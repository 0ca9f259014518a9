"""Keep Ctrl-C (and SIGTERM, SIGALRM handlers) out of the few lines that commit a private step.

A private step changes several pieces of state that must move together: the noise mechanism's
history row and ring position, its step index, the accountant's ledger. Python delivers
``KeyboardInterrupt`` between any two bytecodes, so an interrupt there could record a step whose
noise state did not advance (or the reverse). ``deferred_keyboard_interrupt`` holds the interrupt
until the block has finished and raises it right after, so the block runs whole or not at all.
``deferred_signals`` does the same for every signal whose handler raises (a SIGTERM handler that
raises ``SystemExit``, as preemptible clusters stop jobs; a SIGALRM handler raising ``TimeoutError``).
"""

from __future__ import annotations

import _signal  # the C functions ``signal`` wraps (see _SignalDeferral)
import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["deferred_keyboard_interrupt", "deferred_signals"]


@contextlib.contextmanager
def deferred_keyboard_interrupt() -> Iterator[None]:
    """Run the block without being interrupted by SIGINT; an interrupt that arrives meanwhile is
    raised as ``KeyboardInterrupt`` as soon as the block ends.

    Guarantee: in the main thread with Python's default SIGINT handler, a SIGINT never stops the
    block part-way. Elsewhere the block runs unprotected (Python delivers signals only to the main
    thread, and a custom handler is the program's own business).

    ====================================  ============================================
    case                                  result
    ====================================  ============================================
    no SIGINT during the block            nothing changes
    SIGINT during the block               block completes, then KeyboardInterrupt
    the block raises                      its exception propagates (a SIGINT that
                                          arrived meanwhile is dropped: the block was
                                          interrupted anyway)
    not the main thread / custom handler  no protection (block runs as is)
    ====================================  ============================================
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    received: list[int] = []

    def hold(signum: int, frame: object) -> None:
        received.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt


_COMMIT_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGALRM") if hasattr(signal, name)
)
_deferring = threading.local()


def deferred_signals(signals: Iterable[signal.Signals] = _COMMIT_SIGNALS) -> _SignalDeferral:
    """Run the block without any signal handler running inside it: a handler for one of ``signals``
    (default SIGINT, SIGTERM, SIGALRM) whose signal arrives meanwhile runs as soon as the block ends,
    with the handlers put back, so what it raises (``KeyboardInterrupt``, the ``SystemExit`` of a
    SIGTERM handler, the ``TimeoutError`` of a SIGALRM handler) is raised after the block.

    Guarantee: in the main thread, for every signal in ``signals`` whose handler is a Python callable
    (Python's default SIGINT handler included), no exception from that handler is raised part-way
    through the block; every such signal that arrived is delivered, in arrival order, once the block
    ends. Nested uses join the outermost one (delivery at its end).

    ========================================  ==============================================
    case                                      result
    ========================================  ==============================================
    no signal during the block                nothing changes
    signal during the block                   block completes, then the handler runs
    the block raises                          handlers still run after it (a SIGTERM is never
                                              dropped); what they raise chains to the block's
    SIG_DFL / SIG_IGN handler                 not touched (SIG_DFL SIGTERM kills the process:
                                              no Python state outlives it to be torn)
    not the main thread                       no protection (Python runs handlers only on
                                              the main thread, so none interrupts this one)
    nested block                              joins the outer block
    ========================================  ==============================================
    """
    return _SignalDeferral(signals)


class _SignalDeferral:
    """The context manager of ``deferred_signals`` (a class, not a generator: it runs at every private step, twice
    with the noise commit's nested use; the handlers are read and set with ``_signal``'s functions, which
    ``signal``'s wrap with an ``Enum`` conversion that cost ~5 us per call)."""

    __slots__ = ("_originals", "_received", "_signals")

    def __init__(self, signals: Iterable[signal.Signals]) -> None:
        self._signals = signals
        self._originals: dict[int, Callable[[int, Any], Any]] | None = None  # None: this use protects nothing
        self._received: list[tuple[int, Any]] = []

    def _hold(self, signum: int, frame: Any) -> None:
        self._received.append((signum, frame))

    def __enter__(self) -> None:
        # Nested first (a thread-local flag: true only on the thread that set it), then the thread, by its identity
        # (current_thread() is main_thread() exactly when their idents are equal): the same test in the cheaper order
        # (the noise commit's use, nested in DPOptimizer.step's, skips the thread lookups).
        if getattr(_deferring, "active", False) or threading.get_ident() != threading.main_thread().ident:
            return  # nested, or another thread: the outermost use delivers
        originals = {}
        for signum in self._signals:
            handler = _signal.getsignal(signum)
            if callable(handler):
                originals[signum] = handler
        self._originals = originals
        _deferring.active = True
        try:
            for signum in originals:
                _signal.signal(signum, self._hold)
        except BaseException:
            self._finish()
            raise

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        if self._originals is not None:
            self._finish()  # what a handler raises here chains to the block's exception, if any

    def _finish(self) -> None:
        """Put the handlers back, end the deferral, then run the handlers of the signals that arrived, in order."""
        originals, self._originals = self._originals, None
        try:
            for signum, handler in originals.items():
                _signal.signal(signum, handler)
        finally:
            _deferring.active = False
            for signum, frame in self._received:
                originals[signum](signum, frame)
