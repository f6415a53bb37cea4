"""Signal handling around writes: hold Ctrl-C / SIGTERM back while a file that must not be torn
is written (`signals_deferred`), or remember them so a commit can refuse (`signals_latched`)."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)


@contextlib.contextmanager
def signals_deferred(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold SIGINT/SIGTERM back while the body runs, then deliver them to the handlers
    that were in place, as if they had just arrived.

    For short writes that must not be torn: a KeyboardInterrupt inside torch.save's zip
    writer is replaced by the writer's own RuntimeError on the way out (a traceback, and
    a checkpoint half-written). Only the main thread receives signals in Python, so
    elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        pending.append(signum)  # each one: a second Ctrl-C must still mean "abort" afterwards
        log.warning("%s received while writing a file: acting on it once the write is complete",
                    signal.Signals(signum).name)

    # an ignored signal stays ignored (a background job's SIGINT: "acting on it" was said, then nothing happened)
    previous = {sig: signal.signal(sig, hold) for sig in signums if signal.getsignal(sig) != signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in pending:  # the restored handlers run now, in order (StopFlag, KeyboardInterrupt...)
            signal.raise_signal(sig)


class SignalLatch:
    """What `signals_latched` saw: the signals received while it was in place."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def raise_if_received(self, what: str) -> None:
        """KeyboardInterrupt if a signal arrived, even one whose KeyboardInterrupt some library
        caught on the way: `what` (a commit) must not happen after the user asked to stop."""
        if self.received:
            raise KeyboardInterrupt(f"{signal.Signals(self.received[0]).name} received: {what} not done")


@contextlib.contextmanager
def signals_latched(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[SignalLatch]:
    """Remember every SIGINT/SIGTERM that arrives while the body runs, and pass each on to the
    handler that was in place (so Ctrl-C still raises KeyboardInterrupt at once).

    For work that ends in a commit (a rename into place): Python's KeyboardInterrupt is an
    exception like any other once raised, and a library that catches BaseException (or raises it
    inside a finalizer) turns a Ctrl-C into nothing. The latch keeps the fact, so the commit can
    refuse (`raise_if_received`). Signals the process ignores stay ignored; only the main thread
    receives signals in Python, so elsewhere this only yields."""
    latch = SignalLatch()
    if threading.current_thread() is not threading.main_thread():
        yield latch
        return
    previous: dict[int, Any] = {}

    def note(signum: int, frame: FrameType | None) -> None:
        latch.received.append(signum)
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
        else:  # SIG_DFL: what the signal would have done without us (SIGTERM: the process ends)
            signal.signal(signum, handler)
            signal.raise_signal(signum)

    for sig in signums:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, note)
    try:
        yield latch
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
