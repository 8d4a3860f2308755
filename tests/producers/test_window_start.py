"""Where a window starts: at the request's start step on every rank, else by wall-clock time."""

from __future__ import annotations

from typing import Any

import pytest

from rankscope.producers.control import ControlError
from rankscope.producers.trace_window import WindowController
from rankscope.protocol.trace import START_STEP_MAX_WAIT_NS, parse_command
from rankscope.trace_start import plan_start_step, steps_per_period


class _FakeProfiler:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self) -> None:
        self.calls.append("start")

    def step(self) -> None:
        self.calls.append("step")

    def stop(self) -> None:
        self.calls.append("stop")


def _controller(now: list[int]) -> tuple[WindowController, list[int], list[tuple[Any, ...]]]:
    begun: list[int] = []
    acks: list[tuple[Any, ...]] = []
    wc = WindowController(send_trace=lambda k, b: None, send_summary=lambda k, b: None,
                          ack=lambda *a, **kw: acks.append(a), byte_budget=1 << 20, wall_ns=lambda: now[0],
                          profiler_factory=lambda req: _FakeProfiler())
    orig = wc._begin

    def begin(req: Any, first_step: int, t: int) -> None:
        begun.append(first_step)
        orig(req, first_step, t)

    wc._begin = begin  # type: ignore[method-assign]
    wc._finish = lambda act, step: None  # type: ignore[method-assign]  (no sending in these tests)
    return wc, begun, acks


def test_a_start_step_wins_over_the_clock() -> None:
    now = [1_000]
    wc, begun, acks = _controller(now)
    wc.handle("trace", "r", {"steps": 2, "start_step": 50, "lead_ns": 0}, None, now[0])
    assert "from step 50" in acks[-1][2]
    for step in range(40, 49):          # the time has come, the step has not
        now[0] += 10**6
        wc.on_step(step)
    assert begun == []
    wc.on_step(49)                      # the boundary before step 50
    assert begun == [50]


def test_a_start_step_already_passed_starts_at_the_next_boundary(caplog: pytest.LogCaptureFixture) -> None:
    now = [1_000]
    wc, begun, _ = _controller(now)
    wc.handle("trace", "r", {"steps": 2, "start_step": 5, "lead_ns": 0}, None, now[0])
    with caplog.at_level("WARNING", logger="rankscope.trace"):
        wc.on_step(70)
    assert begun == [71]
    assert "starts at step 71, 66 after its planned start step 5" in caplog.text


def test_a_start_step_that_never_comes_gives_way_to_the_clock() -> None:
    now = [1_000]
    wc, begun, _ = _controller(now)
    wc.handle("trace", "r", {"steps": 2, "start_step": 10**9, "lead_ns": 0}, None, now[0])
    wc.on_step(3)
    assert begun == []
    now[0] += START_STEP_MAX_WAIT_NS
    wc.on_step(4)
    assert begun == [5]


def test_without_a_start_step_the_clock_decides() -> None:
    now = [1_000]
    wc, begun, _ = _controller(now)
    wc.handle("trace", "r", {"steps": 2, "lead_ns": 500}, None, now[0])
    wc.on_step(3)
    assert begun == []
    now[0] += 500
    wc.on_step(4)
    assert begun == [5]


@pytest.mark.parametrize("bad", [-1, "7", 1.5e30, True])
def test_bad_start_steps_are_rejected(bad: Any) -> None:
    with pytest.raises(ControlError, match="start_step"):
        parse_command("r", {"steps": 2, "start_step": bad}, None, 0)


def test_the_cli_extrapolates_the_furthest_rank() -> None:
    ms = 10**6
    rows = [{"rank": 0, "step": 100, "ts_ns": 1_000 * ms, "median_step_ns": 10 * ms},
            {"rank": 1, "step": 98, "ts_ns": 1_000 * ms, "median_step_ns": 10 * ms}]
    # 500 ms since the stats plus a 1 s lead at 10 ms per step: 150 steps past step 100, plus 1, plus the margin.
    assert plan_start_step(rows, 1_500 * ms, 1_000 * ms, margin_steps=2, faster=1.0) == 100 + 1 + 150 + 2
    # By default as if the steps ran 1.5x faster than their median: 225 steps.
    assert plan_start_step(rows, 1_500 * ms, 1_000 * ms, margin_steps=2) == 100 + 1 + 225 + 2
    assert plan_start_step([{"rank": 0, "step": 5, "ts_ns": 0, "median_step_ns": 0}], 0, 0) == 0    # no step time yet
    assert plan_start_step([{"rank": 0}], 0, 0) == 0
    assert plan_start_step([], 0, 0) == 0


