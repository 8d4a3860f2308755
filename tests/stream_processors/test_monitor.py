"""Detection rules replayed with an injected time (no Kafka), through both stages: ranks spread
over shards, job-wide rules on the shards' summaries."""

from __future__ import annotations

from rankscope.config import Settings
from rankscope.protocol.envelope import Envelope
from rankscope.stream_processors.monitor import JobMonitor, slow_ranks
from rankscope.stream_processors.pipeline import TwoStage
from rankscope.stream_processors.stacks import waiting_in_collective

# 10 ms steps: the slow-rank rule judges the last 0.2 s (21 steps) here; tests/stream_processors/
# test_slow_rule.py runs it at its defaults on longer jobs.
S = Settings(hang_min_s=10, hang_factor=8, dead_after_s=6, straggler_window=20, straggler_min_steps=8,
             straggler_z=4, straggler_min_rel=0.5, straggler_persist=3, straggler_min_s=0.2)
STEP_NS = 10_000_000
HANG_FRAMES = ["train.py:10 <module>", "train.py:40 train", "train.py:20 hang_forever"]
WAIT_FRAMES = ["train.py:10 <module>", "train.py:42 train",
               "producers/collectives.py:50 _rankscope_timed_collective",
               "torch/distributed/c10d_logger.py:81 wrapper"]


def env(kind, rank, body, seq=1):
    return Envelope(kind=kind, job="j", rank=rank, host="h", pid=100 + rank, seq=seq, sent_ns=0, body=body)


def steps(rank, first, n, busy_ns, step_ns=STEP_NS):
    s = list(range(first, first + n))
    start = [i * step_ns for i in s]
    return env("steps", rank, {"step": s, "start_ns": start, "end_ns": [a + step_ns for a in start],
                               "comm_ns": [step_ns - busy_ns] * n})


def hb(rank, step, since, stacks=None):
    return env("heartbeat", rank, {"step": step, "since_step_s": since, "dropped": 0, "world_size": 4,
                                   "local_rank": rank, "stacks": stacks})


def feed_healthy(mon, now, first=0, n=30, slow_rank=None):
    for r in range(4):
        mon.apply(steps(r, first, n, 8_000_000 if r == slow_rank else 2_000_000), now, S)
        mon.apply(hb(r, first + n - 1, 0.0), now, S)


def test_healthy_job_raises_nothing():
    mon = TwoStage(job="j")
    alerts = []
    for i in range(10):
        feed_healthy(mon, 100.0 + i, first=i * 10, n=10)
        alerts += mon.scan(100.0 + i, S)
    assert alerts == []
    assert set(mon.rank_states(110.0, S).values()) == {"running"}


def test_slow_rank_needs_persistence_then_alerts_and_resolves():
    mon = TwoStage(job="j")
    out = []
    for i in range(6):
        feed_healthy(mon, 100.0 + i, first=i * 10, n=10, slow_rank=2)
        out.append(mon.scan(100.0 + i, S))
    opened = [a for batch in out for a in batch if a.status == "open"]
    assert len(opened) == 1 and opened[0].kind == "slow_rank" and opened[0].ranks == [2]
    # not before straggler_persist evaluations with enough steps
    assert out[0] == [] and out[1] == []
    assert opened[0].details["baseline_busy_ms"] == 2.0
    # the slowdown ends: resolved
    res = []
    for i in range(6, 12):
        feed_healthy(mon, 100.0 + i, first=i * 10, n=20)
        res += mon.scan(100.0 + i, S)
    assert [a.status for a in res if a.kind == "slow_rank"][-1] == "resolved"


