"""The one signal path of the front-ends: SIGINT/SIGTERM set a stop event.

Each signal is noted (name, monotonic time). `on_repeat` runs for every signal after the first
(`tracejoin run` exits at once on a second signal; a capture keeps writing its files). The
previous handlers come back afterwards. Only the main thread may install handlers; elsewhere
(tests calling a front-end from a thread) nothing is installed and the caller stops it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType


@dataclass
class Stop:
    event: threading.Event = field(default_factory=threading.Event)
    signals: list[tuple[str, float]] = field(default_factory=list)  # (name, monotonic time)

    @property
    def first_signal(self) -> str | None:
        return self.signals[0][0] if self.signals else None

    @property
    def first_at(self) -> float | None:
        return self.signals[0][1] if self.signals else None


@contextlib.contextmanager
def stop_on_signals(on_repeat: Callable[[str], None] | None = None) -> Iterator[Stop]:
    stop = Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        repeat = stop.event.is_set()
        stop.signals.append((name, time.monotonic()))
        stop.event.set()
        if repeat and on_repeat is not None:
            on_repeat(name)

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield stop
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
