"""Per-job rank state and the hang, death and slow-rank rules, as plain objects with an injected time.

The faust agents (stream_processors/app.py) feed decoded messages into :meth:`JobMonitor.apply`
and call :meth:`JobMonitor.scan` from a timer; everything here is synchronous, pure Python and
driven by ``now_s`` (processor wall seconds), so tests replay scenarios without Kafka.

Rules (see README "Detection rules"):
- progress age of a rank = its last heartbeat's ``since_step_s`` + time since that heartbeat
  (the extrapolation is capped so a lagging processor does not invent hangs);
- hung: progress age > max(hang_min_s, hang_factor x job median step time), heartbeats alive;
- dead: heartbeats silent for dead_after_s relative to the job's freshest rank (or the whole job
  silent for 3 x dead_after_s), with no exit record; the first to go silent is the likely cause;
- culprit of a whole-job stall: the ranks at the lowest step; among them those whose main-thread
  stack is not waiting in a collective; identical stacks are grouped across ranks; a partial stall
  names its stalled ranks that are not waiting in a collective, and when all of them wait, the
  alert waits a grace period (5 heartbeats, >= 5 s) for the rank they wait for to cross too;
- slow rank: median busy time (step time minus collective wait) over the last straggler_window
  steps, compared with the other ranks' median/MAD (robust z, the rank left out of its own
  baseline) and a relative floor; flagged for
  straggler_persist consecutive evaluations (one every straggler_window/4 steps of the slowest
  rank, so the rule counts steps, not seconds) before alerting. Needs at least 3 ranks.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

from rankscope.alerts import Alert, StackGroup
from rankscope.config import Settings
from rankscope.wire import Envelope

EXTRAPOLATION_CAP_S = 3.0
COLLECTIVE_MARKERS = ("torch/distributed/", "_rankscope_timed_collective", "_rankscope_timed_wait",
                      " all_reduce", " barrier", " all_gather", " broadcast", " reduce_scatter",
                      " all_to_all")


@dataclass
class RankState:
    rank: int
    host: str = ""
    pid: int = 0
    last_step: int = -1
    last_step_end_ns: int = 0
    durations: list[int] = field(default_factory=list)
    busy: list[int] = field(default_factory=list)
    comm: list[int] = field(default_factory=list)
    hb_recv_s: float = 0.0
    hb_step: int = -1
    hb_since_s: float = 0.0
    stacks: list[dict[str, Any]] | None = None
    exit_reason: str = ""
    exit_detail: str = ""
    dropped: int = 0
    slow_evals: int = 0
    ok_evals: int = 0
    busy_z: float = 0.0
    last_seq: int = 0


@dataclass
class JobMonitor:
    job: str
    world_size: int = 0
    ranks: dict[int, RankState] = field(default_factory=dict)
    incidents: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> Alert as dict
    last_eval_min_step: int = -1
    steps_since_stats: int = 0
    lost_rank_seconds: float = 0.0
    incident_count: int = 0
    waiters_stalled_since_s: float = -1.0  # when only ranks waiting in collectives crossed the threshold
    pending: list[Alert] = field(default_factory=list)  # raised while ingesting, returned by scan()

    # Serialisation (faust table values) ------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("pending")
        d["ranks"] = {str(k): v for k, v in d["ranks"].items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobMonitor:
        d = dict(d)
        d.pop("pending", None)
        ranks = {int(k): RankState(**v) for k, v in d.pop("ranks", {}).items()}
        return cls(ranks=ranks, **d)

    # Input -------------------------------------------------------------------------------------
    def apply(self, env: Envelope, now_s: float, settings: Settings) -> None:
        """Fold one decoded message from the steps topic into the state."""
        st = self.ranks.get(env.rank)
        if st is None:
            st = self.ranks[env.rank] = RankState(rank=env.rank)
        if st.pid and st.pid != env.pid and env.kind != "exit":
            st.last_step, st.exit_reason = -1, ""  # the rank restarted in a new process
        st.host, st.pid = env.host, env.pid
        b = env.body
        if env.kind == "steps":
            w = settings.straggler_window
            for s, a, e, c in zip(b["step"], b["start_ns"], b["end_ns"], b["comm_ns"], strict=True):
                if s <= st.last_step:
                    continue  # duplicate delivery
                dur = max(0, e - a)
                st.durations.append(dur)
                st.comm.append(max(0, c))
                st.busy.append(max(0, dur - c))
                st.last_step, st.last_step_end_ns = s, e
                self.steps_since_stats += 1
            del st.durations[:-w], st.busy[:-w], st.comm[:-w]
            st.hb_recv_s = max(st.hb_recv_s, now_s)
            st.hb_since_s = 0.0 if b["step"] else st.hb_since_s
            st.exit_reason = ""
            # The slow-rank rule runs on step progress, not wall time, so a backlog read at once is
            # judged exactly as it would have been live.
            self.pending += self._slow_rule(now_s, settings, set())
        elif env.kind == "heartbeat":
            st.hb_recv_s = now_s
            st.hb_step = b["step"]
            st.hb_since_s = float(b["since_step_s"])
            st.stacks = b["stacks"]
            st.dropped = b["dropped"]
            if b["world_size"] > 0:
                self.world_size = b["world_size"]
        elif env.kind == "exit":
            st.exit_reason = b["reason"]
            st.exit_detail = b["detail"]
            st.hb_recv_s = now_s
            st.last_step = max(st.last_step, b["step"])
        st.last_seq = env.seq

    # Derived ----------------------------------------------------------------------------------
    def median_step_s(self) -> float:
        durs = [d for st in self.ranks.values() for d in st.durations]
        return statistics.median(durs) / 1e9 if durs else 0.0

    def progress_age_s(self, st: RankState, now_s: float) -> float:
        return st.hb_since_s + min(max(0.0, now_s - st.hb_recv_s), EXTRAPOLATION_CAP_S)

    def dead_ranks(self, now_s: float, settings: Settings) -> list[int]:
        live = [st for st in self.ranks.values() if not st.exit_reason]
        if not live:
            return []
        newest = max(st.hb_recv_s for st in self.ranks.values())
        whole_job_silent = now_s - newest > 3 * settings.dead_after_s
        dead = [st for st in live
                if now_s - st.hb_recv_s > settings.dead_after_s
                and (newest - st.hb_recv_s > settings.dead_after_s or whole_job_silent)]
        return [st.rank for st in sorted(dead, key=lambda s: s.hb_recv_s)]

    def hang_threshold_s(self, settings: Settings) -> float:
        return max(settings.hang_min_s, settings.hang_factor * self.median_step_s())

    # Scan -------------------------------------------------------------------------------------
    def scan(self, now_s: float, settings: Settings) -> list[Alert]:
        """Evaluate every rule; return alerts to publish (opened, updated or resolved)."""
        out: list[Alert] = []
        dead = self.dead_ranks(now_s, settings)
        out += self._hang_rule(now_s, settings, set(dead))
        out += self._dead_rule(now_s, dead)
        out += self.pending
        self.pending = []
        return out

    def progress_rows(self) -> list[dict[str, Any]]:
        """Each rank's latest step, when it ended (wall ns) and its median step time, for
        :func:`rankscope.trace_start.plan_start_step`."""
        return [{"rank": r, "step": st.last_step, "ts_ns": st.last_step_end_ns,
                 "median_step_ns": int(statistics.median(st.durations)) if st.durations else 0}
                for r, st in sorted(self.ranks.items())]

    def rank_states(self, now_s: float, settings: Settings) -> dict[int, str]:
        dead = set(self.dead_ranks(now_s, settings))
        hang = self.incidents.get("hang")
        slow = self.incidents.get("slow_rank")
        thr = self.hang_threshold_s(settings)
        states = {}
        for r, st in self.ranks.items():
            if st.exit_reason:
                states[r] = "exited" if st.exit_reason in ("completed", "atexit") else f"exited:{st.exit_reason}"
            elif r in dead:
                states[r] = "dead"
            elif hang and r in hang["ranks"]:
                states[r] = "hung"
            elif self.progress_age_s(st, now_s) > thr:
                states[r] = "waiting"
            elif slow and r in slow["ranks"]:
                states[r] = "slow"
            else:
                states[r] = "running"
        return states

    @staticmethod
    def partial_stall_grace_s(settings: Settings) -> float:
        """How long a stall of ranks that all wait in collectives may stay partial before they are named."""
        return max(5 * settings.heartbeat_s, 2 * settings.scan_interval_s, 5.0)

    def _hang_rule(self, now_s: float, settings: Settings, dead: set[int]) -> list[Alert]:
        thr = self.hang_threshold_s(settings)
        live = [st for st in self.ranks.values() if not st.exit_reason and st.rank not in dead]
        stalled = [st for st in live if self.progress_age_s(st, now_s) > thr]
        crashed = [st for st in self.ranks.values() if st.exit_reason in ("exception", "signal")]
        cur = self.incidents.get("hang")
        if cur is not None and all(self.ranks[r].exit_reason for r in cur["ranks"] if r in self.ranks):
            if stalled:
                # The named ranks are gone and the others still wait for them (a hung job being torn
                # down): the same incident. Resolving it here made the next scan open a new one that
                # named the ranks the teardown had killed, and left that as the job's last word.
                return []
            reasons = sorted({self.ranks[r].exit_reason for r in cur["ranks"] if r in self.ranks})
            return self._resolve("hang", now_s, f"culprit ranks exited ({', '.join(reasons)})")
        if not stalled:
            self.waiters_stalled_since_s = -1.0
            return self._resolve("hang", now_s, "progress resumed" if live else "no rank left running")
        whole_job = len(stalled) == len(live)
        if crashed and cur is None:
            culprits = crashed  # peers wait for a rank that died with an exception or signal
        elif whole_job:
            min_step = min(st.last_step for st in stalled)
            at_min = [st for st in stalled if st.last_step == min_step]
            not_waiting = [st for st in at_min if st.stacks and not waiting_in_collective(main_stack(st.stacks))]
            culprits = not_waiting or at_min
        else:
            # Ranks cross the threshold a heartbeat apart: when only ranks waiting in a collective
            # have crossed it, the rank they wait for is about to. Wait up to a grace period
            # instead of naming the victims; a stalled rank that is not waiting is named at once.
            not_waiting = [st for st in stalled if st.stacks and not waiting_in_collective(main_stack(st.stacks))]
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
        groups = group_stacks(stalled)
        ranks = sorted(st.rank for st in culprits)
        step = min(st.last_step for st in culprits)
        age = max(self.progress_age_s(st, now_s) for st in culprits)
        where = ""
        for g in groups:
            if set(g.ranks) & set(ranks) and g.frames:
                where = f" in {g.frames[-1]}"
                break
        summary = (f"job {self.job} hung: rank{'s' if len(ranks) > 1 else ''} "
                   f"{','.join(map(str, ranks))} stuck after step {step} for {age:.0f}s{where}")
        details = {"threshold_s": round(thr, 3), "stalled_ranks": sorted(st.rank for st in stalled),
                   "whole_job_stalled": whole_job, "progress_age_s": round(age, 1)}
        return self._open_or_update("hang", now_s, ranks, step, summary, "critical", groups, details,
                                    changed_keys=(tuple(ranks), tuple((tuple(g.ranks), tuple(g.frames)) for g in groups)))

    def _dead_rule(self, now_s: float, dead: list[int]) -> list[Alert]:
        if not dead:
            return self._resolve("dead_rank", now_s, "heartbeats resumed or ranks exited")
        first = dead[0]
        st = self.ranks[first]
        summary = (f"job {self.job}: rank {first} stopped sending heartbeats {now_s - st.hb_recv_s:.0f}s ago "
                   f"at step {st.last_step} with no exit record (killed, OOM or node loss)"
                   + (f"; {len(dead)} ranks silent" if len(dead) > 1 else ""))
        details = {"dead_ranks": dead, "first_silent": first, "host": st.host, "pid": st.pid}
        return self._open_or_update("dead_rank", now_s, [first], st.last_step, summary, "critical", [],
                                    details, changed_keys=(tuple(dead),))

    def _slow_rule(self, now_s: float, settings: Settings, dead: set[int]) -> list[Alert]:
        live = {r: st for r, st in self.ranks.items() if not st.exit_reason and r not in dead}
        if not live:
            return []
        min_step = min(st.last_step for st in live.values())
        if min_step < self.last_eval_min_step + max(1, settings.straggler_window // 4):
            return []
        new_steps = min_step - self.last_eval_min_step if self.last_eval_min_step >= 0 else 0
        self.last_eval_min_step = min_step
        medians = {r: statistics.median(st.busy[-settings.straggler_window:])
                   for r, st in live.items() if len(st.busy) >= settings.straggler_min_steps}
        if len(medians) < 3:
            return []
        flagged = slow_ranks(medians, settings.straggler_z, settings.straggler_min_rel)
        for r, st in live.items():
            z, is_slow = flagged.get(r, (0.0, False))
            st.busy_z = z
            st.slow_evals = st.slow_evals + 1 if is_slow else 0
            st.ok_evals = 0 if is_slow else st.ok_evals + 1
        open_ranks = set(self.incidents.get("slow_rank", {}).get("ranks", []))
        # Hysteresis: a rank joins after straggler_persist flagged evaluations in a row and leaves
        # after as many unflagged ones.
        slow = sorted(r for r, st in live.items()
                      if st.slow_evals >= settings.straggler_persist
                      or (r in open_ranks and st.ok_evals < settings.straggler_persist))
        if not slow:
            return self._resolve("slow_rank", now_s, "no rank slower than its peers")
        base = statistics.median(medians.values())
        excess_ns = sum(max(0.0, medians[r] - base) for r in slow)
        world = max(self.world_size, len(self.ranks))
        self.lost_rank_seconds += excess_ns * world * new_steps / 1e9
        details = {"median_busy_ms": {str(r): round(v / 1e6, 3) for r, v in sorted(medians.items())},
                   "baseline_busy_ms": round(base / 1e6, 3),
                   "busy_z": {str(r): round(live[r].busy_z, 2) for r in slow},
                   "lost_rank_seconds_per_step": round(excess_ns * world / 1e9, 6),
                   "evidence": "busy time = step time minus time blocked in collectives"}
        worst = max(slow, key=lambda r: medians[r])
        summary = (f"job {self.job}: rank{'s' if len(slow) > 1 else ''} {','.join(map(str, slow))} slow: "
                   f"busy {medians[worst] / 1e6:.1f} ms/step vs {base / 1e6:.1f} ms median of peers "
                   f"({medians[worst] / base if base else float('inf'):.1f}x)")
        return self._open_or_update("slow_rank", now_s, slow, min_step, summary, "warning", [], details,
                                    changed_keys=(tuple(slow),), lost=self.lost_rank_seconds)

    # Incident lifecycle -------------------------------------------------------------------------
    def _open_or_update(self, kind: str, now_s: float, ranks: list[int], step: int, summary: str,
                        severity: str, groups: list[StackGroup], details: dict[str, Any],
                        changed_keys: tuple, lost: float = 0.0) -> list[Alert]:
        now_ns = int(now_s * 1e9)
        cur = self.incidents.get(kind)
        if cur is not None and cur["_key"] == repr(changed_keys):
            if kind != "slow_rank" or abs(cur["lost_rank_seconds"] - lost) < max(1.0, 0.2 * lost):
                return []
        if cur is None:
            self.incident_count += 1
            alert_id = f"{self.job}:{kind}:{now_ns}"
            version, status, opened = 1, "open", now_ns
        else:
            alert_id, version, status, opened = cur["alert_id"], cur["version"] + 1, "update", cur["opened_ns"]
        alert = Alert(alert_id=alert_id, job=self.job, kind=kind, status=status, severity=severity, ranks=ranks,
                      step=step, opened_ns=opened, updated_ns=now_ns, version=version, summary=summary,
                      lost_rank_seconds=round(lost, 3), stack_groups=groups, details=details)
        d = dataclasses.asdict(alert)
        d["_key"] = repr(changed_keys)
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


def slow_ranks(medians: dict[int, float], z_min: float, min_rel: float) -> dict[int, tuple[float, bool]]:
    """Each rank's robust z against its peers, and whether it is flagged: ``(z, flagged)`` per rank.

    The baseline of a rank is the median of the *other* ranks, and the scale 1.4826 x their MAD
    (floored at 5% of that median): a slow rank must not move its own baseline. With the rank
    itself in the group (until stop 12), 4 ranks with one 4x slower and one noisy peer gave
    {4.2, 4.2, 8.1, 16.5} ms -> z 3.6 for the slow rank, under the threshold, so the persistence
    count restarted and the alert came late or, before a hang, never. Flagged: z > ``z_min`` and
    more than ``min_rel`` above the baseline. O(n log n): removing one value moves a sorted list's
    median by at most one place."""
    order = sorted(medians, key=lambda r: medians[r])
    vals = [medians[r] for r in order]
    if len(vals) < 2:
        return {r: (0.0, False) for r in order}
    out: dict[int, tuple[float, bool]] = {}
    deviations: dict[float, tuple[list[float], dict[int, int]]] = {}   # per baseline: sorted |v - base|, places
    for p, r in enumerate(order):
        base = _median_without(vals, p)
        if base not in deviations:        # at most 3 distinct baselines
            devs = sorted((abs(v - base), i) for i, v in enumerate(vals))
            deviations[base] = ([d for d, _ in devs], {i: k for k, (_, i) in enumerate(devs)})
        devs_sorted, place = deviations[base]
        mad = _median_without(devs_sorted, place[p])
        scale = max(1.4826 * mad, 0.05 * base, 1000.0)
        z = (vals[p] - base) / scale
        out[r] = (z, z > z_min and vals[p] > base * (1 + min_rel))
    return out


def _median_without(sorted_vals: list[float], pos: int) -> float:
    """Median of ``sorted_vals`` (at least 2) without the value at ``pos``."""
    m = len(sorted_vals) - 1

    def at(k: int) -> float:
        return sorted_vals[k] if k < pos else sorted_vals[k + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def main_stack(stacks: list[dict[str, Any]] | None) -> list[str]:
    if not stacks:
        return []
    for s in stacks:
        if s.get("thread") == "MainThread":
            return list(s.get("frames", []))
    return list(stacks[0].get("frames", []))


def waiting_in_collective(frames: list[str]) -> bool:
    """True when the innermost frames show a torch.distributed call (the rank waits for others)."""
    return any(any(m in f for m in COLLECTIVE_MARKERS) for f in frames[-6:])


def group_stacks(states: list[RankState]) -> list[StackGroup]:
    """Identical main-thread stacks merged across ranks (line numbers included), largest group last."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for st in states:
        frames = tuple(main_stack(st.stacks))
        if frames:
            groups.setdefault(frames, []).append(st.rank)
    out = [StackGroup(ranks=sorted(r), thread="MainThread", frames=list(f), waiting_in_collective=waiting_in_collective(list(f)))
           for f, r in groups.items()]
    out.sort(key=lambda g: (g.waiting_in_collective, len(g.ranks), g.ranks))
    return out
