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


def test_the_wait_share_is_of_the_ready_time_over_the_last_30_s_once_the_beats_span_5():
    st = RankState(rank=0)
    for t in range(0, 5):           # 0-4 s: runs half the time, waits an eighth: 20% of its ready time
        st.add_cpu(t * SEC, t * SEC // 2, t * SEC // 8)
    assert st.cpu_wait_pm is None    # 4 s: too short to judge
    st.add_cpu(5 * SEC, 5 * SEC // 2, 5 * SEC // 8)
    assert st.cpu_wait_pm == (200, 500)
    runq = 5 * SEC // 8
    for t in range(6, 61):          # 5-60 s: waits as long as it runs
        runq += SEC // 2
        st.add_cpu(t * SEC, t * SEC // 2, runq)
    assert st.cpu_wait_pm == (500, 500)     # the first 5 s are outside the window
    assert len(st.cpu_marks) <= CPU_MARKS
    st.add_cpu(59 * SEC, 0, 0)      # older than the newest: ignored
    assert st.cpu_last[0] == 60 * SEC
    st.add_cpu(61 * SEC, 10, 0)     # counters went back (a new thread): starts over
    assert st.cpu_wait_pm is None and st.cpu_marks == [(61 * SEC, 10, 0)]


def test_a_thread_seldom_ready_waited_for_no_cpu():
    st = RankState(rank=0)
    for t in range(0, 11):          # blocked nearly all the time: ready 1% of it, half of that waiting
        st.add_cpu(t * SEC, t * SEC // 200, t * SEC // 200)
    assert st.cpu_wait_pm == (0, 5)


def test_a_compute_straggler_is_not_starved_and_a_rank_denied_the_cpu_is():
    """The demo's straggler computes 6x while its peers wait in the collective: it is ready six times
    as long and waits six times as long in seconds, but gets a CPU as readily as they do."""
    def share(cpu_per_s: float, runq_per_s: float) -> float:
        st = RankState(rank=0)
        for t in range(0, 31):
            st.add_cpu(t * SEC, int(t * SEC * cpu_per_s), int(t * SEC * runq_per_s))
        assert st.cpu_wait_pm is not None
        return st.cpu_wait_pm[0] / 1000
    peers = share(0.08, 0.08)
    assert share(0.48, 0.48) == peers == 0.5 and not cpu_wait.starved(share(0.48, 0.48), peers)
    assert cpu_wait.starved(share(0.1, 0.9), peers)


def test_a_shard_sends_a_histogram_and_the_longest_waiters_and_a_restart_forgets():
    job = ShardJob("j", 0)
    for r in range(20):
        runq = 0.5 if r == 3 else 0.02 * (r % 2)     # rank 3 waits half its ready time, the others 0 or 3.8%
        for t in range(0, 11):
            job.apply(beat(r, 100 + t, t * SEC // 2, int(t * SEC * runq)), 111.0, S)
    agg = job.summary(111.0, S).agg
    hist, top = wire.cpu_wait(agg)
    assert sum(hist.values()) == 20 and hist[10] == 1 and hist[0] == 19
    assert len(top) == wire.MAX_CPU_WAIT_TOP and top[0] == (3, 500, 500)
    stats = {e["rank"]: e for chunk in job.stats_chunks(111.0, S) for e in chunk}
    assert stats[3]["cpu_wait"] == 0.5 and stats[1]["cpu_wait"] == 0.038 and stats[2]["cpu_wait"] == 0
    job.apply(beat(3, 111, 1, 1, pid=8), 111.0, S)       # rank 3 restarted: not judged until it spans 5 s
    assert 3 not in [r for r, _, _ in wire.cpu_wait(job.summary(111.0, S).agg)[1]]


def test_the_evidence_names_a_starved_slow_rank_against_its_peers():
    parts = [({0: 2, 18: 1}, [(1, 900, 100), (0, 30, 600), (2, 20, 600)])]
    ev = cpu_wait.evidence(parts, [1])
    assert ev["wait_share"] == {"1": 0.9} and ev["cpu_share"] == {"1": 0.1}
    assert ev["peers_median_wait_share"] == 0.025 and ev["starved"] == [1]
    assert cpu_wait.evidence(parts, [5]) is None                     # its wait is unknown
    # A large job: most ranks are only in the histograms; the median is a bin's centre.
    big = [({0: 10, 1: 60, 16: 1}, [(7, 800, 150)]), ({1: 40, 2: 10}, [(40, 110, 600)])]
    ev = cpu_wait.evidence(big, [7])
    assert ev["peers_median_wait_share"] == 0.075 and ev["starved"] == [7]
    ev = cpu_wait.evidence(big, [40])
    assert ev["starved"] == []          # 11% against a median of 7.5%: it gets a CPU almost as readily
    assert not cpu_wait.starved(0.49, 0.0) and cpu_wait.starved(0.5, 0.0)
    assert not cpu_wait.starved(0.6, 0.5) and cpu_wait.starved(0.75, 0.5)
