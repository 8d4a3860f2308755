"""The slow-rank rule: a rank that holds the whole job back, for long enough and at enough cost.

Evidence: the job's complete steps (:class:`~rankscope.stream_processors.arrivals.ArrivalLedger`): per step,
the rank that arrived last at the collective and its lead over the second-to-last. The rule judges
the *horizon*, the newest complete steps spanning at least ``straggler_min_s`` seconds and
``straggler_min_slow_steps`` steps (event time, from the ranks' own step times), and for each rank:

- its last share: the share of the horizon's steps at which it arrived last;
- its cost share: its leads summed over the steps it was last, over the steps' summed time. Every
  rank waits that long, so this is the share of the job's rank-time the straggler costs.

A rank is *slow* while its last share is at least ``enter_share(n)`` (0.45; 1.5/n for n < 4 ranks):
shown as slow (:attr:`SlowRule.watch`, the monitor's rank states) whatever it costs. It is *alerted*
once it has been slow and cost at least ``straggler_cost_gate`` at every evaluation for
``straggler_persist`` evaluations and half of ``straggler_min_s`` (measured on 4 gloo ranks on 2
cores under heavy load: a healthy rank's share reached 0.47 over 10 s, for at most 1 s; a 1.5x
straggler's stayed at 0.41-0.6 for whole runs). It leaves after ``straggler_persist`` evaluations
in a row where its share fell below ``enter_share - 0.1`` or its cost below half the gate
(hysteresis both ways: one incident per straggler), or at once when it stops stepping by itself (hung outside a collective, dead,
exited). A slow rank waiting in a collective for a hung peer stays. Evaluated whenever
``straggler_window / 4`` more steps are complete; needs at least 3 ranks.

Lost rank-seconds: the leads of the named ranks at the steps they were last, times the world size,
summed while the incident is open. Busy times (step time minus collective wait) are reported in
the alert's details as evidence; they do not decide, because a rank's busy time also depends on
when it left the previous collective (see stream_processors/arrivals.py). So are the slow ranks'
run-queue waits against their peers' (stream_processors/cpu_wait.py): a slow rank starved of CPU
by its host is said so in the summary.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rankscope.config import Settings
from rankscope.last_arrivals import Step, enter_share, horizon_stats, latest_horizon
from rankscope.protocol.alerts import MAX_DETAIL_RANKS, MAX_RANKS, Alert
from rankscope.protocol.shard import arrival_rows, coll_groups, cpu_wait
from rankscope.stream_processors import cpu_wait as cpu_evidence
from rankscope.stream_processors import profile_digest
from rankscope.stream_processors.analysis.outliers import flag_slow
from rankscope.stream_processors.arrivals import ArrivalLedger
from rankscope.stream_processors.collective_arrivals import CollectiveLedger
from rankscope.stream_processors.job_view import JobView
from rankscope.stream_processors.shard_summary import ShardSummary, hist_quantile

if TYPE_CHECKING:
    from rankscope.stream_processors.monitor import JobMonitor

STEPS = "steps"             # the evidence source of host-side step records
MAX_GROUPS = 64             # process groups judged per job
COLLECTIVE_EVIDENCE = ("arrival at each collective of the process group, from every rank's Flight Recorder "
                       "(device durations where timed, else when the rank issued it); the last rank's lead "
                       "over the second-to-last is what every member waits for it")
PERSIST_FRACTION = 0.5      # slow and costly for this fraction of straggler_min_s before it is alerted
LEAVE_SHARE_DROP = 0.10     # a named rank leaves below enter_share minus this ...
LEAVE_COST_FRACTION = 0.5   # ... or below this fraction of the cost gate


@dataclass
class SlowRule:
    ledger: ArrivalLedger = field(default_factory=ArrivalLedger)
    enter_evals: dict[int, int] = field(default_factory=dict)   # rank -> evaluations in a row slow and costly
    costly_since_ns: dict[int, int] = field(default_factory=dict)   # ... since this step's arrival (event time)
    leave_evals: dict[int, int] = field(default_factory=dict)   # named rank -> evaluations in a row not
    watch: dict[int, dict[str, float]] = field(default_factory=dict)   # slow ranks, alerted or not
    lost_rank_seconds: float = 0.0

    groups: dict[str, CollectiveLedger] = field(default_factory=dict)   # process group -> its collectives
    evaluated: dict[str, int] = field(default_factory=dict)             # source -> newest item judged
    source: str = "steps"       # the evidence of the last evaluation: STEPS or a process group

    def add(self, summary: ShardSummary) -> None:
        """Take a shard summary's arrival rows and collective rows. Raises WireError when malformed."""
        cpu_wait(summary.agg)   # checked here; read at evaluation from the monitor's summaries
        self.ledger.add(summary.shard, summary.agg, arrival_rows(summary.agg))
        for pg, g in coll_groups(summary.agg).items():
            led = self.groups.get(pg)
            if led is None:
                if len(self.groups) >= MAX_GROUPS:
                    continue
                led = self.groups[pg] = CollectiveLedger(pg)
            led.add(summary.shard, g)

    def _sources(self) -> dict[str, deque[Step]]:
        return {STEPS: self.ledger.steps, **{pg: led.steps for pg, led in self.groups.items()}}

    def _progressed(self, settings: Settings) -> bool:
        """True when some evidence holds ``straggler_window / 4`` new items since it was last judged."""
        every = max(1, settings.straggler_window // 4)
        grown = False
        for name, steps in self._sources().items():
            if steps and steps[-1].step >= self.evaluated.get(name, -1) + every:
                self.evaluated[name] = steps[-1].step
                grown = True
        return grown

    def _choose_source(self, settings: Settings, n: int) -> tuple[str, list[Step]]:
        """The evidence to judge: of the steps and each group's collectives, the one where a slow
        rank costs the most (a device's lateness shows only in its collectives where collectives do
        not block; a host's shows in both). Steps when no evidence shows a slow rank."""
        best: tuple[float, str, list[Step]] = (-1.0, STEPS, [])
        for name, steps in self._sources().items():
            horizon = latest_horizon(steps, settings.straggler_min_s, settings.straggler_min_slow_steps)
            if not horizon:
                continue
            slow_costs = [co for sh, co in horizon_stats(horizon).values() if sh >= enter_share(n)]
            score = max(slow_costs, default=0.0) + (1e-9 if name == self.source else 0.0)
            if score > best[0]:
                best = (score, name, horizon)
        return best[1], best[2]

    @staticmethod
    def stepping(mon: JobMonitor, view: JobView, now_s: float, settings: Settings, dead: set[int]) -> dict[int, float]:
        """Median busy time of the ranks that step. Left out: exited and dead ranks, and ranks stalled
        past the hang threshold other than in a collective (a rank stopped by its peers' hang is
        still as slow as it was; one stopped by itself is not a straggler)."""
        thr = mon.hang_threshold_s(view, settings)
        return {r.rank: float(r.busy_med_ns) for r in view.rows.values()
                if not r.exit_reason and r.rank not in dead and r.window_steps >= settings.straggler_min_steps
                and (r.waiting == 1 or view.age(r, now_s) <= thr)}

    def evaluate(self, mon: JobMonitor, view: JobView, now_s: float, settings: Settings,
                 dead: set[int]) -> list[Alert]:
        active = [sh for sh, s in mon.shards.items() if s.agg["live"]]
        closed = {STEPS: self.ledger.complete(active)}
        for pg, led in self.groups.items():
            closed[pg] = led.complete([sh for sh in active if mon.shards[sh].agg.get("coll", {}).get(pg, {}).get("members")])
        cur = mon.incidents.get("slow_rank")
        named = set(cur["ranks"]) if cur else set()
        world = max(view.world_size, view.ranks)
        self.lost_rank_seconds += sum(s.saving_ns for s in closed.get(self.source, []) if s.rank in named) * world / 1e9
        stepping = self.stepping(mon, view, now_s, settings, dead)
        if cur is not None:
            # A slow rank that stops stepping (hung, dead, exited) leaves the incident at once.
            gone = [r for r in cur["ranks"] if r in view.rows and r not in stepping]
            if gone:
                for r in gone:
                    self.leave_evals.pop(r, None)
                    self.watch.pop(r, None)
                remaining = [r for r in cur["ranks"] if r not in gone]
                why = f"rank{'s' if len(gone) > 1 else ''} {','.join(map(str, gone))} stopped stepping"
                if not remaining:
                    return self._resolve(mon, now_s, why)
                return mon._open_or_update("slow_rank", now_s, remaining, cur["step"], f"{cur['summary']} ({why})",
                                           "warning", [], {**cur["details"], "left": gone},
                                           lost=self.lost_rank_seconds)
        if not self._progressed(settings):
            return []
        n = sum(1 for r in view.rows.values() if not r.exit_reason and r.rank not in dead) if view.exact \
            else view.live - len(dead)
        source, horizon = self._choose_source(settings, n)
        if not horizon or n < 3:
            return []
        self.source = source
        stats = horizon_stats(horizon)
        enter, gate = enter_share(n), settings.straggler_cost_gate
        newest_ns = horizon[-1].arrival_ns
        self.watch = {r: {"last_share": round(sh, 3), "cost_share": round(co, 4)}
                      for r, (sh, co) in stats.items() if sh >= enter or r in named}
        for r in set(stats) | set(self.enter_evals) | named:
            sh, co = stats.get(r, (0.0, 0.0))
            if r in named:
                out = sh < enter - LEAVE_SHARE_DROP or co < gate * LEAVE_COST_FRACTION
                self.leave_evals[r] = self.leave_evals.get(r, 0) + 1 if out else 0
            elif sh >= enter and co >= gate:
                self.enter_evals[r] = self.enter_evals.get(r, 0) + 1
                self.costly_since_ns.setdefault(r, newest_ns)
            else:
                self.enter_evals[r] = 0
        persist, min_ns = settings.straggler_persist, PERSIST_FRACTION * settings.straggler_min_s * 1e9
        slow = sorted({r for r in named if self.leave_evals.get(r, 0) < persist}
                      | {r for r, k in self.enter_evals.items() if r not in named and k >= persist
                         and newest_ns - self.costly_since_ns[r] >= min_ns})
        self.enter_evals = {r: k for r, k in self.enter_evals.items() if k and r not in slow}
        self.costly_since_ns = {r: self.costly_since_ns[r] for r in self.enter_evals}
        self.leave_evals = {r: self.leave_evals.get(r, 0) for r in slow}
        if not slow:
            return self._resolve(mon, now_s, "no rank holds the job back any more")
        details = self._details(view, stats, horizon, slow, stepping, world, settings)
        named_paths = profile_digest.above_peers(mon.profile_shares(), slow)
        if named_paths:
            details["profile"] = named_paths
        cpu = cpu_evidence.evidence((cpu_wait(mon.shards[sh].agg) for sh in active), slow)
        if cpu is not None:
            details["cpu_wait"] = cpu
        worst = max(slow, key=lambda r: stats.get(r, (0.0, 0.0))[1])
        share, cost = stats.get(worst, (0.0, 0.0))
        if source == STEPS:
            where, items = "the collective", "steps"
        else:
            op = self.groups[source].label_of(horizon, set(slow))
            details.update(evidence=COLLECTIVE_EVIDENCE, process_group=source, collective=op)
            where, items = f"{op.split(' ', 1)[0] or 'collectives'} in process group {source}", "collectives"
        summary = (f"job {mon.job}: rank{'s' if len(slow) > 1 else ''} {','.join(map(str, slow[:16]))} slow: "
                   f"last to reach {where} in {share:.0%} of the last {len(horizon)} {items} "
                   f"({details['horizon_s']:.0f} s), costing {cost:.1%} of the job's time")
        if cpu is not None and cpu.get("starved"):    # why it is slow, before where its time goes
            r = cpu["starved"][0]
            summary += (f"; rank {r}'s training thread waited for a CPU {cpu['wait_share'][str(r)]:.0%} of the time it "
                        f"was ready to run over the last {cpu['window_s']:.0f} s, its peers' median "
                        f"{cpu['peers_median_wait_share']:.0%}: the cores it runs on are oversubscribed")
        if named_paths:
            top = named_paths[0]
            summary += (f"; {'their' if len(slow) > 1 else 'its'} profile: {top['share']:.0%} of its time in {top['function']}, "
                        f"its peers' median {top['peers_median_share']:.0%}")
        return mon._open_or_update("slow_rank", now_s, slow[:MAX_RANKS], max(view.min_step, 0), summary,
                                   "warning", [], details, lost=self.lost_rank_seconds)

    def _resolve(self, mon: JobMonitor, now_s: float, why: str) -> list[Alert]:
        out = mon._resolve("slow_rank", now_s, why)
        if out:
            self.lost_rank_seconds = 0.0    # the next incident counts its own cost
        return out

    @staticmethod
    def _details(view: JobView, stats: dict[int, tuple[float, float]], horizon: list[Step], slow: list[int],
                 stepping: dict[int, float], world: int, settings: Settings) -> dict[str, Any]:
        top = sorted(stats, key=lambda r: -stats[r][1])[:MAX_DETAIL_RANKS]
        span_s = (horizon[-1].arrival_ns - horizon[0].arrival_ns) / 1e9
        lead_ns = sum(s.saving_ns for s in horizon if s.rank in set(slow))
        out: dict[str, Any] = {
            "last_share": {str(r): round(stats[r][0], 3) for r in sorted(top)},
            "cost_share": {str(r): round(stats[r][1], 4) for r in sorted(top)},
            "cost_gate": settings.straggler_cost_gate, "horizon_steps": len(horizon), "horizon_s": round(span_s, 1),
            "lost_rank_seconds_per_step": round(lead_ns * world / len(horizon) / 1e9, 6),
            "evidence": "arrival at each step's collective (step end minus time blocked in collectives); "
                        "the last rank's lead over the second-to-last is what every rank waits for it",
        }
        if view.exact and len(stepping) >= 2:
            base = statistics.median(v for r, v in stepping.items() if r not in slow) if len(slow) < len(stepping) \
                else statistics.median(stepping.values())
        else:
            base = hist_quantile(view.busy_hist, 0.5)
        shown = [r for r in slow[:MAX_DETAIL_RANKS] if r in stepping]
        if shown:
            out["median_busy_ms"] = {str(r): round(stepping[r] / 1e6, 3) for r in shown}
        if view.exact and len(stepping) >= 3:
            z = slow_ranks(stepping, settings.straggler_z, settings.straggler_min_rel)
            out["busy_z"] = {str(r): round(z[r][0], 2) for r in shown}
            out["busy_abnormal"] = sorted(r for r, (_, flagged) in z.items() if flagged)[:MAX_DETAIL_RANKS]
        if base:
            out["baseline_busy_ms"] = round(base / 1e6, 3)
        return out


def slow_ranks(medians: dict[int, float], z_min: float, min_rel: float) -> dict[int, tuple[float, bool]]:
    """Each rank's robust z of busy time (ns) against its peers, and whether it is flagged: ``(z, flagged)``.

    The slow-worker test of the diagnosis report (:func:`~rankscope.stream_processors.analysis.outliers.flag_slow`):
    the baseline of a rank is the median of the *other* ranks, so a slow rank does not move its own
    baseline (in a small job it would hide inside the spread it causes). Flagged: z > ``z_min`` and
    more than ``min_rel`` above the baseline."""
    return flag_slow(medians, z_min, min_rel)