def test_hang_names_culprit_by_stack_and_groups_waiters():
    mon = TwoStage(job="j")
    feed_healthy(mon, 100.0, n=30)
    assert mon.scan(100.0, S) == []
    for r in range(4):
        frames = HANG_FRAMES if r == 3 else WAIT_FRAMES
        mon.apply(hb(r, 29, 12.0, [{"thread": "MainThread", "frames": frames}]), 112.0, S)
    alerts = mon.scan(112.0, S)
    assert len(alerts) == 1
    a = alerts[0]
    assert a.kind == "hang" and a.status == "open" and a.ranks == [3] and a.step == 29
    assert "hang_forever" in a.summary
    groups = {tuple(g.ranks): g for g in a.stack_groups}
    assert groups[(3,)].waiting_in_collective is False
    assert groups[(0, 1, 2)].waiting_in_collective is True
    # same incident: no duplicate alert on the next scan
    for r in range(4):
        frames = HANG_FRAMES if r == 3 else WAIT_FRAMES
        mon.apply(hb(r, 29, 13.0, [{"thread": "MainThread", "frames": frames}]), 113.0, S)
    assert mon.scan(113.0, S) == []
    assert mon.rank_states(113.0, S) == {0: "waiting", 1: "waiting", 2: "waiting", 3: "hung"}
    # Stage one's stats rows cannot tell the culprit from the ranks it blocks: every rank waits there,
    # and the dashboard names the culprit from the hang alert.
    rows = [row for sj in mon.shards.values() for chunk in sj.stats_chunks(113.0, S) for row in chunk]
    assert {row["rank"]: row["state"] for row in rows} == {0: "waiting", 1: "waiting", 2: "waiting", 3: "waiting"}
    # progress resumes: resolved, same id
    feed_healthy(mon, 114.0, first=30, n=5)
    res = mon.scan(114.0, S)
    assert [(x.kind, x.status, x.alert_id) for x in res] == [("hang", "resolved", a.alert_id)]


def test_dead_rank_is_first_silent_and_exit_is_not_death():
    mon = TwoStage(job="j")
    feed_healthy(mon, 100.0, n=30)
    mon.apply(env("exit", 0, {"step": 29, "reason": "completed", "detail": ""}), 101.0, S)
    for t in range(101, 110):
        for r in (1, 2):
            mon.apply(hb(r, 29, 0.5), float(t), S)
    alerts = mon.scan(109.0, S)
    dead = [a for a in alerts if a.kind == "dead_rank"]
    assert len(dead) == 1 and dead[0].ranks == [3]
    assert mon.rank_states(109.0, S)[0] == "exited"


def test_helpers():
    flagged = slow_ranks({0: 2.0e6, 1: 2.1e6, 2: 8e6, 3: 1.9e6}, 4, 0.5)
    assert [r for r, (_, f) in flagged.items() if f] == [2]
    assert waiting_in_collective(WAIT_FRAMES) and not waiting_in_collective(HANG_FRAMES)


def test_backlog_read_at_once_still_finds_the_slow_rank():
    # A processor that starts late reads 200 steps per rank in one go, then the job goes on: the
    # slowness must persist for straggler_persist evaluations before it is named, backlog or not.
    mon = TwoStage(job="j")
    for first in range(0, 200, 20):
        for r in range(4):
            mon.apply(steps(r, first, 20, 8_000_000 if r == 1 else 2_000_000), 100.0, S)
    alerts = mon.scan(100.0, S)
    for i in range(1, S.straggler_persist):
        for r in range(4):
            mon.apply(steps(r, 200 + 20 * (i - 1), 20, 8_000_000 if r == 1 else 2_000_000), 100.0 + i, S)
        alerts += mon.scan(100.0 + i, S)
    assert (alerts[0].kind, alerts[0].status, alerts[0].ranks) == ("slow_rank", "open", [1])
    assert all(a.kind == "slow_rank" and a.ranks == [1] for a in alerts)


def test_waiters_crossing_the_threshold_first_are_not_named():
    mon = TwoStage(job="j")
    feed_healthy(mon, 100.0, n=30)
    wait = [{"thread": "MainThread", "frames": WAIT_FRAMES}]
    # Ranks 0 and 2 report first: stalled and waiting in a collective; 1 and 3 not over the threshold yet.
    for r in (0, 2):
        mon.apply(hb(r, 29, 11.0, wait), 111.0, S)
    for r in (1, 3):
        mon.apply(hb(r, 29, 9.0), 111.0, S)
    assert mon.scan(111.0, S) == []                       # not ranks 0,2: they are the victims
    for r in range(4):
        frames = HANG_FRAMES if r == 3 else WAIT_FRAMES
        mon.apply(hb(r, 29, 12.0, [{"thread": "MainThread", "frames": frames}]), 112.0, S)
    [a] = mon.scan(112.0, S)
    assert a.kind == "hang" and a.ranks == [3]


def test_partial_stall_of_waiters_is_named_after_the_grace_period():
    mon = TwoStage(job="j")
    feed_healthy(mon, 100.0, n=30)
    wait = [{"thread": "MainThread", "frames": WAIT_FRAMES}]
    grace = JobMonitor.partial_stall_grace_s(S)
    t = 111.0
    while True:                                           # ranks 1 and 3 keep stepping; 0 and 2 wait
        for r in (0, 2):
            mon.apply(hb(r, 29, t - 100.0, wait), t, S)
        for r in (1, 3):
            mon.apply(hb(r, 29, 0.5), t, S)
        alerts = mon.scan(t, S)
        if alerts or t > 111.0 + grace + 2:
            break
        t += 1.0
    assert [a.ranks for a in alerts] == [[0, 2]] and t >= 111.0 + grace


