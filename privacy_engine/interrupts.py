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


@contextlib.contextmanager
def deferred_signals(signals: Iterable[signal.Signals] = _COMMIT_SIGNALS) -> Iterator[None]:
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
    if threading.current_thread() is not threading.main_thread() or getattr(_deferring, "active", False):
        yield
        return
    received: list[tuple[int, Any]] = []
    originals: dict[int, Callable[[int, Any], Any]] = {}

    def hold(signum: int, frame: Any) -> None:
        received.append((signum, frame))

    for signum in signals:
        handler = signal.getsignal(signum)
        if callable(handler):
            originals[signum] = handler
    _deferring.active = True
    try:
        for signum in originals:
            signal.signal(signum, hold)
        yield
    finally:
        for signum, handler in originals.items():
            signal.signal(signum, handler)
        _deferring.active = False
        for signum, frame in received:
            originals[signum](signum, frame)
