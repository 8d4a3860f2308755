"""Metric groups that switch themselves off, and counter rates: shared by the GPU and host samplers.

A group is one callable that fills a sample dict. One that fails with an error meaning "never
here" (an NVML code in :data:`PERMANENT_NVML`, a missing attribute) or 30 times in a row is
dropped, silently (debug log), so an unsupported metric costs nothing after its first try.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rankscope.hw")

# NVML codes that mean "this will never work here": drop the metric group.
PERMANENT_NVML = {2, 3, 4, 13}  # INVALID_ARGUMENT, NOT_SUPPORTED, NO_PERMISSION, FUNCTION_NOT_FOUND


def nvml_const(mod: Any, name: str, default: int) -> int:
    return int(getattr(mod, name, default))


class MetricGroup:
    """One metric group: a callable filling a dict, dropped once it proves unsupported."""

    __slots__ = ("name", "fn", "failures")

    def __init__(self, name: str, fn: Callable[[dict[str, Any], float], None]) -> None:
        self.name = name
        self.fn = fn
        self.failures = 0


def run_groups(groups: list[MetricGroup], out: dict[str, Any], now: float, what: str) -> None:
    for g in list(groups):
        try:
            g.fn(out, now)
            g.failures = 0
        except Exception as e:
            g.failures += 1
            code = getattr(e, "value", None)
            permanent = (code in PERMANENT_NVML or isinstance(e, AttributeError | TypeError | NotImplementedError)
                         or g.failures >= 30)
            if permanent:
                groups.remove(g)
                log.debug("%s metric group %s off: %s: %s", what, g.name, type(e).__name__, e)


class Rate:
    """Per-second rates of monotonically increasing counters (None on the first call or a reset)."""

    __slots__ = ("_prev", "_t")

    def __init__(self) -> None:
        self._prev: tuple[float, ...] | None = None
        self._t = 0.0

    def update(self, now: float, values: tuple[float, ...]) -> tuple[float | None, ...]:
        prev, t0 = self._prev, self._t
        self._prev, self._t = values, now
        dt = now - t0
        if prev is None or dt <= 0 or len(prev) != len(values):
            return (None,) * len(values)
        return tuple(None if v < p else (v - p) / dt for v, p in zip(values, prev, strict=True))