def test_progress_rows_plan_one_start_step_for_every_rank():
    from rankscope.trace_start import plan_start_step

    mon = TwoStage(job="j")
    feed_healthy(mon, 100.0, first=0, n=30)
    rows = mon.progress_rows(100.0, S)
    assert [(r["rank"], r["step"], r["median_step_ns"]) for r in rows] == [(k, 29, STEP_NS) for k in range(4)]
    last_end = rows[0]["ts_ns"]
    assert last_end == 30 * STEP_NS
    # One second after the last step ended, one second ahead, 10 ms steps: 200 steps on, plus 1 and 2.
    assert plan_start_step(rows, last_end + 10**9, 10**9, faster=1.0) == 29 + 1 + 200 + 2
    assert plan_start_step(TwoStage(job="k").progress_rows(0.0, S), 0, 10**9) == 0


def test_slow_rank_is_judged_against_its_peers_not_a_group_it_inflates():
    # 4 ranks, rank 1 4x slower and rank 3 noisy (seen on 2 shared cores): with rank 1 inside its own
    # baseline, median/MAD of {4.2, 4.2, 8.1, 16.5} gave it z 3.6, under the threshold of 4.
    flagged = slow_ranks({0: 4.2e6, 1: 16.5e6, 2: 4.2e6, 3: 8.1e6}, 4, 0.25)
    assert flagged[1][1] and flagged[1][0] > 4
    assert not flagged[0][1] and not flagged[2][1]
    # Many ranks with a wide natural spread: the top one is 28% above the rest but not an outlier.
    spread = {r: 10e6 + 7e6 * r / 15 for r in range(16)}
    assert not any(f for _, f in slow_ranks(spread, 4, 0.25).values())


def test_slow_rank_alerts_although_a_noisy_peer_moves_the_group():
    # Rank 3 alternates between 2 and 4 ms busy per window of 20 steps; rank 1 is 4x slow throughout.
    # Every evaluation must flag rank 1, so the alert opens after straggler_persist evaluations.
    mon = TwoStage(job="j")
    opened = []
    for i in range(8):
        for r in range(4):
            busy = {1: 8_000_000, 3: 4_000_000 if i % 2 else 2_000_000}.get(r, 2_000_000)
            mon.apply(steps(r, i * 20, 20, busy), 100.0 + i, S)
            mon.apply(hb(r, i * 20 + 19, 0.0), 100.0 + i, S)
        opened += [a for a in mon.scan(100.0 + i, S) if a.status == "open"]
    assert [(a.kind, a.ranks) for a in opened] == [("slow_rank", [1])]


def test_tearing_down_a_hung_job_keeps_the_culprit_named():
    # Rank 3 hangs and is named. The job is killed: rank 3 and two waiters exit (signal, exception)
    # while rank 0 is still stuck. The incident stays rank 3's; it resolves once no rank is left.
    mon = TwoStage(job="j")
    feed_healthy(mon, 100.0, n=30)
    for r in range(4):
        frames = HANG_FRAMES if r == 3 else WAIT_FRAMES
        mon.apply(hb(r, 29, 12.0, [{"thread": "MainThread", "frames": frames}]), 112.0, S)
    [opened] = mon.scan(112.0, S)
    assert opened.ranks == [3]
    for r, reason in ((3, "signal"), (1, "exception"), (2, "exception")):
        mon.apply(env("exit", r, {"step": 29, "reason": reason, "detail": ""}), 113.0, S)
    mon.apply(hb(0, 29, 13.0, [{"thread": "MainThread", "frames": WAIT_FRAMES}]), 113.0, S)
    assert mon.scan(113.0, S) == []
    assert mon.scan(114.0, S) == []
    assert mon.incidents["hang"]["ranks"] == [3]
    mon.apply(env("exit", 0, {"step": 29, "reason": "signal", "detail": ""}), 115.0, S)
    [resolved] = mon.scan(115.0, S)
    assert (resolved.kind, resolved.status, resolved.ranks) == ("hang", "resolved", [3])
    assert "exited" in resolved.details["resolution"]