def test_a_plan_from_stale_stats_and_a_warm_up_median_stays_ahead_of_the_ranks() -> None:
    ms = 10**6
    # The stats saw step 100 end 6 s ago; its median (15 ms) still holds slow first steps, while
    # the rank now steps every 10 ms, so it reaches step 800 a second from now, when the request arrives.
    rows = [{"rank": 0, "step": 100, "ts_ns": 0, "median_step_ns": 15 * ms}]
    reached = 100 + (6_000 + 1_000) // 10
    assert plan_start_step(rows, 6_000 * ms, 3_000 * ms, faster=1.0) < reached       # extrapolating at the median misses
    assert plan_start_step(rows, 6_000 * ms, 3_000 * ms) > reached


def test_a_periodic_schedule_starts_at_its_start_step_too() -> None:
    now = [1_000]
    wc, begun, _ = _controller(now)
    wc.handle("trace", "r", {"steps": 2, "every_s": 600, "start_step": 20, "lead_ns": 10**12}, None, now[0])
    wc.on_step(18)
    assert begun == []
    wc.on_step(19)                      # long before the lead time: the step decides
    assert begun == [20]


def test_a_period_in_time_becomes_a_period_in_steps() -> None:
    ms = 10**6
    rows = [{"rank": r, "step": 100, "ts_ns": 0, "median_step_ns": t * ms} for r, t in enumerate((10, 12, 50))]
    assert steps_per_period(rows, 60.0, 3) == 5000          # 60 s at the median 12 ms per step
    assert steps_per_period(rows, 0.01, 3) == 3             # never shorter than the window
    assert steps_per_period([{"rank": 0, "median_step_ns": 0}], 60.0, 3) == 0    # no step time yet
    assert steps_per_period([], 60.0, 3) == 0


def test_the_cli_sends_a_time_period_as_steps_when_it_can() -> None:
    from rankscope.protocol.envelope import decode
    from rankscope.trace_request import Plan, TraceRequest, encode_request

    req = TraceRequest(job="job", mode="every_s", every_s=600.0, request_id="r")
    body = decode(encode_request(req, Plan(start_step=50, period_steps=40_000))).body
    assert body["args"]["every_steps"] == 40_000 and "every_s" not in body["args"]
    body = decode(encode_request(req)).body     # no step time known: by the clock
    assert body["args"]["every_s"] == 600.0 and "every_steps" not in body["args"]


def test_every_rank_opens_the_later_windows_of_a_step_period_at_the_same_steps() -> None:
    starts = []
    for offset_ns in (0, 7 * 10**6):         # two ranks whose clocks and step times differ
        now = [1_000 + offset_ns]
        wc, begun, _ = _controller(now)
        wc.handle("trace", "r", {"steps": 2, "every_steps": 10, "start_step": 20, "lead_ns": 0}, None, now[0])
        for step in range(15, 60):
            now[0] += 9 * 10**6 if offset_ns else 11 * 10**6
            wc.on_step(step)
            if wc._active is not None:      # the window runs its 2 steps (sending is not part of this test)
                wc._active = None
                wc._rearm()
        starts.append(begun)
    assert starts[0] == starts[1] == [20, 30, 40, 50, 60]


def test_the_plan_extrapolates_from_when_the_step_ended_not_when_it_was_reported() -> None:
    from rankscope.trace_start import plan_start_step

    now = 10**18
    seen_late = {"rank": 0, "step": 100, "ts_ns": now, "median_step_ns": 100_000_000}
    assert plan_start_step([seen_late], now, 0) == 103
    # The stats were sent 2 s after that step ended: the rank is 20 steps further by now (30 at 1.5x).
    ended = {**seen_late, "step_end_ns": now - 2 * 10**9}
    assert plan_start_step([ended], now, 0, faster=1.0) == 123
    assert plan_start_step([ended], now, 0) == 133
