"""Alerts from diagnosis reports: abnormal workers found in a trace window.

One ``abnormal_worker`` incident per job: opened by a report that names abnormal workers,
updated (new version) by later reports that still name some, resolved by the first report that
names none. Pure state machine: reports in, :class:`~rankscope.protocol.alerts.Alert` objects out.
"""

from __future__ import annotations

from typing import Any

from rankscope.protocol.alerts import Alert

KIND = "abnormal_worker"


def _summary(report: dict[str, Any]) -> str:
    slow = report.get("slow_workers") or []
    ranks = ", ".join(str(s["rank"]) for s in slow)
    parts = [f"rank{'s' if len(slow) > 1 else ''} {ranks} abnormal in trace window {report.get('window_id', '?')}"]
    if slow:
        s = slow[0]
        parts.append(f"busy {s['busy_ms']:.1f} ms vs median {s['median_busy_ms']:.1f} ms")
        if s.get("held_back_by_host"):
            parts.append(f"held back by its host (waited for a CPU {100 * s['cpu_wait_share']:.0f}% of its ready time, "
                         f"peers {100 * s['peers_cpu_wait_share']:.0f}%)")
    causes = report.get("causes") or []
    if causes:
        c = causes[0]
        parts.append(f"top cause {c['leaf']} on rank {c['rank']} (+{c['excess_ms']:.1f} ms, "
                     f"{c['cost_rank_seconds']:.3f} rank-s)")
    return "; ".join(parts)


def _last_step(report: dict[str, Any]) -> int:
    steps = [s[1] for s in (report.get("steps") or {}).values() if isinstance(s, list | tuple) and len(s) == 2
             and isinstance(s[1], int)]
    return max(steps) if steps else 0


class ReportAlerts:
    """Per-job incident state for report findings (kept in memory by the processors)."""

    def __init__(self) -> None:
        self._open: dict[str, Alert] = {}

    def on_report(self, report: dict[str, Any], now_ns: int) -> list[Alert]:
        """The alerts (0 or 1) this report opens, updates or resolves."""
        job = str(report.get("job", ""))
        ranks = sorted(int(r) for r in report.get("abnormal_workers") or [])
        prev = self._open.get(job)
        if not ranks:
            if prev is None:
                return []
            del self._open[job]
            return [Alert(**{**_fields(prev), "status": "resolved", "version": prev.version + 1, "updated_ns": now_ns,
                             "resolved_ns": now_ns,
                             "summary": f"no abnormal worker in trace window {report.get('window_id', '?')}"})]
        details = {"window_id": report.get("window_id"), "slow_workers": report.get("slow_workers") or [],
                   "causes": (report.get("causes") or [])[:5],
                   "straggler": (report.get("collective_arrivals") or {}).get("straggler")}
        # Time lost in the window: every rank waits for each slow worker's excess busy time.
        world = int(report.get("world_size") or len(report.get("ranks") or []) or 1)
        lost = round(sum(max(0.0, float(s["busy_ms"]) - float(s["median_busy_ms"])) / 1e3 * world
                         for s in report.get("slow_workers") or []), 6)
        if prev is None:
            alert = Alert(alert_id=f"{job}:{KIND}:{report.get('window_id', now_ns)}", job=job, kind=KIND, status="open",
                          severity="warning", ranks=ranks, step=_last_step(report), opened_ns=now_ns,
                          updated_ns=now_ns, version=1, summary=_summary(report), lost_rank_seconds=lost,
                          details=details)
        else:
            alert = Alert(**{**_fields(prev), "status": "update", "version": prev.version + 1, "updated_ns": now_ns,
                             "ranks": ranks, "step": _last_step(report), "summary": _summary(report),
                             "lost_rank_seconds": round(prev.lost_rank_seconds + lost, 6), "details": details})
        self._open[job] = alert
        return [alert]


def _fields(a: Alert) -> dict[str, Any]:
    return {k: getattr(a, k) for k in a.__dataclass_fields__}
