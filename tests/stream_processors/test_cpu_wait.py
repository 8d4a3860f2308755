"""A rank's run-queue wait share (rank_state.py), the shards' summaries of it (shard.py) and the
slow-rank alert's evidence from them (cpu_wait.py)."""

from __future__ import annotations

from rankscope.config import Settings
from rankscope.protocol import shard as wire
from rankscope.protocol.envelope import Envelope
from rankscope.stream_processors import cpu_wait
from rankscope.stream_processors.rank_state import CPU_MARKS, RankState
from rankscope.stream_processors.shard import ShardJob

S = Settings()
SEC = 10**9


def beat(rank: int, t_s: float, cpu_ns: int, runq_ns: int, pid: int = 7) -> Envelope:
    return Envelope(kind="heartbeat", job="j", rank=rank, host="h", pid=pid, seq=1, sent_ns=int(t_s * SEC),
                    body={"step": 1, "since_step_s": 0.0, "dropped": 0, "world_size": 4, "local_rank": 0,
                          "stacks": None, "cpu": [cpu_ns, runq_ns]})


def test_the_wait_share_is_over_the_last_30_s_once_the_beats_span_5():
    st = RankState(rank=0)
    for t in range(0, 5):           # 0-4 s: waits 10% of the time
        st.add_cpu(t * SEC, t * SEC // 2, t * SEC // 10)
    assert st.cpu_wait_pm is None    # 4 s: too short to judge
    st.add_cpu(5 * SEC, 5 * SEC // 2, 5 * SEC // 10)
    assert st.cpu_wait_pm == (100, 500)
    runq = 5 * SEC // 10
    for t in range(6, 61):          # 5-60 s: waits 60% of the time
        runq += 6 * SEC // 10
        st.add_cpu(t * SEC, t * SEC // 2, runq)
    assert st.cpu_wait_pm == (600, 500)     # the first 5 s are outside the window
    assert len(st.cpu_marks) <= CPU_MARKS
    st.add_cpu(59 * SEC, 0, 0)      # older than the newest: ignored
    assert st.cpu_last[0] == 60 * SEC
    st.add_cpu(61 * SEC, 10, 0)     # counters went back (a new thread): starts over
    assert st.cpu_wait_pm is None and st.cpu_marks == [(61 * SEC, 10, 0)]


def test_a_shard_sends_a_histogram_and_the_longest_waiters_and_a_restart_forgets():
    job = ShardJob("j", 0)
    for r in range(20):
        share = 0.5 if r == 3 else 0.02 * (r % 3)
        for t in range(0, 11):
            job.apply(beat(r, 100 + t, t * SEC // 2, int(t * SEC * share)), 111.0, S)
    agg = job.summary(111.0, S).agg
    hist, top = wire.cpu_wait(agg)
    assert sum(hist.values()) == 20 and hist[10] == 1 and hist[0] == 19
    assert len(top) == wire.MAX_CPU_WAIT_TOP and top[0] == (3, 500, 500)
    stats = {e["rank"]: e for chunk in job.stats_chunks(111.0, S) for e in chunk}
    assert stats[3]["cpu_wait"] == 0.5 and stats[1]["cpu_wait"] == 0.02     # worker_stats.cpu_wait_share
    job.apply(beat(3, 111, 1, 1, pid=8), 111.0, S)       # rank 3 restarted: not judged until it spans 5 s
    assert 3 not in [r for r, _, _ in wire.cpu_wait(job.summary(111.0, S).agg)[1]]


def test_the_evidence_names_a_starved_slow_rank_against_its_peers():
    parts = [({0: 2, 9: 1}, [(1, 450, 500), (0, 30, 600), (2, 20, 600)])]
    ev = cpu_wait.evidence(parts, [1])
    assert ev["wait_share"] == {"1": 0.45} and ev["cpu_share"] == {"1": 0.5}
    assert ev["peers_median_wait_share"] == 0.025 and ev["starved"] == [1]
    assert cpu_wait.evidence(parts, [5]) is None                     # its wait is unknown
    # A large job: most ranks are only in the histograms; the median is a bin's centre.
    big = [({0: 10, 1: 60, 8: 1}, [(7, 420, 300)]), ({1: 40, 2: 10}, [(40, 110, 600)])]
    ev = cpu_wait.evidence(big, [7])
    assert ev["peers_median_wait_share"] == 0.075 and ev["starved"] == [7]
    ev = cpu_wait.evidence(big, [40])
    assert ev["starved"] == []          # 11% against a median of 7.5%: not far enough above
    assert not cpu_wait.starved(0.09, 0.0) and cpu_wait.starved(0.10, 0.0) and not cpu_wait.starved(0.3, 0.15)
