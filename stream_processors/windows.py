"""Collects the per-rank summaries of each trace window until every expected rank has reported
(or a deadline passes, naming the missing ranks), then builds the diagnosis report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from rankscope.protocol.envelope import Envelope
from rankscope.stream_processors.analysis.diagnosis import report_from_frames
from rankscope.stream_processors.analysis.summaries import summary_frames

MAX_OPEN_WINDOWS = 256


@dataclass
class _Window:
    first_seen: float
    frames: dict[int, pd.DataFrame] = field(default_factory=dict)
    arrivals: dict[int, pd.DataFrame] = field(default_factory=dict)
    request_ranks: list[int] | None = None
    meta: dict[int, dict[str, Any]] = field(default_factory=dict)


class WindowCollector:
    def __init__(self) -> None:
        self._open: dict[tuple[str, str], _Window] = {}
        self._done: set[tuple[str, str]] = set()

    def add(self, env: Envelope, now: float) -> tuple[str, str]:
        """Fold one ``summary`` message in; returns its (job, window_id). Raises ValueError on bad bodies."""
        b = env.body
        key = (env.job, b["window_id"])
        if key in self._done:
            return key
        win = self._open.get(key)
        if win is None:
            if len(self._open) >= MAX_OPEN_WINDOWS:  # bounded: the oldest window is dropped
                self._open.pop(next(iter(self._open)))
            win = self._open[key] = _Window(first_seen=now)
        fn, arrivals = summary_frames(env.rank, b)      # raises ValueError on a malformed table
        win.frames[env.rank] = fn
        if arrivals is not None:
            win.arrivals[env.rank] = arrivals
        if isinstance(b.get("request_ranks"), list):
            win.request_ranks = [int(r) for r in b["request_ranks"]]
        win.meta[env.rank] = {k: b.get(k) for k in ("first_step", "last_step", "truncated", "events_total")}
        return key

    def complete(self, key: tuple[str, str], job_ranks: list[int] | None) -> bool:
        """True when every expected rank (``job_ranks``: the job's running ranks, when known) sent its summary."""
        win = self._open.get(key)
        if win is None:
            return False
        exp = self.expected_from(win, job_ranks)
        return bool(exp) and set(exp or ()) <= set(win.frames)

    def overdue(self, now: float, deadline_s: float) -> list[tuple[str, str]]:
        return [k for k, w in self._open.items() if now - w.first_seen >= deadline_s]

    def build(self, job: str, window_id: str, job_ranks: list[int] | None, world_size: int | None) -> dict[str, Any] | None:
        key = (job, window_id)
        win = self._open.pop(key, None)
        if win is None:
            return None
        self._done.add(key)
        exp = self.expected_from(win, job_ranks)
        report = report_from_frames(win.frames, win.arrivals, job=job, window_id=window_id, world_size=world_size,
                                    expected_ranks=exp)
        report["steps"] = {str(r): [m.get("first_step"), m.get("last_step")] for r, m in sorted(win.meta.items())}
        report["truncated_ranks"] = sorted(r for r, m in win.meta.items() if m.get("truncated"))
        report["schema_version"] = 1
        report["created_ns"] = time.time_ns()
        return report

    @staticmethod
    def expected_from(win: _Window, job_ranks: list[int] | None) -> list[int] | None:
        return win.request_ranks if win.request_ranks is not None else job_ranks
