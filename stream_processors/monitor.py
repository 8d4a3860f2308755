"""Stage two of the processors: the job-wide hang, death and slow-rank rules over shard summaries.

A :class:`JobMonitor` keeps the latest :class:`~rankscope.stream_processors.shard_summary.ShardSummary` of every
shard (steps partition) that holds ranks of its job, merges them into a :class:`JobView` and
evaluates the rules from a timer. It holds only those summaries and its open incidents, so its
size does not grow with the job; everything is synchronous and driven by ``now_s``.

Rules (see README "Detection rules"):
- progress age of a rank = its last heartbeat's ``since_step_s`` + time since that heartbeat
  (the extrapolation is capped so a lagging processor does not invent hangs);
- hung: progress age > max(hang_min_s, hang_factor x job median step time), heartbeats alive;
- dead: messages silent for dead_after_s relative to the job's freshest rank (or the whole job
  silent for 3 x dead_after_s), with no exit record; the first to go silent is the likely cause;
- culprit of a whole-job stall: the ranks at the lowest step; among them those whose main-thread
  stack is not waiting in a collective; identical stacks are grouped across ranks; a partial stall
  names its stalled ranks that are not waiting in a collective, and when all of them wait, the
  alert waits a grace period (5 heartbeats, >= 5 s) for the rank they wait for to cross too;
- slow rank (stream_processors/slow_rule.py): the rank that arrives last at the steps' collectives
  in most of the last straggler_min_s seconds and straggler_min_slow_steps steps; alerted when its
  lead over the second-to-last costs at least straggler_cost_gate of the job's time, for
  straggler_persist evaluations in a row (and as many to leave). Needs at least 3 ranks.
While a shard that holds ranks of the job has not reported for ``stale_s`` (its worker died and
the partition is moving), the rules wait instead of judging a job they see only in part.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

from rankscope.config import Settings
from rankscope.protocol.alerts import MAX_DETAIL_RANKS, MAX_RANKS, Alert, StackGroup
from rankscope.rank_states import DEAD, HUNG, RUNNING, SLOW, WAITING, exited_state
from rankscope.stream_processors import collective_arrivals, failures
from rankscope.stream_processors.job_view import MAX_GROUP_RANKS, JobView
from rankscope.stream_processors.rank_state import CRASH_REASONS
from rankscope.stream_processors.shard_summary import Row, ShardSummary, hist_quantile
from rankscope.stream_processors.slow_rule import SlowRule, slow_ranks
from rankscope.stream_processors.stacks import waiting_in_collective

__all__ = ["JobMonitor", "slow_ranks", "stale_after_s"]

FORGET_SHARD_S = 60.0   # a shard silent this long no longer holds the job's rules back
PROFILE_MAX_AGE_S = 60.0   # a rank's profile digest this much older than the newest one is left out


def stale_after_s(settings: Settings) -> float:
    return max(5.0, 4 * settings.scan_interval_s)


@dataclass
class JobMonitor:
    job: str
    shards: dict[int, ShardSummary] = field(default_factory=dict)
    incidents: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> Alert as dict
    incident_count: int = 0
    waiters_stalled_since_s: float = -1.0
    slow: SlowRule = field(default_factory=SlowRule)
    retired: bool = False       # a shard said the job went idle there
    profiles: dict[int, tuple[int, dict[str, float]]] = field(default_factory=dict)  # rank -> newest digest

    # Input -------------------------------------------------------------------------------------
    def add_summary(self, summary: ShardSummary) -> None:
        """Keep a shard's latest summary (an older one arriving late is ignored; its steps' arrivals
        still count). Raises WireError when its arrival rows are malformed."""
        self.slow.add(summary)
        for rank, digest in summary.profiles.items():
            if rank not in self.profiles or self.profiles[rank][0] < digest[0]:
                self.profiles[rank] = digest
        cur = self.shards.get(summary.shard)
        if cur is not None and cur.ts_ns > summary.ts_ns:
            return
        if summary.agg["retired"]:
            self.shards.pop(summary.shard, None)
            self.retired = True
        else:
            self.shards[summary.shard] = summary

    def profile_shares(self) -> dict[int, dict[str, float]]:
        """Each rank's newest profile digest (stream_processors/profile_digest.py), those of the last
        PROFILE_MAX_AGE_S before the newest."""
        if not self.profiles:
            return {}
        newest = max(t for t, _ in self.profiles.values())
        return {r: s for r, (t, s) in self.profiles.items() if newest - t <= PROFILE_MAX_AGE_S * 1e9}

    def restore(self, alert: Alert) -> None:
        """Take back an incident from the alerts topic after a restart: it keeps its ``alert_id``."""
        if alert.status == "resolved":
            if self.incidents.get(alert.kind, {}).get("alert_id") == alert.alert_id:
                self.incidents.pop(alert.kind)
            return
        d = dataclasses.asdict(alert)
        d["_key"] = _change_key(alert)
        self.incidents[alert.kind] = d
        self.incident_count = max(self.incident_count, 1)
        if alert.kind == "slow_rank":
            self.slow.lost_rank_seconds = max(self.slow.lost_rank_seconds, alert.lost_rank_seconds)

    # Derived ----------------------------------------------------------------------------------
    def view(self, now_s: float, settings: Settings) -> JobView | None:
        """The merged view, or None while a shard of the job is stale (its partition is moving)."""
        current = []
        for shard, s in list(self.shards.items()):
            age = now_s - s.ts_ns / 1e9
            if age > FORGET_SHARD_S:
                del self.shards[shard]
            elif age > stale_after_s(settings):
                return None
            else:
                current.append(s)
        return JobView.merge(current, now_s) if current else None

    @staticmethod
    def median_step_s(view: JobView) -> float:
        if view.exact:
            durs = [r.step_med_ns for r in view.rows.values() if r.step_med_ns > 0 and not r.exit_reason]
            return statistics.median(durs) / 1e9 if durs else 0.0
        return hist_quantile(view.step_hist, 0.5) / 1e9

    def hang_threshold_s(self, view: JobView, settings: Settings) -> float:
        return max(settings.hang_min_s, settings.hang_factor * self.median_step_s(view))

    @staticmethod
    def dead_ranks(view: JobView, now_s: float, settings: Settings) -> list[int]:
        """Live ranks silent for ``dead_after_s`` while others went on (or the whole job silent for
        3x that), each judged at its shard's frontier: a rank whose partition is read late is not
        taken for dead because its newer heartbeats are still waiting there."""
        live = [r for r in view.rows.values() if not r.exit_reason]
        if not live:
            return []
        frontier = view.frontier_s
        newest_read_s = min(now_s, max(frontier.values(), default=now_s))
        whole_job_silent = newest_read_s - view.newest_hb_s > 3 * settings.dead_after_s
        dead = [r for r in live
                if min(now_s, frontier.get(r.rank, now_s)) - r.hb_ns / 1e9 > settings.dead_after_s
                and (view.newest_hb_s - r.hb_ns / 1e9 > settings.dead_after_s or whole_job_silent)]
        return [r.rank for r in sorted(dead, key=lambda r: r.hb_ns)]

    def progress_rows(self, now_s: float, settings: Settings) -> list[dict[str, Any]]:
        """Latest step, when it ended and median step time, for :func:`rankscope.trace_start.plan_start_step`:
        every rank when the view is exact, else each shard's furthest rank."""
        view = self.view(now_s, settings)
        if view is None:
            return []
        if view.exact:
            return [{"rank": r.rank, "step": r.last_step, "ts_ns": r.last_step_end_ns, "median_step_ns": r.step_med_ns}
                    for r in sorted(view.rows.values(), key=lambda r: r.rank)]
        return view.max_progress

    def expected_ranks(self, now_s: float, settings: Settings) -> list[int] | None:
        """The ranks still running (reports wait for their summaries), or None when not every rank is known."""
        view = self.view(now_s, settings)
        if view is None or not view.exact:
            return None
        return sorted(r.rank for r in view.rows.values() if not r.exit_reason)

    def world_size(self, now_s: float, settings: Settings) -> int:
        view = self.view(now_s, settings)
        return view.world_size if view else 0

    def rank_states(self, now_s: float, settings: Settings) -> dict[int, str]:
        """The state of every rank with a row (:mod:`rankscope.rank_states`). Slow: named by the
        slow-rank incident, or slow but costing less than the gate (:attr:`SlowRule.watch`). A rank
        waiting in a collective for a hung peer stays slow when the slow-rank incident names it."""
        view = self.view(now_s, settings)
        if view is None:
            return {}
        dead = set(self.dead_ranks(view, now_s, settings))
        hang = self.incidents.get("hang")
        slow = self.incidents.get("slow_rank")
        thr = self.hang_threshold_s(view, settings)
        states = {}
        for r in view.rows.values():
            if r.exit_reason:
                states[r.rank] = exited_state(r.exit_reason)
            elif r.rank in dead:
                states[r.rank] = DEAD
            elif hang and r.rank in hang["ranks"]:
                states[r.rank] = HUNG
            elif (slow and r.rank in slow["ranks"]) or r.rank in self.slow.watch:
                states[r.rank] = SLOW
            elif view.age(r, now_s) > thr:
                states[r.rank] = WAITING
            else:
                states[r.rank] = RUNNING
        return states

    # Scan -------------------------------------------------------------------------------------
    def scan(self, now_s: float, settings: Settings) -> list[Alert]:
        """Evaluate every rule; return alerts to publish (opened, updated or resolved)."""
        if not self.shards and self.retired:
            return [a for kind in list(self.incidents) for a in self._resolve(kind, now_s, "the job stopped reporting")]
        view = self.view(now_s, settings)
        if view is None:
            return []
        dead = self.dead_ranks(view, now_s, settings)
        out = self._hang_rule(view, now_s, settings, set(dead))
        if not (dead and "dead_rank" not in self.incidents and self._failure_explains(view, dead, settings)):
            out += self._dead_rule(view, now_s, dead)   # else the rank_failed incident names them
        out += self.slow.evaluate(self, view, now_s, settings, set(dead))
        out += self._failure_rule(view, now_s, settings)
        out += self._mismatch_rule(now_s)
        return out

    def _failure_explains(self, view: JobView, dead: list[int], settings: Settings) -> bool:
        """Whether every silent rank belongs to a failure: named by the rank_failed incident, or gone
        about when the first failure on record happened (it will be named there)."""
        failed = self.incidents.get("rank_failed")
        named = set(failed["ranks"]) | set(failed["details"].get("followers", [])) if failed else set()
        first_ns = view.failures[0].exit_ns if view.failures else 0
        return all(r in named or failures.explained_by_failure(view.rows[r], first_ns, settings) for r in dead)

    def _failure_rule(self, view: JobView, now_s: float, settings: Settings) -> list[Alert]:
        """rank_failed: the first rank to fail (stream_processors/failures.py), once its peers had time
        to fail too and every rank that may have gone silent before them is known to have or not."""
        first_ns = view.failures[0].exit_ns if view.failures else 0
        silent, pending, later = failures.silent_ranks(view.rows.values(), first_ns, now_s, settings,
                                                       view.frontier_s)
        if view.exact and view.failures and not self.retired:
            # Once a shard has retired the job (idle), its ranks leave the view: absent is not silent.
            silent += failures.never_reported(view.rows, view.world_size)
        verdict = failures.attribute(view.failures, silent, later)
        cur = self.incidents.get("rank_failed")
        if verdict is None:
            row = view.rows.get(cur["ranks"][0]) if cur is not None and cur["ranks"] else None
            if cur is not None and row is not None and not row.exit_reason \
                    and row.hb_ns > cur["details"].get("failed_ns", 0):
                return self._resolve("rank_failed", now_s, "the failed rank is running again")
            return []
        if cur is None and (now_s - max(verdict.culprit.exit_ns, first_ns) / 1e9 < failures.grace_s(settings)
                            or (pending and verdict.culprit.reason == "exception"
                                and failures.is_peer_error(verdict.culprit))):
            return []
        summary, groups, details = failures.alert_fields(self.job, verdict)
        return self._open_or_update("rank_failed", now_s, [verdict.culprit.rank], failures.failing_step(verdict.culprit),
                                    summary, "critical", groups, details)

    @staticmethod
    def partial_stall_grace_s(settings: Settings) -> float:
        """How long a stall of ranks that all wait in collectives may stay partial before they are named."""
        return max(5 * settings.heartbeat_s, 2 * settings.scan_interval_s, 5.0)

    def _hang_rule(self, view: JobView, now_s: float, settings: Settings, dead: set[int]) -> list[Alert]:
        thr = self.hang_threshold_s(view, settings)
        rows = view.rows
        live = [r for r in rows.values() if not r.exit_reason and r.rank not in dead]
        stalled = [r for r in live if view.age(r, now_s) > thr]
        crashed = [r for r in rows.values() if r.exit_reason in CRASH_REASONS]
        cur = self.incidents.get("hang")
        if cur is not None and all(rows[r].exit_reason for r in cur["ranks"] if r in rows) \
                and any(r in rows for r in cur["ranks"]):
            if stalled:
                return []   # a hung job being torn down: the others still wait for the named ranks
            reasons = sorted({rows[r].exit_reason for r in cur["ranks"] if r in rows})
            return self._resolve("hang", now_s, f"culprit ranks exited ({', '.join(reasons)})")
        if not stalled:
            self.waiters_stalled_since_s = -1.0
            return self._resolve("hang", now_s, "progress resumed" if view.live else "no rank left running")
        if cur is not None and not any(r in rows for r in cur["ranks"]):
            return []   # the named ranks left the shards' samples (exited in a large job's teardown): keep them
        live_total = view.live - len(dead) if not view.exact else len(live)
        whole_job = view.min_age_s > thr if not view.exact else len(stalled) == len(live)
        whole_job = whole_job or len(stalled) >= live_total
        coll = self._collectives_behind(view, live)
        coll_rows = [rows[r] for b in coll.values() for r in b["ranks"] if r in rows and rows[r] in stalled]
        if crashed and cur is None:
            culprits = crashed
        elif coll_rows:
            # The device's view: the ranks that never reached the collective their peers wait in.
            culprits = sorted(set(coll_rows), key=lambda r: r.rank)
        elif whole_job:
            min_step = min(r.last_step for r in stalled)
            at_min = [r for r in stalled if r.last_step == min_step]
            not_waiting = [r for r in at_min if r.waiting == 0]
            culprits = not_waiting or at_min
        else:
            not_waiting = [r for r in stalled if r.waiting == 0]
            if not_waiting:
                culprits = not_waiting
            else:
                if self.waiters_stalled_since_s < 0:
                    self.waiters_stalled_since_s = now_s
                if cur is None and now_s - self.waiters_stalled_since_s < self.partial_stall_grace_s(settings):
                    return []
                culprits = stalled
        if whole_job or culprits is not stalled:
            self.waiters_stalled_since_s = -1.0
        groups = self._groups(view, stalled)
        ranks = sorted(r.rank for r in culprits)
        step = min(r.last_step for r in culprits)
        age = max(view.age(r, now_s) for r in culprits)
        where = ""
        for g in groups:
            if set(g.ranks) & set(ranks) and g.frames:
                where = f" in {g.frames[-1]}"
                break
        shown = ranks[:MAX_RANKS]
        more = f" and {len(ranks) - 16} more" if len(ranks) > 16 else ""
        summary = (f"job {self.job} hung: rank{'s' if len(ranks) > 1 else ''} "
                   f"{','.join(map(str, shown[:16]))}{more} "
                   f"stuck after step {step} for {age:.0f}s{where}")
        dead_culprits = [r for r in culprits if r.exit_reason in CRASH_REASONS]
        if dead_culprits:
            first = min(dead_culprits, key=lambda r: r.hb_ns)
            summary = (f"job {self.job} hung: {len(stalled)} rank{'s' if len(stalled) > 1 else ''} wait for rank"
                       f"{'s' if len(ranks) > 1 else ''} {','.join(map(str, shown[:16]))}{more}, which crashed "
                       f"at step {step} ({first.exit_reason}: {first.exit_detail[:200]})")
        details = {"threshold_s": round(thr, 3), "stalled_ranks": sorted(r.rank for r in stalled)[:MAX_DETAIL_RANKS],
                   "stalled_count": max(len(stalled), live_total if whole_job else len(stalled)),
                   "whole_job_stalled": whole_job, "progress_age_s": round(age, 1)}
        if len(ranks) > len(shown):
            details["culprit_count"] = len(ranks)
        if culprits and coll_rows and culprits[0] in coll_rows:
            pg, b = next((pg, b) for pg, b in sorted(coll.items()) if set(b["ranks"]) & set(ranks))
            details["collective"] = {"process_group": pg, "seq": b["seq"], "op": b["op"],
                                     "reached": {str(r): v for r, v in sorted(b["ranks"].items())[:MAX_DETAIL_RANKS]}}
            summary += (f"; the others wait in {b['op'] or 'collective'} #{b['seq']} of process group {pg}, "
                        f"which {'they' if len(ranks) > 1 else 'it'} never reached")
        if dead_culprits:
            details["culprit_crashed"] = True
        return self._open_or_update("hang", now_s, shown, step, summary, "critical", groups, details)

    def _collectives_behind(self, view: JobView, live: list[Row]) -> dict[str, dict[str, Any]]:
        """Per process group, the live ranks behind the newest collective another member reached
        (stream_processors/collective_arrivals.py), from the shards' latest summaries."""
        groups: dict[str, list[dict[str, Any]]] = {}
        for s in self.shards.values():
            for pg, g in s.agg.get("coll", {}).items():
                groups.setdefault(pg, []).append(g)
        if not groups:
            return {}
        live_ranks = {r.rank for r in live}
        return collective_arrivals.behind(groups, live_ranks)

    def _mismatch_rule(self, now_s: float) -> list[Alert]:
        """collective_mismatch: the same collective of a group issued with another op, sizes or dtypes."""
        if "collective_mismatch" in self.incidents:
            return []
        for pg, led in sorted(self.slow.groups.items()):
            if not led.mismatches:
                continue
            seq, rank_a, label_a, rank_b, label_b = led.mismatches[0]
            summary = (f"job {self.job}: collective #{seq} of process group {pg} does not match: rank {rank_b} "
                       f"issued {label_b}, rank {rank_a} {label_a}")
            details = {"process_group": pg, "seq": seq, "rank": rank_b, "op": label_b, "peer": rank_a,
                       "peer_op": label_a, "mismatches": [list(m) for m in led.mismatches[:4]]}
            return self._open_or_update("collective_mismatch", now_s, [rank_b], -1, summary, "critical", [], details)
        return []

    @staticmethod
    def _groups(view: JobView, stalled: list[Row]) -> list[StackGroup]:
        """Identical main-thread stacks of the stalled ranks, merged across ranks, largest group last."""
        by_sig: dict[str, list[int]] = {}
        for r in stalled:
            if r.stack_sig:
                by_sig.setdefault(r.stack_sig, []).append(r.rank)
        out = []
        for sig, ranks in by_sig.items():
            info = view.stacks.get(sig)
            if info is None:
                continue
            sample = sorted(set(ranks) | (set() if view.exact else set(info.sample)))[:MAX_GROUP_RANKS]
            out.append(StackGroup(ranks=sample, thread="MainThread", frames=list(info.frames),
                                  waiting_in_collective=waiting_in_collective(info.frames),
                                  count=len(ranks) if view.exact else max(info.count, len(ranks))))
        out.sort(key=lambda g: (g.waiting_in_collective, g.count, g.ranks))
        return out

    def _dead_rule(self, view: JobView, now_s: float, dead: list[int]) -> list[Alert]:
        if not dead:
            cur = self.incidents.get("dead_rank")
            if cur is not None and view.world_size and view.ranks < view.world_size \
                    and not any(r in view.rows for r in cur["ranks"]):
                return []   # the silent rank is no longer known to any shard: unknown is not alive
            return self._resolve("dead_rank", now_s, "heartbeats resumed or ranks exited")
        first = view.rows[dead[0]]
        summary = (f"job {self.job}: rank {first.rank} stopped sending heartbeats {now_s - first.hb_ns / 1e9:.0f}s ago "
                   f"at step {first.last_step} with no exit record (killed, OOM or node loss)"
                   + (f"; {len(dead)} ranks silent" if len(dead) > 1 else ""))
        details = {"dead_ranks": dead[:MAX_DETAIL_RANKS], "dead_count": len(dead), "first_silent": first.rank,
                   "host": first.host, "pid": first.pid}
        return self._open_or_update("dead_rank", now_s, [first.rank], first.last_step, summary, "critical", [], details)

    # Incident lifecycle -------------------------------------------------------------------------
    def _open_or_update(self, kind: str, now_s: float, ranks: list[int], step: int, summary: str,
                        severity: str, groups: list[StackGroup], details: dict[str, Any],
                        lost: float = 0.0) -> list[Alert]:
        now_ns = int(now_s * 1e9)
        cur = self.incidents.get(kind)
        draft = Alert(alert_id="", job=self.job, kind=kind, status="open", severity=severity, ranks=ranks, step=step,
                      opened_ns=now_ns, updated_ns=now_ns, version=1, summary=summary,
                      lost_rank_seconds=round(lost, 3), stack_groups=groups, details=details)
        key = _change_key(draft)
        if cur is not None and cur["_key"] == key:
            # A slow-rank incident's cost grows every step: publish it when it grew by half, at least 10 rank-s.
            if kind != "slow_rank" or abs(cur["lost_rank_seconds"] - lost) < max(10.0, 0.5 * cur["lost_rank_seconds"]):
                return []
        if cur is None:
            self.incident_count += 1
            alert = dataclasses.replace(draft, alert_id=f"{self.job}:{kind}:{now_ns}")
        else:
            alert = dataclasses.replace(draft, alert_id=cur["alert_id"], version=cur["version"] + 1,
                                        status="update", opened_ns=cur["opened_ns"])
        d = dataclasses.asdict(alert)
        d["_key"] = key
        self.incidents[kind] = d
        return [alert]

    def _resolve(self, kind: str, now_s: float, why: str) -> list[Alert]:
        cur = self.incidents.pop(kind, None)
        if cur is None:
            return []
        cur = {k: v for k, v in cur.items() if k != "_key"}
        groups = [StackGroup(**g) for g in cur.pop("stack_groups")]
        now_ns = int(now_s * 1e9)
        cur.update(status="resolved", version=cur["version"] + 1, updated_ns=now_ns, resolved_ns=now_ns)
        cur["details"] = {**cur["details"], "resolution": why}
        return [Alert(stack_groups=groups, **cur)]


def _change_key(alert: Alert) -> str:
    """What must change for an open incident to publish an update."""
    if alert.kind == "hang":
        return repr((tuple(alert.ranks), tuple((tuple(g.ranks), tuple(g.frames)) for g in alert.stack_groups)))
    if alert.kind == "dead_rank":
        return repr((tuple(alert.details.get("dead_ranks", [])),))
    if alert.kind == "rank_failed":
        return repr((tuple(alert.ranks), alert.details.get("follower_count", 0)))
    if alert.kind == "slow_rank":   # the profile naming a call path first, or another one, is news
        return repr((tuple(alert.ranks), [p["function"] for p in alert.details.get("profile", [])[:1]]))
    return repr((tuple(alert.ranks),))
