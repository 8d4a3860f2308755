"""The slow-rank rule at its default settings on long synchronous jobs, replayed with injected time
through both stages (no Kafka): 4 ranks, ~17 ms steps, each step ends at one collective."""

from __future__ import annotations

import random
from collections.abc import Callable

import msgpack
import pytest

from rankscope.config import ConfigError, Settings
from rankscope.protocol.alerts import Alert
from rankscope.protocol.envelope import Envelope
from rankscope.protocol.errors import WireError
from rankscope.protocol.shard import MAX_SUMMARY_BYTES
from rankscope.stream_processors.arrivals import ARRIVAL_STEPS, ArrivalLedger
from rankscope.stream_processors.monitor import JobMonitor, slow_ranks
from rankscope.stream_processors.pipeline import TwoStage
from rankscope.stream_processors.shard import ShardJob
from rankscope.stream_processors.shard_summary import ShardSummary

S = Settings()
BUSY_NS = 15_000_000
LATENCY_NS = 1_000_000       # from the last arrival to the collective's end
T0_NS = 100 * 10**9


class Job:
    """A synchronous job: every rank leaves step s's collective ``offset(r)`` after it completes,
    works ``busy(r, s)`` and arrives; the collective completes LATENCY_NS after the last arrival."""

    def __init__(self, n: int = 4, seed: int = 1, shards: int = 4) -> None:
        self.n = n
        self.rng = random.Random(seed)
        self.step = 0
        self.t_ns = T0_NS
        self.mon = TwoStage(job="j", shards=shards)
        self.alerts: list[Alert] = []

    def noisy(self, sigma: float = 0.15) -> Callable[[int, int], int]:
        return lambda r, s: int(BUSY_NS * self.rng.lognormvariate(0, sigma))

    def run(self, steps: int, busy: Callable[[int, int], int], offset: Callable[[int], int] = lambda r: 0,
            settings: Settings = S, batch: int = 10, scan_every: int = 50,
            wait_share: Callable[[int], float] | None = None) -> list[Alert]:
        """Step the job ``steps`` times; ranks send every ``batch`` steps, the rules scan every
        ``scan_every`` (about once a second). With ``wait_share``, heartbeats carry each rank's
        training thread counters: it runs half of the time, and waits for a CPU that share of the
        time it is ready to run.
        Returns the alerts published meanwhile."""
        out: list[Alert] = []
        rows: dict[int, list[tuple[int, int, int, int]]] = {r: [] for r in range(self.n)}
        for _ in range(steps):
            s = self.step
            start = {r: self.t_ns + offset(r) for r in range(self.n)}
            arrive = {r: start[r] + busy(r, s) for r in range(self.n)}
            done = max(arrive.values()) + LATENCY_NS
            for r in range(self.n):
                end = done + offset(r)
                rows[r].append((s, start[r], end, end - arrive[r]))
            self.t_ns = done
            self.step += 1
            now = self.t_ns / 1e9
            if self.step % batch == 0:
                for r in range(self.n):
                    self.mon.apply(steps_env(r, rows[r]), now, settings)
                    el = self.t_ns - T0_NS
                    cpu = ([el // 2, round(el // 2 * wait_share(r) / (1 - wait_share(r)))]
                           if wait_share is not None else None)
                    self.mon.apply(hb_env(r, s, self.n, cpu), now, settings)
                    rows[r] = []
            if self.step % scan_every == 0:
                out += self.mon.scan(now, settings)
        self.alerts += out
        return out

    def now_s(self) -> float:
        return self.t_ns / 1e9


def steps_env(rank: int, rows: list[tuple[int, int, int, int]]) -> Envelope:
    return Envelope(kind="steps", job="j", rank=rank, host="h", pid=100 + rank, seq=1, sent_ns=0,
                    body={"step": [r[0] for r in rows], "start_ns": [r[1] for r in rows],
                          "end_ns": [r[2] for r in rows], "comm_ns": [r[3] for r in rows]})


def hb_env(rank: int, step: int, world: int, cpu: list[int] | None = None) -> Envelope:
    body = {"step": step, "since_step_s": 0.0, "dropped": 0, "world_size": world, "local_rank": rank,
            "stacks": None}
    if cpu is not None:
        body["cpu"] = cpu
    return Envelope(kind="heartbeat", job="j", rank=rank, host="h", pid=100 + rank, seq=1, sent_ns=0, body=body)


def opened(alerts: list[Alert]) -> list[Alert]:
    return [a for a in alerts if a.kind == "slow_rank" and a.status == "open"]


def test_healthy_noisy_job_of_2000_steps_raises_nothing():
    job = Job()
    assert job.run(2000, job.noisy(0.3)) == []
    assert set(job.mon.rank_states(job.now_s(), S).values()) == {"running"}
    assert job.now_s() - T0_NS / 1e9 > 30


def test_noise_that_alternates_between_ranks_never_opens_an_incident():
    # Every second (50 steps) another rank runs 2x slow, the ranks taking turns in a shuffled order:
    # each burst alone is a clear straggler over a 20-step window, none lasts over the rule's horizon.
    job = Job(seed=7)
    order: list[int] = []
    for _ in range(20):
        order += job.rng.sample(range(4), 4)
    noise = job.noisy(0.1)
    job.run(3000, lambda r, s: noise(r, s) * (2 if r == order[s // 50] else 1))
    assert job.alerts == [], [a.summary for a in job.alerts]


def test_busy_time_that_follows_the_place_in_the_collective_is_not_slow():
    # Ranks 1-3 leave each collective 5 ms after rank 0 and so work 5 ms less before they arrive
    # (measured on 2 shared cores: identical gloo ranks' busy times differ 1.3-1.7x for whole runs).
    # Rank 0's busy time is 1.4x its peers', yet it arrives last no more often than they do.
    job = Job(seed=3)
    noise = job.noisy(0.15)
    job.run(2000, lambda r, s: noise(r, s) + (5_000_000 if r == 0 else 0) - 3_000_000,
            offset=lambda r: 0 if r == 0 else 5_000_000)
    assert job.alerts == []
    assert job.mon.monitor.slow.watch == {}
    # What a comparison of busy medians makes of it:
    rows = job.mon.monitor.view(job.now_s(), S).rows
    flagged = slow_ranks({r: float(row.busy_med_ns) for r, row in rows.items()}, 2.0, 0.25)
    assert flagged[0][1]


def test_sustained_straggler_opens_exactly_one_incident_within_30_s():
    job = Job(seed=5)
    noise = job.noisy(0.15)
    job.run(3000, lambda r, s: int(noise(r, s) * (1.5 if r == 1 else 1)))
    slow = [a for a in job.alerts if a.kind == "slow_rank"]
    assert [a.ranks for a in opened(slow)] == [[1]]
    assert all(a.status != "resolved" and a.ranks == [1] for a in slow)
    assert (opened(slow)[0].opened_ns - T0_NS) / 1e9 <= 30
    d = slow[-1].details
    assert d["last_share"]["1"] > 0.9 and d["cost_share"]["1"] > S.straggler_cost_gate
    assert d["horizon_s"] >= S.straggler_min_s and d["horizon_steps"] >= S.straggler_min_slow_steps
    assert slow[-1].lost_rank_seconds > 0
    assert job.mon.rank_states(job.now_s(), S) == {0: "running", 1: "slow", 2: "running", 3: "running"}


def test_a_straggler_starved_of_cpu_is_said_to_be_and_one_that_is_not_is_not():
    job = Job(seed=5)
    noise = job.noisy(0.15)
    job.run(3000, lambda r, s: int(noise(r, s) * (1.5 if r == 1 else 1)),
            wait_share=lambda r: 0.9 if r == 1 else 0.03)
    slow = [a for a in job.alerts if a.kind == "slow_rank"]
    assert [a.ranks for a in opened(slow)] == [[1]]
    cpu = slow[-1].details["cpu_wait"]
    assert cpu["wait_share"] == {"1": 0.9} and cpu["cpu_share"] == {"1": 0.5}
    assert cpu["peers_median_wait_share"] == 0.03 and cpu["starved"] == [1]
    assert ("rank 1's training thread waited for a CPU 90% of the time it was ready to run over the last 30 s, "
            "its peers' median 3%") in slow[-1].summary

    # As slow, waiting for a CPU as long as its peers: the details say so, the summary blames nothing.
    job = Job(seed=5)
    job.run(3000, lambda r, s: int(noise(r, s) * (1.5 if r == 1 else 1)), wait_share=lambda r: 0.2)
    slow = [a for a in job.alerts if a.kind == "slow_rank"]
    assert [a.ranks for a in opened(slow)] == [[1]]
    cpu = slow[-1].details["cpu_wait"]
    assert cpu["wait_share"] == {"1": 0.2} and cpu["peers_median_wait_share"] == 0.2 and cpu["starved"] == []
    assert "CPU" not in slow[-1].summary

    # Ranks that do not report their threads (older versions): no CPU details at all.
    job = Job(seed=5)
    job.run(3000, lambda r, s: int(noise(r, s) * (1.5 if r == 1 else 1)))
    slow = [a for a in job.alerts if a.kind == "slow_rank"]
    assert slow and "cpu_wait" not in slow[-1].details


def test_straggler_below_the_cost_gate_is_shown_but_not_alerted():
    # Rank 2 arrives last at almost every step, 2% of a step behind: slow, but cheap.
    def cheap_straggler(job: Job) -> Callable[[int, int], int]:
        return lambda r, s: int(BUSY_NS * (1.02 if r == 2 else 1) * job.rng.uniform(0.999, 1.001))

    job = Job(seed=11)
    job.run(2000, cheap_straggler(job))
    assert job.alerts == []
    assert job.mon.rank_states(job.now_s(), S)[2] == "slow"
    watch = job.mon.monitor.slow.watch
    assert list(watch) == [2] and watch[2]["last_share"] > 0.9 and watch[2]["cost_share"] < S.straggler_cost_gate
    # The gate decides: the same job under a 1% gate is alerted.
    low = S.with_overrides(straggler_cost_gate=0.01)
    job = Job(seed=11)
    job.run(2000, cheap_straggler(job), settings=low)
    assert [a.ranks for a in opened(job.alerts)] == [[2]]


def test_rank_slow_from_mid_run_is_named_within_30_s_of_the_onset():
    job = Job(seed=9)
    noise = job.noisy(0.15)
    assert job.run(1000, noise) == []
    onset_s = job.now_s()
    job.run(1500, lambda r, s: int(noise(r, s) * (1.5 if r == 3 else 1)))
    [a] = opened(job.alerts)
    assert a.ranks == [3]
    assert 0 < a.opened_ns / 1e9 - onset_s <= 30, a.opened_ns / 1e9 - onset_s
    assert a.step >= 1000


def test_a_short_recovery_does_not_flap_and_the_end_of_the_slowdown_resolves_once():
    job = Job(seed=13)
    noise = job.noisy(0.15)

    def slow(r: int, s: int) -> int:
        return int(noise(r, s) * (1.5 if r == 1 else 1))

    job.run(1200, slow)
    job.run(60, noise)           # about a second of normal speed
    job.run(1200, slow)
    job.run(1500, noise)         # the slowdown ends
    slow_alerts = [a for a in job.alerts if a.kind == "slow_rank"]
    assert [(a.status, a.ranks) for a in slow_alerts if a.status != "update"] == [("open", [1]), ("resolved", [1])]
    assert len({a.alert_id for a in slow_alerts}) == 1
    assert "no rank holds the job back" in slow_alerts[-1].details["resolution"]
    assert slow_alerts[-1].lost_rank_seconds > 0 and job.mon.monitor.slow.lost_rank_seconds == 0


def test_shard_summaries_carry_bounded_valid_arrival_rows():
    job = Job(shards=1)
    job.run(1000, job.noisy())
    sj = next(iter(job.mon.shards.values()))
    summary = sj.summary(job.now_s(), S)
    rows = summary.agg["arrivals"]
    assert 0 < len(rows) <= ARRIVAL_STEPS and rows[-1][0] == 999
    assert all(len(r) == 5 and r[2] in range(4) and r[3] >= 0 and r[4] > 0 for r in rows)
    assert len(msgpack.packb(summary.to_body(), use_bin_type=True)) < MAX_SUMMARY_BYTES
    back = ShardSummary.from_body(msgpack.unpackb(msgpack.packb(summary.to_body()), strict_map_key=False))
    mon = JobMonitor(job="j")
    mon.add_summary(back)
    for bad in ([[1, 2, 3]], [[1, 2, 3, 4, "5"]], "x"):
        summary.agg["arrivals"] = bad
        with pytest.raises(WireError):
            mon.add_summary(summary)


def test_a_step_is_complete_once_every_shard_with_live_ranks_passed_it():
    ledger = ArrivalLedger()
    ledger.add(0, {"live": 2, "min_step": 9}, [(s, 1000 * s + 7, 0, 3, 100) for s in range(10)])
    ledger.add(1, {"live": 1, "min_step": 4}, [(s, 1000 * s + 9, 5, -1, 100) for s in range(5)])
    done = ledger.complete([0, 1])
    assert [st.step for st in done] == [0, 1, 2, 3, 4]
    assert all(st.rank == 5 and st.saving_ns == 2 for st in done)    # 9 vs shard 0's 7
    assert ledger.complete([0, 1]) == []
    ledger.add(1, {"live": 1, "min_step": 9}, [(s, 1000 * s + 1, 5, -1, 100) for s in range(5, 10)])
    assert [(st.rank, st.saving_ns) for st in ledger.complete([0, 1])] == [(0, 3)] * 5   # 7 vs 4 and 1


def test_straggler_settings_are_validated():
    for bad in ({"straggler_cost_gate": 1.5}, {"straggler_min_s": -1.0}, {"straggler_min_slow_steps": 1}):
        with pytest.raises(ConfigError):
            Settings(**bad)
    assert Settings.from_env({"RANKSCOPE_STRAGGLER_COST_GATE": "0.1"}).straggler_cost_gate == 0.1


def test_a_shard_that_restarts_mid_job_does_not_count_steps_twice():
    job = Job(shards=1)
    job.run(300, job.noisy())
    sj = next(iter(job.mon.shards.values()))
    again = ShardJob("j", sj.shard)
    for r in range(4):    # a worker rebuilding the partition reads the same records again
        again.apply(steps_env(r, [(s, 0, 10, 5) for s in range(280, 300)]), job.now_s(), S)
    mon = job.mon.monitor
    before = len(mon.slow.ledger.steps)
    mon.add_summary(again.summary(job.now_s() + 1, S))
    mon.scan(job.now_s() + 1, S)
    assert len(mon.slow.ledger.steps) == before