def test_rolling_upgrade_v1_ranks_beside_v2_ranks_and_a_rank_that_moves_shard():
    # v1 ranks key by job: all on shard 0; v2 ranks (kind beat) key by rank: rank % 4. Rank 1 is
    # upgraded mid-run: its v1 process exits, a new v2 process of rank 1 goes on from another shard.
    upgraded = set()
    mon = TwoStage(job="j", shard_of=lambda e: e.rank % 4 if e.kind == "beat" or e.rank in upgraded else 0)

    def v2(rank, first, n, t, since=0.0, stacks=None, pid_offset=0):
        s = steps(rank, first, n, 2_000_000)
        body = {**s.body, "hb_step": first + n - 1, "since_step_s": since, "dropped": 0, "world_size": 4,
                "local_rank": rank, "stacks": stacks}
        return Envelope(kind="beat", job="j", rank=rank, host="h", pid=100 + rank + pid_offset, seq=1,
                        sent_ns=0, body=body)

    alerts = []
    for i in range(6):
        t = 100.0 + i
        for r in (0, 1):
            if r == 1 and i >= 3:
                continue
            mon.apply(steps(r, i * 10, 10, 2_000_000), t, S)
            mon.apply(hb(r, i * 10 + 9, 0.0), t, S)
        if i == 3:
            mon.apply(env("exit", 1, {"step": 29, "reason": "signal", "detail": "SIGTERM"}), t, S)
            upgraded.add(1)
        if i >= 3:
            mon.apply(v2(1, i * 10, 10, t, pid_offset=1000), t, S)
        for r in (2, 3):
            mon.apply(v2(r, i * 10, 10, t), t, S)
        alerts += mon.scan(t, S)
    assert alerts == [], [a.summary for a in alerts]
    assert mon.rank_states(105.0, S) == {0: "running", 1: "running", 2: "running", 3: "running"}
    # Rank 2 (v2) hangs; every other rank waits in a collective: rank 2 is named.
    t = 117.0
    for r in (0,):
        mon.apply(hb(r, 59, 12.0, [{"thread": "MainThread", "frames": WAIT_FRAMES}]), t, S)
    mon.apply(v2(1, 60, 0, t, 12.0, [{"thread": "MainThread", "frames": WAIT_FRAMES}], pid_offset=1000), t, S)
    mon.apply(v2(3, 60, 0, t, 12.0, [{"thread": "MainThread", "frames": WAIT_FRAMES}]), t, S)
    mon.apply(v2(2, 60, 0, t, 12.0, [{"thread": "MainThread", "frames": HANG_FRAMES}]), t, S)
    [a] = [a for a in mon.scan(t, S) if a.kind == "hang"]
    assert a.ranks == [2] and "hang_forever" in a.summary


def test_a_slow_rank_that_hangs_leaves_the_slow_incident_at_once():
    mon = TwoStage(job="j")
    opened = []
    for i in range(6):
        feed_healthy(mon, 100.0 + i, first=i * 10, n=10, slow_rank=2)
        opened += [a for a in mon.scan(100.0 + i, S) if a.status == "open"]
    assert [a.ranks for a in opened] == [[2]]
    # rank 2 stops stepping; the others go on
    t = 106.0
    for k in range(12):
        for r in (0, 1, 3):
            mon.apply(steps(r, 60 + k, 1, 2_000_000), t + k, S)
            mon.apply(hb(r, 60 + k, 0.0), t + k, S)
        mon.apply(hb(2, 59, float(k + 1)), t + k, S)
        out = [a for a in mon.scan(t + k, S) if a.kind == "slow_rank"]
        if out:
            break
    assert [(a.status, a.details["resolution"]) for a in out] == [("resolved", "rank 2 stopped stepping")]
    assert k + 1 > S.hang_min_s   # once it crossed the hang threshold, not before


def test_a_slow_rank_waiting_for_a_hung_peer_stays_slow():
    mon = TwoStage(job="j")
    for i in range(6):
        feed_healthy(mon, 100.0 + i, first=i * 10, n=10, slow_rank=2)
        mon.scan(100.0 + i, S)
    assert mon.incidents["slow_rank"]["ranks"] == [2]
    for k in range(1, 14):   # rank 3 hangs; the others, rank 2 included, wait in all_reduce
        for r in range(4):
            frames = HANG_FRAMES if r == 3 else WAIT_FRAMES
            mon.apply(hb(r, 59, float(k), [{"thread": "MainThread", "frames": frames}]), 105.0 + k, S)
        mon.scan(105.0 + k, S)
    assert mon.incidents["hang"]["ranks"] == [3]
    assert mon.incidents["slow_rank"]["ranks"] == [2]
    assert mon.rank_states(118.0, S)[2] in ("slow", "waiting")
