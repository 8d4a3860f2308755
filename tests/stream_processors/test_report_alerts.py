"""Report findings -> abnormal_worker alerts (pure state machine)."""

from __future__ import annotations

from rankscope.protocol.alerts import Alert
from rankscope.stream_processors.report_alerts import ReportAlerts


def report(window: str, slow_ranks: list[int]) -> dict:
    slow = [{"rank": r, "busy_ms": 60.0, "median_busy_ms": 20.0, "z": 9.0} for r in slow_ranks]
    causes = [{"rank": r, "category": "python", "function": "main;slow_extra_compute", "leaf": "slow_extra_compute",
               "excess_ms": 40.0, "cost_rank_seconds": 0.16} for r in slow_ranks]
    return {"job": "j", "window_id": window, "ranks": [0, 1, 2, 3], "world_size": 4, "slow_workers": slow,
            "abnormal_workers": slow_ranks, "causes": causes, "steps": {"0": [10, 14], "1": [10, 14]},
            "collective_arrivals": {"straggler": slow_ranks[0] if slow_ranks else None}}


def test_open_update_resolve_and_json_roundtrip() -> None:
    ra = ReportAlerts()
    assert ra.on_report(report("w0", []), 1) == []                  # nothing found, nothing open
    [opened] = ra.on_report(report("w1", [1]), 2)
    assert (opened.kind, opened.status, opened.ranks, opened.step, opened.version) == ("abnormal_worker", "open", [1], 14, 1)
    assert "slow_extra_compute" in opened.summary and opened.lost_rank_seconds == 0.16   # (60-20) ms x 4 ranks
    assert Alert.from_json(opened.to_json()) == opened
    [upd] = ra.on_report(report("w2", [1, 2]), 3)
    assert (upd.alert_id, upd.status, upd.version, upd.ranks) == (opened.alert_id, "update", 2, [1, 2])
    assert upd.details["window_id"] == "w2" and upd.lost_rank_seconds == 0.16 + 0.32
    [res] = ra.on_report(report("w3", []), 4)
    assert (res.alert_id, res.status, res.version, res.resolved_ns) == (opened.alert_id, "resolved", 3, 4)
    assert ra.on_report(report("w4", []), 5) == []
