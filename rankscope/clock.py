"""Injectable clocks: wall time in ns for records, monotonic seconds for timeouts."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def wall_ns(self) -> int: ...

    def monotonic(self) -> float: ...


class SystemClock:
    def wall_ns(self) -> int:
        return time.time_ns()

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock tests move by hand. Thread-safe."""

    def __init__(self, start_s: float = 1_700_000_000.0) -> None:
        self._t = start_s
        self._lock = threading.Lock()

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._t += seconds

    def wall_ns(self) -> int:
        with self._lock:
            return int(self._t * 1e9)

    def monotonic(self) -> float:
        with self._lock:
            return self._t


SYSTEM_CLOCK = SystemClock()
