"""Stage one of the processors: the ranks of one job on one partition of the steps topic.

A :class:`ShardJob` folds its ranks' messages (:func:`~rankscope.stream_processors.rank_state.fold`) and,
every scan interval, condenses them into a bounded :class:`~rankscope.stream_processors.shard_summary.ShardSummary`
for the job-wide rules (stream_processors/monitor.py) and into rolling per-rank statistics.
Everything is synchronous and driven by ``now_s``, so tests replay scenarios without Kafka.
"""

from __future__ import annotations

import heapq
from typing import Any

from rankscope.config import Settings
from rankscope.protocol.envelope import Envelope
from rankscope.protocol.shard import CPU_WAIT_BIN, MAX_CPU_WAIT_TOP, MAX_SUMMARY_BYTES
from rankscope.rank_states import DEAD, RUNNING, WAITING, exited_state
from rankscope.stream_processors import profile_digest
from rankscope.stream_processors.analysis.outliers import peer_z
from rankscope.stream_processors.arrivals import ShardArrivals
from rankscope.stream_processors.collective_arrivals import ShardCollectives
from rankscope.stream_processors.rank_state import RankState, fold
from rankscope.stream_processors.shard_summary import (
    Failure,
    Row,
    ShardSummary,
    StackInfo,
    hist_bin,
)
from rankscope.stream_processors.stacks import main_stack, signature, waiting_in_collective

ALL_ROWS_UP_TO = 128       # a shard with this many ranks or fewer sends a row for every rank
ROWS_PER_REASON = 32       # otherwise this many per reason a rule may name a rank
MAX_STACKS = 6
MAX_FRAMES = 24
MAX_FRAME_CHARS = 200
MAX_DETAIL_CHARS = 300
STACK_SAMPLE = 8
MAX_FAILURES = 32          # failures sent per shard, first to fail first
FAILURES_WITH_FRAMES = 2   # ... of which this many carry their traceback
STATS_ROWS_PER_MESSAGE = 250


