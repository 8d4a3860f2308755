"""The compact per-shard summary that the job-wide rules run on (wire kind ``shard``).

A shard is one partition of the steps topic. Every scan interval the worker that owns it sends,
per job with ranks on it, one summary: counts and histograms over all of the job's ranks there,
plus rows for at most a few hundred ranks that a rule may name (the longest without progress,
the lowest steps, the slowest, the silent, the crashed; every rank when there are few), and the
shard's first failures (ranks that exited with an exception or a signal), the first few with
their tracebacks, and the newest profile digests of ranks whose profile changed. Its size
is bounded whatever the job size (:data:`~rankscope.protocol.shard.MAX_SUMMARY_BYTES`); its fields and
bounds are declared in rankscope/protocol/shard.py, and :meth:`ShardSummary.from_body` checks a body
there (it raises :class:`~rankscope.protocol.errors.WireError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rankscope.protocol import shard as protocol
from rankscope.protocol.shard import MAX_SUMMARY_BYTES
from rankscope.stream_processors import profile_digest

HIST_BINS_PER_OCTAVE = 16


class Row(NamedTuple):
    rank: int
    host: str
    pid: int
    last_step: int
    last_step_end_ns: int
    hb_ns: int            # event time of the rank's latest message
    hb_since_s: float     # seconds since its last step, at that time
    step_med_ns: int
    busy_med_ns: int
    window_steps: int
    stack_sig: str        # "" when the heartbeat had no stacks
    waiting: int          # 1 waiting in a collective, 0 not, -1 no stacks
    exit_reason: str
    exit_detail: str
    dropped: int

    def progress_age_s(self, now_s: float, cap_s: float) -> float:
        return self.hb_since_s + min(max(0.0, now_s - self.hb_ns / 1e9), cap_s)


class Failure(NamedTuple):
    """A rank that exited with an exception or a signal: when, where, and (for the first few) how."""

    rank: int
    host: str
    pid: int
    exit_ns: int
    step: int
    reason: str
    exc_type: str
    detail: str
    frames: list[str]     # traceback, outermost first; [] past the first few failures of a shard


@dataclass
class StackInfo:
    count: int
    waiting: bool
    frames: list[str]
    sample: list[int]


@dataclass
class ShardSummary:
    shard: int
    ts_ns: int
    agg: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    stacks: dict[str, StackInfo] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)   # optional on the wire (absent: none)
    # rank -> (interval end, training-thread share per call path): stream_processors/profile_digest.py
    profiles: dict[int, tuple[int, dict[str, float]]] = field(default_factory=dict)   # optional on the wire

    def to_body(self) -> dict[str, Any]:
        body = {"shard": self.shard, "ts_ns": self.ts_ns, "agg": self.agg, "rows": [list(r) for r in self.rows],
                "stacks": {k: [v.count, v.waiting, v.frames, v.sample] for k, v in self.stacks.items()}}
        if self.failures:
            body["failures"] = [list(f) for f in self.failures]
        if self.profiles:
            body["profiles"] = profile_digest.pack(self.profiles, max_chars=MAX_SUMMARY_BYTES)[0]
        return body

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> ShardSummary:
        """The summary of a decoded ``shard`` body, checked whole (rankscope/protocol/shard.py)."""
        protocol.check_summary(body)
        stacks = {str(sig): StackInfo(count=raw[0], waiting=raw[1], frames=raw[2], sample=raw[3])
                  for sig, raw in body["stacks"].items()}
        failures = [Failure(*raw) for raw in body.get("failures", [])]
        profiles = profile_digest.unpack(body["profiles"]) if "profiles" in body else {}
        return cls(shard=body["shard"], ts_ns=body["ts_ns"], agg=body["agg"], rows=[Row(*raw) for raw in body["rows"]],
                   stacks=stacks, failures=failures, profiles=profiles)


def hist_bin(ns: float) -> int:
    """Log-spaced histogram bin of a positive duration (16 bins per doubling, about 4% wide)."""
    return int(math.floor(math.log2(max(ns, 1.0)) * HIST_BINS_PER_OCTAVE))


def bin_value(b: int) -> float:
    """The centre of bin ``b`` in ns."""
    return float(2 ** ((b + 0.5) / HIST_BINS_PER_OCTAVE))


def hist_add(into: dict[int, int], other: dict[Any, int]) -> None:
    for k, v in other.items():
        into[int(k)] = into.get(int(k), 0) + int(v)


def hist_quantile(hist: dict[int, int], q: float) -> float:
    """The ``q`` quantile (0..1) of a histogram, as a bin centre; 0 when empty."""
    total = sum(hist.values())
    if total <= 0:
        return 0.0
    target = q * (total - 1)
    seen = 0
    for b in sorted(hist):
        seen += hist[b]
        if seen > target:
            return bin_value(b)
    return bin_value(max(hist))


def hist_mad(hist: dict[int, int], center: float) -> float:
    """Median absolute deviation from ``center`` of the values a histogram holds (bin centres)."""
    pairs = sorted((abs(bin_value(b) - center), n) for b, n in hist.items())
    total = sum(n for _, n in pairs)
    if total == 0:
        return 0.0
    seen = 0
    for d, n in pairs:
        seen += n
        if seen > (total - 1) / 2:
            return d
    return pairs[-1][0]
