"""Who arrives last at each step's collective, and by how much: the slow-rank rule's evidence.

In synchronous training every rank waits at each step's collective for the last one to arrive, so
the job's time goes where the last arrival is: had that rank alone been as fast as the next one,
the step would have been shorter by the gap between the last and the second-to-last arrival (the
what-if saving the reports' ``collective_arrivals`` use). A rank's arrival at a step is the end of
its step minus the time it was blocked in collectives (``end_ns - comm_ns``: when it had finished
its own work). Unlike busy time, the arrival order does not depend on when each rank left the
previous collective, so the rank that holds the job back is found even where a rank's busy time
varies with its place in the collective (measured on 4 gloo ranks on 2 shared cores: identical
ranks' busy times differ 1.3-1.7x for whole runs, while a 1.5x straggler is last in 50-60% of the
steps and healthy ranks in 20-35%).

- Stage one (:class:`ShardArrivals`, one per shard of a job) keeps, per step, the latest and the
  second-latest arrival among the shard's ranks. A summary carries the newest ``ARRIVAL_STEPS``
  steps that every live rank of the shard has passed (in ``agg["arrivals"]``, rows of
  ``[step, arrival_ns, rank, gap_ns, dur_ns]``: the shard's last arrival, its gap to the shard's
  second (-1 when one rank), and the last rank's step time). Summaries repeat recent steps, so one
  that is lost or superseded costs nothing.
- Stage two (:class:`ArrivalLedger`, one per job) merges the shards' rows of a step once every shard
  with live ranks has passed it, and keeps the job's last ``LEDGER_STEPS`` complete steps.

Ranks on different hosts are compared across host clocks: a skew of a few ms shifts the gaps by
that much, small against the steps of a job whose ranks span hosts.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from rankscope.last_arrivals import Step, latest_horizon
from rankscope.protocol.envelope import Envelope
from rankscope.protocol.shard import MAX_ARRIVAL_ROWS

ARRIVAL_STEPS = 128        # passed steps per shard summary (about 3 KB)
MAX_PENDING_STEPS = MAX_ARRIVAL_ROWS   # steps a shard or the ledger holds while a rank lags behind
LEDGER_STEPS = 8192        # complete steps the ledger keeps


class ShardArrivals:
    """Stage one: the two latest arrivals of each recent step among one shard's ranks."""

    __slots__ = ("tops",)

    def __init__(self) -> None:
        self.tops: dict[int, list[int]] = {}   # step -> [arrival_ns, rank, dur_ns, second_arrival_ns]

    def add(self, env: Envelope, after_step: int) -> None:
        """Take the step records of a ``steps`` or ``beat`` message above ``after_step`` (the rank's
        last step before this message was folded: re-read records are not counted twice)."""
        if env.kind != "steps" and env.kind != "beat":   # a beat's body holds the same step columns
            return
        b = env.body
        for s, a, e, c in zip(b["step"], b["start_ns"], b["end_ns"], b["comm_ns"], strict=True):
            if s <= after_step:
                continue
            arrival, dur = e - max(0, c), max(0, e - a)
            t = self.tops.get(s)
            if t is None:
                self.tops[s] = [arrival, env.rank, dur, -1]
            elif arrival > t[0]:
                t[3], t[0], t[1], t[2] = t[0], arrival, env.rank, dur
            elif arrival > t[3]:
                t[3] = arrival
        if len(self.tops) > MAX_PENDING_STEPS:
            for s in sorted(self.tops)[: len(self.tops) - MAX_PENDING_STEPS]:
                del self.tops[s]

    def passed(self, min_step: int) -> list[list[int]]:
        """Rows of the newest ``ARRIVAL_STEPS`` steps at or below ``min_step`` (the lowest last step
        of the shard's live ranks), oldest first; older steps are forgotten."""
        if min_step < 0:
            return []
        for s in [s for s in self.tops if s <= min_step - ARRIVAL_STEPS]:
            del self.tops[s]
        out = []
        for s in sorted(s for s in self.tops if s <= min_step):
            a, r, d, a2 = self.tops[s]
            out.append([s, a, r, a - a2 if a2 >= 0 else -1, d])
        return out


class ArrivalLedger:
    """Stage two: the job's complete steps, from the shards' arrival rows."""

    def __init__(self) -> None:
        self.pending: dict[int, dict[int, tuple[int, int, int, int]]] = {}   # step -> shard -> row
        self.passed: dict[int, int] = {}                                    # shard -> highest step passed
        self.steps: deque[Step] = deque(maxlen=LEDGER_STEPS)
        self.last_complete = -1

    def add(self, shard: int, agg: dict[str, Any], rows: list[tuple[int, int, int, int, int]]) -> None:
        """Take one shard summary's rows (a row seen before is replaced by its newer copy)."""
        for s, a, r, gap, dur in rows:
            if s > self.last_complete:
                self.pending.setdefault(s, {})[shard] = (a, r, gap, dur)
        if agg.get("live", 0) and agg.get("min_step", -1) >= 0:
            self.passed[shard] = max(self.passed.get(shard, -1), int(agg["min_step"]))
        if len(self.pending) > MAX_PENDING_STEPS:
            for s in sorted(self.pending)[: len(self.pending) - MAX_PENDING_STEPS]:
                del self.pending[s]

    def complete(self, shards: list[int]) -> list[Step]:
        """Close, oldest first, the pending steps that every one of ``shards`` (those with live
        ranks) has passed; return the steps closed now."""
        if not shards:
            return []
        upto = min(self.passed.get(sh, -1) for sh in shards)
        out = []
        for s in sorted(s for s in self.pending if s <= upto):
            rows = sorted(self.pending.pop(s).values(), reverse=True)
            a, r, gap, dur = rows[0]
            second = max(a - gap if gap >= 0 else -1, rows[1][0] if len(rows) > 1 else -1)
            self.last_complete = s
            if second < 0:
                continue          # one rank only: no one to compare with
            step = Step(s, r, max(0, a - second), dur, a)
            self.steps.append(step)
            out.append(step)
        return out

    def horizon(self, min_s: float, min_steps: int) -> list[Step]:
        """The newest complete steps that span at least ``min_s`` seconds and ``min_steps`` steps;
        empty while the ledger holds less."""
        return latest_horizon(self.steps, min_s, min_steps)