class ShardJob:
    """The ranks of ``job`` whose messages arrive on steps partition ``shard``."""

    def __init__(self, job: str, shard: int) -> None:
        self.job = job
        self.shard = shard
        self.ranks: dict[int, RankState] = {}
        self.world_size = 0
        self.last_input_s = 0.0
        self.new_steps = 0
        self.arrivals = ShardArrivals()
        self.collectives = ShardCollectives()
        self.profiles: dict[int, tuple[int, profile_digest.Shares]] = {}   # rank -> newest digest
        self.profiles_unsent: set[int] = set()

    def add_profile(self, rank: int, t1_ns: int, shares: profile_digest.Shares) -> None:
        """A rank's newest profile digest (an older interval arriving late is ignored)."""
        cur = self.profiles.get(rank)
        if cur is not None and cur[0] >= t1_ns:
            return
        self.profiles[rank] = (t1_ns, shares)
        self.profiles_unsent.add(rank)

    def apply(self, env: Envelope, now_s: float, settings: Settings) -> None:
        st = self.ranks.get(env.rank)
        if st is None:
            st = self.ranks[env.rank] = RankState(rank=env.rank)
        before = st.last_step
        new = fold(st, env, now_s, settings.straggler_window)
        if new:
            self.arrivals.add(env, before)
        if env.kind == "beat" and "coll" in env.body:
            self.collectives.add(env)
        self.new_steps += new
        ws = env.body.get("world_size", 0) if env.kind in ("heartbeat", "beat") else 0
        if ws > 0:
            self.world_size = ws
        self.last_input_s = max(self.last_input_s, now_s)

    # Summary ----------------------------------------------------------------------------------
    def silent(self, now_s: float, settings: Settings, frontier_s: float | None = None) -> list[RankState]:
        """Live ranks whose messages stopped for ``dead_after_s`` while others here went on (or
        the whole shard went silent for 3x that), oldest first.

        Silence is judged at ``frontier_s``, the send time up to which this shard's partition has
        been read (``now_s`` when it is caught up): a partition read late makes its ranks look
        older, not silent."""
        live = [st for st in self.ranks.values() if not st.exit_reason]
        if not live:
            return []
        at = now_s if frontier_s is None else min(now_s, frontier_s)
        newest = max(st.hb_s for st in self.ranks.values())
        all_silent = at - newest > 3 * settings.dead_after_s
        out = [st for st in live if at - st.hb_s > settings.dead_after_s
               and (newest - st.hb_s > settings.dead_after_s or all_silent)]
        return sorted(out, key=lambda s: s.hb_s)

    def summary(self, now_s: float, settings: Settings, retired: bool = False,
                frontier_s: float | None = None) -> ShardSummary:
        """The bounded summary of this shard at ``now_s`` (encoded size under MAX_SUMMARY_BYTES);
        ``frontier_s`` as in :meth:`silent`, also sent (``agg["frontier_ns"]``) for the job-wide rules."""
        frontier_s = now_s if frontier_s is None else min(now_s, frontier_s)
        silent = self.silent(now_s, settings, frontier_s)
        silent_ids = {st.rank for st in silent}
        live = [st for st in self.ranks.values() if not st.exit_reason and st.rank not in silent_ids]
        crashed = [st for st in self.ranks.values() if st.crashed]
        step_hist: dict[int, int] = {}
        busy_hist: dict[int, int] = {}
        busy_n = 0
        for st in self.ranks.values():
            step_med, busy_med, _ = st.medians()
            if step_med > 0 and not st.exit_reason:
                b = hist_bin(step_med)
                step_hist[b] = step_hist.get(b, 0) + 1
            if len(st.busy) >= settings.straggler_min_steps and not st.exit_reason and st.rank not in silent_ids:
                b = hist_bin(max(busy_med, 1))
                busy_hist[b] = busy_hist.get(b, 0) + 1
                busy_n += 1
        top = max(live, key=lambda s: (s.last_step, s.last_step_end_ns), default=None)
        agg = {
            "ranks": len(self.ranks), "live": len(live), "exited": sum(1 for s in self.ranks.values() if s.exit_reason),
            "crashed": len(crashed), "silent": len(silent), "world_size": self.world_size,
            "min_step": min((s.last_step for s in live), default=-1),
            "max_step": top.last_step if top else -1, "max_step_end_ns": top.last_step_end_ns if top else 0,
            "max_step_med_ns": top.medians()[0] if top else 0,
            "newest_hb_ns": int(max((s.hb_s for s in self.ranks.values()), default=0.0) * 1e9),
            "frontier_ns": int(frontier_s * 1e9),
            "min_age_s": round(min((s.progress_age_s(now_s) for s in live), default=-1.0), 3),
            "step_hist": step_hist, "busy_hist": busy_hist, "busy_n": busy_n,
            "new_steps": self.new_steps, "retired": int(retired),
            "arrivals": self.arrivals.passed(min((s.last_step for s in live), default=-1)),
        }
        cpu = self._cpu_wait(live)
        if cpu is not None:
            agg["cpu_wait"] = cpu
        if self.collectives.groups:
            self.collectives.forget({st.rank for st in self.ranks.values() if st.exit_reason} | silent_ids)
            agg["coll"] = self.collectives.summary()
        self.new_steps = 0
        chosen = self._rows_to_send(live, silent, crashed, now_s, settings)
        stacks = self._stack_groups()
        rows = [self._row(st) for st in chosen]
        summary = ShardSummary(shard=self.shard, ts_ns=int(now_s * 1e9), agg=agg, rows=rows, stacks=stacks,
                               failures=self._failures(crashed))
        if self.profiles_unsent:
            _, sent = profile_digest.pack({r: self.profiles[r] for r in sorted(self.profiles_unsent)})
            summary.profiles = {r: self.profiles[r] for r in sent}
            self.profiles_unsent.difference_update(sent)
        return _within_bound(summary)

    @staticmethod
    def _cpu_wait(live: list[RankState]) -> dict[str, Any] | None:
        """The live ranks' wait shares (of their ready time): a histogram and the ranks that waited most."""
        shares = [(st.rank, *pm) for st in live if (pm := st.cpu_wait_pm) is not None]
        if not shares:
            return None
        hist: dict[int, int] = {}
        for _, wait, _ in shares:
            hist[wait // CPU_WAIT_BIN] = hist.get(wait // CPU_WAIT_BIN, 0) + 1
        top = heapq.nlargest(MAX_CPU_WAIT_TOP, shares, key=lambda x: (x[1], -x[0]))
        return {"hist": hist, "top": [list(t) for t in top]}

    @staticmethod
    def _failures(crashed: list[RankState]) -> list[Failure]:
        first = heapq.nsmallest(MAX_FAILURES, crashed, key=lambda s: (s.exit_ns, s.rank))
        return [Failure(rank=st.rank, host=st.host, pid=st.pid, exit_ns=st.exit_ns, step=st.last_step,
                        reason=st.exit_reason, exc_type=st.exc_type[:MAX_FRAME_CHARS],
                        detail=st.exit_detail[:MAX_DETAIL_CHARS],
                        frames=[f[:MAX_FRAME_CHARS] for f in st.exc_frames[-MAX_FRAMES:]] if i < FAILURES_WITH_FRAMES
                        else [])
                for i, st in enumerate(first)]

    def _rows_to_send(self, live: list[RankState], silent: list[RankState], crashed: list[RankState],
                      now_s: float, settings: Settings) -> list[RankState]:
        if len(self.ranks) <= ALL_ROWS_UP_TO:
            return sorted(self.ranks.values(), key=lambda s: s.rank)
        k = ROWS_PER_REASON
        picked: dict[int, RankState] = {}
        for group in (
            heapq.nlargest(k, live, key=lambda s: s.progress_age_s(now_s)),                   # longest without a step
            heapq.nsmallest(k, live, key=lambda s: s.last_step),                    # lowest steps
            heapq.nlargest(k, (s for s in live if len(s.busy) >= settings.straggler_min_steps),
                           key=lambda s: s.medians()[1]),                           # slowest
            [s for s in live if s.stacks and not waiting_in_collective(main_stack(s.stacks))][:k],  # stuck elsewhere
            silent[:k],                                                              # first to go silent
            sorted(crashed, key=lambda s: s.hb_s)[:k],                               # first to fail
        ):
            for st in group:
                picked[st.rank] = st
        return sorted(picked.values(), key=lambda s: s.rank)

    def _stack_groups(self) -> dict[str, StackInfo]:
        groups: dict[str, StackInfo] = {}
        for st in self.ranks.values():
            if st.exit_reason or not st.stacks:
                continue
            frames = main_stack(st.stacks)
            if not frames:
                continue
            sig = signature(frames)
            g = groups.get(sig)
            if g is None:
                g = groups[sig] = StackInfo(count=0, waiting=waiting_in_collective(frames),
                                            frames=[f[:MAX_FRAME_CHARS] for f in frames[-MAX_FRAMES:]], sample=[])
            g.count += 1
            if len(g.sample) < STACK_SAMPLE:
                g.sample.append(st.rank)
        # The stacks that are not waiting in a collective name culprits: keep them first.
        keep = sorted(groups.items(), key=lambda kv: (kv[1].waiting, -kv[1].count))[:MAX_STACKS]
        return dict(keep)

    @staticmethod
    def _row(st: RankState) -> Row:
        step_med, busy_med, _ = st.medians()
        frames = main_stack(st.stacks)
        return Row(rank=st.rank, host=st.host, pid=st.pid, last_step=st.last_step,
                   last_step_end_ns=st.last_step_end_ns, hb_ns=int(st.hb_s * 1e9), hb_since_s=st.hb_since_s,
                   step_med_ns=step_med, busy_med_ns=busy_med, window_steps=len(st.durations),
                   stack_sig=signature(frames) if frames else "",
                   waiting=(1 if waiting_in_collective(frames) else 0) if frames else -1,
                   exit_reason=st.exit_reason, exit_detail=st.exit_detail[:MAX_DETAIL_CHARS], dropped=st.dropped)

    # Rolling statistics -----------------------------------------------------------------------
    def stats_chunks(self, now_s: float, settings: Settings,
                     frontier_s: float | None = None) -> list[list[dict[str, Any]]]:
        """Per-rank rolling statistics with the rank's state as this shard sees it, in chunks."""
        silent = {st.rank for st in self.silent(now_s, settings, frontier_s)}
        ts_ns = int(now_s * 1e9)
        z_of = busy_z_scores({r: st.medians()[1] for r, st in self.ranks.items()
                              if not st.exit_reason and len(st.busy) >= settings.straggler_min_steps})
        rows = []
        for r, st in sorted(self.ranks.items()):
            step_med, busy_med, comm_med = st.medians()
            durs = sorted(st.durations)
            if st.exit_reason:
                state = exited_state(st.exit_reason)
            elif r in silent:
                state = DEAD
            elif st.progress_age_s(now_s) > settings.hang_min_s:
                state = WAITING      # stage one cannot tell the hang's culprit from the ranks it blocks
            else:
                state = RUNNING
            row = {"rank": r, "ts_ns": ts_ns, "step": st.last_step, "window_steps": len(durs),
                   "median_step_ns": step_med,
                   "p95_step_ns": durs[min(len(durs) - 1, int(0.95 * len(durs)))] if durs else 0,
                   "median_busy_ns": busy_med, "median_comm_ns": comm_med, "busy_z": round(z_of.get(r, 0.0), 3),
                   "step_end_ns": st.last_step_end_ns,
                   "state": state}
            if (pm := st.cpu_wait_pm) is not None:
                row["cpu_wait"] = pm[0] / 1000
            rows.append(row)
        return [rows[i:i + STATS_ROWS_PER_MESSAGE] for i in range(0, len(rows), STATS_ROWS_PER_MESSAGE)]


def busy_z_scores(busy: dict[int, int]) -> dict[int, float]:
    """Robust z of each rank's median busy time against this shard's other ranks
    (:func:`~rankscope.stream_processors.analysis.outliers.peer_z`, the report's and the slow-rank
    rule's statistic); empty below 3 ranks. Ranks spread over shards by rank, so a shard's ranks are
    a sample of the job's; the slow-rank rule itself judges against the whole job (monitor.py)."""
    if len(busy) < 3:
        return {}
    return {r: pz.z for r, pz in peer_z({r: float(v) for r, v in busy.items()}).items()}


def _within_bound(summary: ShardSummary) -> ShardSummary:
    """Drop profile digests, then stacks, then failures past the first, then rows, until the encoded
    summary fits MAX_SUMMARY_BYTES."""
    import msgpack

    while len(msgpack.packb(summary.to_body(), use_bin_type=True)) > MAX_SUMMARY_BYTES - 1000:
        if summary.profiles:
            summary.profiles = {}
        elif summary.stacks:
            summary.stacks = dict(list(summary.stacks.items())[:-1])
        elif len(summary.failures) > 1:
            summary.failures = summary.failures[: len(summary.failures) // 2]
        elif summary.rows:
            summary.rows = summary.rows[: len(summary.rows) // 2]
        else:
            break
    return summary

