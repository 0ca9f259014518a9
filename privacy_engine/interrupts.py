"""Keep Ctrl-C out of the few lines that commit a private step.

A private step changes several pieces of state that must move together: the noise mechanism's
history row and ring position, its step index, the accountant's ledger. Python delivers
``KeyboardInterrupt`` between any two bytecodes, so an interrupt there could record a step whose
noise state did not advance (or the reverse). ``deferred_keyboard_interrupt`` holds the interrupt
until the block has finished and raises it right after, so the block runs whole or not at all.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["deferred_keyboard_interrupt"]


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
