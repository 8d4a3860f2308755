"""A window's summary carries the training thread's CPU time and run-queue wait over the window."""

from __future__ import annotations

import time
from typing import Any

import pytest

from rankscope.producers import trace_window
from rankscope.producers.trace_window import ConvertedWindow, WindowController, window_thread_cpu


class _Profiler:
    def start(self) -> None: ...
    def step(self) -> None: ...
    def stop(self) -> None: ...


class _Raw:
    def without_threads(self, ids: set[int]) -> tuple[Any, int]:
        return self, 0


def test_window_thread_cpu_is_the_difference_of_the_counters() -> None:
    assert window_thread_cpu((100, 40), (350, 90)) == (250, 50)
    assert window_thread_cpu(None, (350, 90)) is None and window_thread_cpu((1, 1), None) is None
    assert window_thread_cpu((100, 40), (50, 90)) is None          # counters of another thread


@pytest.mark.parametrize("counters", [[(1_000, 500), (4_000, 1_700)], [None, None]])
def test_the_summary_holds_the_counters_of_the_window(monkeypatch: pytest.MonkeyPatch,
                                                      counters: list[tuple[int, int] | None]) -> None:
    reads = iter(counters)
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(trace_window, "convert_window", lambda raw, wid, first, budget, status, native=None:
                        ConvertedWindow([], {"events_total": 0, "first_step": first, "last_step": first + 1}, 0, 0))
    wc = WindowController(send_trace=lambda k, b: None, send_summary=lambda k, b: sent.append(b),
                          ack=lambda *a, **kw: None, byte_budget=1 << 20, wall_ns=time.time_ns,
                          profiler_factory=lambda req: _Profiler(), read_window=lambda prof: _Raw(),
                          thread_cpu=lambda: next(reads))
    wc.handle("trace", "r", {"steps": 2, "lead_ns": 0}, None, time.time_ns())
    for step in range(4):
        wc.on_step(step)
    wc.drain(10)
    assert len(sent) == 1
    if counters[0] is None:
        assert "thread_cpu" not in sent[0]
    else:
        assert sent[0]["thread_cpu"] == [3_000, 1_200]
