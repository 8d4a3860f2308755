"""Crash attribution (rank_failed) through both stages of the processors, with an injected time."""

from __future__ import annotations

import msgpack
import pytest

from rankscope.config import Settings
from rankscope.protocol.envelope import Envelope, decode, encode
from rankscope.protocol.errors import WireError
from rankscope.protocol.shard import MAX_SUMMARY_BYTES
from rankscope.stream_processors.failures import attribute, is_peer_error
from rankscope.stream_processors.pipeline import TwoStage
from rankscope.stream_processors.shard import ShardJob
from rankscope.stream_processors.shard_summary import Failure, ShardSummary

S = Settings(hang_min_s=10, hang_factor=8, dead_after_s=6, scan_interval_s=1.0)
STEP_NS = 10_000_000
TRACEBACK = ["train.py:90 <module>", "train.py:60 train", "model.py:12 forward"]


def env(kind, rank, body, sent_s, pid=None):
    return Envelope(kind=kind, job="j", rank=rank, host=f"node{rank // 8}", pid=pid or 100 + rank, seq=1,
                    sent_ns=int(sent_s * 1e9), body=body)


def beat(rank, first, n, sent_s, pid=None):
    s = list(range(first, first + n))
    start = [int(sent_s * 1e9) - (first + n - i) * STEP_NS for i in s]
    return env("beat", rank, {"step": s, "start_ns": start, "end_ns": [a + STEP_NS for a in start],
                              "comm_ns": [STEP_NS // 2] * n, "hb_step": first + n - 1, "since_step_s": 0.0,
                              "dropped": 0, "world_size": 4, "local_rank": rank % 8, "stacks": None}, sent_s, pid)


def exit_exc(rank, step, sent_s, detail, exc_type="", frames=None):
    body = {"step": step, "reason": "exception", "detail": detail}
    if exc_type:
        body["exc_type"] = exc_type
    if frames is not None:
        body["frames"] = frames
    return env("exit", rank, body, sent_s)


def exit_signal(rank, step, sent_s, name="SIGTERM"):
    return env("exit", rank, {"step": step, "reason": "signal", "detail": name}, sent_s)


def heartbeat(rank, step, sent_s):
    return env("heartbeat", rank, {"step": step, "since_step_s": 0.2, "dropped": 0, "world_size": 4,
                                   "local_rank": rank, "stacks": None}, sent_s)


def run_job(mon, t0, steps=40):
    for r in range(4):
        mon.apply(beat(r, 0, steps, t0), t0, S)
    assert mon.scan(t0, S) == []


def test_first_failing_rank_is_named_once_with_its_exception_and_followers():
    mon = TwoStage(job="j")
    run_job(mon, 100.0)
    # rank 2 raises at step 40; its peers see the connection close after it, and one gets SIGTERM
    mon.apply(exit_exc(2, 39, 100.5, "RuntimeError: CUDA error: an illegal memory access was encountered",
                       "RuntimeError", TRACEBACK), 101.0, S)
    mon.apply(exit_exc(0, 39, 100.6, "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                       "Connection closed by peer [127.0.0.1]:29500"), 101.0, S)
    mon.apply(exit_exc(1, 39, 100.7, "DistBackendError: Connection reset by peer"), 101.0, S)
    assert mon.scan(101.0, S) == []            # waits for the other shards' failures to arrive
    mon.apply(exit_signal(3, 39, 100.9), 102.0, S)
    alerts = []
    for t in (102.0, 103.0, 104.0, 105.0, 106.0, 110.0):
        alerts += mon.scan(t, S)
    failed = [a for a in alerts if a.kind == "rank_failed"]
    assert [a.status for a in failed] == ["open"]
    a = failed[0]
    assert a.ranks == [2] and a.step == 40 and a.severity == "critical"
    assert a.details["exc_type"] == "RuntimeError" and "illegal memory access" in a.details["message"]
    assert a.details["frames"] == TRACEBACK and a.stack_groups[0].frames == TRACEBACK
    assert a.details["followers"] == [0, 1, 3] and a.details["follower_count"] == 3
    assert a.details["last_completed_step"] == 39
    assert "rank 2 failed first, in step 40" in a.summary and "3 ranks failed after it" in a.summary
    assert mon.rank_states(110.0, S)[2] == "exited:exception"


def test_culprit_whose_exit_arrives_later_is_still_first_by_event_time():
    mon = TwoStage(job="j")
    run_job(mon, 100.0)
    mon.apply(exit_exc(1, 39, 100.8, "RuntimeError: Connection closed by peer"), 101.0, S)
    assert mon.scan(101.0, S) == []
    mon.apply(exit_exc(3, 40, 100.2, "ValueError: bad batch"), 102.0, S)   # sent first, arrives late
    alerts = [a for t in (102.0, 103.0, 104.0, 105.0) for a in mon.scan(t, S)]
    opened = [a for a in alerts if a.kind == "rank_failed" and a.status == "open"]
    assert len(opened) == 1 and opened[0].ranks == [3] and opened[0].details["exc_type"] == "ValueError"
    assert opened[0].details["followers"] == [1]


def test_followers_that_fail_later_update_the_same_incident():
    mon = TwoStage(job="j")
    run_job(mon, 100.0)
    mon.apply(exit_exc(0, 40, 100.1, "AssertionError: loss is nan"), 100.2, S)

    def scan(t: float) -> list:       # ranks 2 and 3 are alive: they beat every second
        for r in (2, 3):
            mon.apply(heartbeat(r, 39, t), t, S)
        return mon.scan(t, S)

    first = [a for t in (101.0, 102.0, 103.0, 104.0, 105.0) for a in scan(t) if a.kind == "rank_failed"]
    assert [(a.status, a.ranks, a.details["follower_count"]) for a in first] == [("open", [0], 0)]
    mon.apply(exit_exc(1, 39, 105.5, "RuntimeError: Connection closed by peer"), 106.0, S)
    later = [a for t in (106.0, 107.0) for a in scan(t) if a.kind == "rank_failed"]
    assert [(a.status, a.alert_id, a.details["followers"]) for a in later] == [("update", first[0].alert_id, [1])]


def test_ranks_stopped_by_signals_only_are_not_a_failure():
    mon = TwoStage(job="j")
    run_job(mon, 100.0)
    for r in range(4):
        mon.apply(exit_signal(r, 39, 100.5), 101.0, S)
    assert [a for t in (101.0, 105.0, 110.0) for a in mon.scan(t, S) if a.kind == "rank_failed"] == []


def test_restarted_rank_resolves_the_incident():
    mon = TwoStage(job="j")
    run_job(mon, 100.0)
    mon.apply(exit_exc(2, 40, 100.5, "RuntimeError: boom"), 101.0, S)
    opened = [a for t in (104.0, 105.0) for a in mon.scan(t, S) if a.kind == "rank_failed"]
    assert len(opened) == 1 and opened[0].details["exc_type"] == "RuntimeError"   # from the detail (v1 exits)
    mon.apply(beat(2, 0, 5, 110.0, pid=999), 110.0, S)     # the launcher restarted it
    for r in (0, 1, 3):
        mon.apply(beat(r, 40, 5, 110.0), 110.0, S)
    res = [a for a in mon.scan(110.0, S) if a.kind == "rank_failed"]
    assert [(a.status, a.alert_id) for a in res] == [("resolved", opened[0].alert_id)]


def test_hang_whose_culprit_crashed_says_so():
    mon = TwoStage(job="j")
    s = Settings(hang_min_s=5, hang_factor=8, dead_after_s=60)
    for r in range(4):
        mon.apply(beat(r, 0, 40, 100.0), 100.0, s)
    mon.apply(exit_exc(1, 40, 100.5, "RuntimeError: CUDA error: device-side assert triggered"), 101.0, s)
    hangs = []
    for t in range(101, 120):
        for r in (0, 2, 3):   # NCCL-like: the peers keep beating while they wait in the collective
            mon.apply(env("heartbeat", r, {"step": 39, "since_step_s": t - 100.0, "dropped": 0, "world_size": 4,
                                           "local_rank": r, "stacks": None}, float(t)), float(t), s)
        hangs += [a for a in mon.scan(float(t), s) if a.kind == "hang"]
    assert hangs and hangs[0].ranks == [1] and hangs[0].details["culprit_crashed"] is True
    assert "which crashed" in hangs[0].summary and "device-side assert" in hangs[0].summary


def test_killed_rank_with_no_exit_record_is_the_culprit_and_peers_with_connection_errors_follow():
    mon = TwoStage(job="j")
    run_job(mon, 100.0)
    # rank 2 is SIGKILLed after step 39 (OOM killer): nothing more from it. Its peers beat once more,
    # then their all_reduce sees the connection close; the first of them fails before rank 2 looks silent.
    for r in (0, 1, 3):
        mon.apply(heartbeat(r, 39, 100.3), 100.3, S)
    mon.apply(exit_exc(0, 39, 100.6, "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                       "Connection closed by peer [127.0.0.1]:29500", "RuntimeError"), 100.7, S)
    mon.apply(exit_exc(1, 39, 100.7, "DistBackendError: Connection reset by peer", "DistBackendError"), 100.8, S)
    mon.apply(exit_exc(3, 39, 100.8, "RuntimeError: Connection closed by peer", "RuntimeError"), 100.9, S)
    early = [a for t in range(101, 106) for a in mon.scan(float(t), S) if a.kind == "rank_failed"]
    assert early == []            # rank 2 may still speak: no follower is named in its place
    alerts = [a for t in range(106, 140) for a in mon.scan(float(t), S)]
    failed = [a for a in alerts if a.kind == "rank_failed"]
    assert [a.status for a in failed] == ["open"], [a.summary for a in failed]
    a = failed[0]
    assert a.ranks == [2] and a.step == 40 and a.severity == "critical"
    assert a.details["reason"] == "silent" and a.details["ended"] == "silent: no exit record"
    assert a.details["followers"] == [0, 1, 3] and a.details["follower_count"] == 3
    assert a.details["frames"] == [] and a.stack_groups == []
    assert "rank 2 failed first, in step 40: silent: no exit record" in a.summary
    assert "3 ranks failed after it" in a.summary
    assert any("Connection closed by peer" in e for e in a.details["follower_errors"])
    assert [a for a in alerts if a.kind == "dead_rank"] == []   # one alert for one death


def test_rank_that_died_on_sigsegv_is_the_culprit_and_peers_follow():
    mon = TwoStage(job="j")
    run_job(mon, 100.0)
    mon.apply(exit_exc(0, 39, 100.4, "RuntimeError: Connection closed by peer", "RuntimeError"), 101.0, S)
    mon.apply(exit_signal(1, 39, 100.5, "SIGSEGV"), 101.0, S)      # its record arrives with the others
    mon.apply(exit_exc(3, 39, 100.6, "DistNetworkError: Broken pipe", "DistNetworkError"), 101.0, S)
    mon.apply(exit_signal(2, 39, 100.9), 101.0, S)                 # the launcher stops the last one
    failed = [a for t in range(101, 112) for a in mon.scan(float(t), S) if a.kind == "rank_failed"]
    assert [a.status for a in failed] == ["open"], [a.summary for a in failed]
    a = failed[0]
    assert a.ranks == [1] and a.step == 40
    assert a.details["reason"] == "signal" and a.details["ended"] == "SIGSEGV"
    assert a.details["followers"] == [0, 3, 2] and a.details["follower_count"] == 3
    assert "rank 1 failed first, in step 40: signal SIGSEGV" in a.summary


def test_a_rank_that_stopped_on_sigterm_before_a_silent_one_is_a_follower():
    mon = TwoStage(job="j")
    run_job(mon, 100.0)
    for r in (0, 1, 2):    # rank 3 is killed; the launcher then stops the others with SIGTERM
        mon.apply(exit_signal(r, 39, 101.0 + r / 10), 101.5, S)
    failed = [a for t in range(102, 112) for a in mon.scan(float(t), S) if a.kind == "rank_failed"]
    assert [(a.status, a.ranks, a.details["followers"]) for a in failed] == [("open", [3], [0, 1, 2])]


def test_peers_killed_before_their_exit_record_follow_the_failed_rank_in_one_incident():
    """Seen in a full suite run: rank 2 raised, torchrun killed its peers, and two of them died before
    their exit record was out. They went silent after the failure: followers of rank 2's incident,
    not a dead-rank incident of their own."""
    mon = TwoStage(job="j")
    run_job(mon, 100.0)
    mon.apply(exit_exc(2, 39, 100.5, "ValueError: bad batch", "ValueError", TRACEBACK), 100.6, S)
    for r in (1, 3):                       # one more beat each, then nothing
        mon.apply(heartbeat(r, 39, 100.8), 100.9, S)
    mon.apply(exit_exc(0, 39, 100.9, "RuntimeError: Connection closed by peer", "RuntimeError"), 101.0, S)
    alerts = [a for t in range(101, 160) for a in mon.scan(float(t), S)]
    assert {a.kind for a in alerts} == {"rank_failed"}, [a.summary for a in alerts]
    assert alerts[0].status == "open" and alerts[0].ranks == [2]
    last = alerts[-1]
    assert last.ranks == [2] and last.alert_id == alerts[0].alert_id
    assert last.details["followers"] == [1, 3, 0] and last.details["follower_count"] == 3


def test_a_rank_silent_before_an_own_failure_follows_it():
    """An exception is exact evidence, silence only to within a heartbeat: the raising rank stays
    first, and the silent rank is named as its follower rather than left out."""
    mon = TwoStage(job="j")
    run_job(mon, 100.0)
    for r in (0, 1, 2):
        mon.apply(heartbeat(r, 39, 101.0), 101.0, S)
    mon.apply(exit_exc(2, 39, 101.5, "ValueError: bad batch", "ValueError"), 101.6, S)
    alerts = [a for t in range(102, 150) for a in mon.scan(float(t), S)]
    failed = [a for a in alerts if a.kind == "rank_failed"]
    assert failed and all(a.ranks == [2] for a in failed)
    assert 3 in failed[-1].details["followers"]
    assert [a for a in alerts if a.kind == "dead_rank"] == []


def test_a_stopped_job_whose_shards_retire_one_by_one_raises_nothing():
    """Seen in the detection benchmark: five minutes after a cancelled job, the first shard to retire
    the idle job took its ranks out of the view, and the ranks still in it named a missing one
    'never reported' (a rank_failed alert, resolved a second later when the last shard retired)."""
    mon = TwoStage(job="j")
    run_job(mon, 100.0)
    for r in range(4):
        mon.apply(exit_signal(r, 39, 101.0), 101.0, S)
    assert [a for t in range(101, 110) for a in mon.scan(float(t), S)] == []
    late = 101.0 + S.job_idle_s + 5
    retiring = mon.shards.pop(0)
    mon.monitor.add_summary(retiring.summary(late, S, retired=True))
    alerts = [a for t in (late, late + 1, late + 2) for a in mon.scan(t, S)]
    assert alerts == [], [a.summary for a in alerts]


def test_is_peer_error():
    def f(reason, exc_type, detail):
        return Failure(0, "h", 1, 0, 0, reason, exc_type, detail, [])
    assert is_peer_error(f("signal", "", "SIGTERM")) and is_peer_error(f("signal", "", "SIGINT"))
    assert not is_peer_error(f("signal", "", "SIGSEGV")) and not is_peer_error(f("signal", "", "signal SIGKILL (9)"))
    assert is_peer_error(f("exception", "RuntimeError", "[gloo] Connection closed by peer [10.0.0.2]:1234"))
    assert not is_peer_error(f("exception", "ValueError", "bad shape"))
    assert attribute([f("signal", "", "SIGTERM")]) is None


def test_summary_failures_round_trip_and_stay_bounded():
    sj = ShardJob("j", 0)
    for r in range(4000):
        sj.apply(beat(r, 0, 3, 100.0), 100.0, S)
    long_frames = [f"/very/long/path/{i}/" + "x" * 300 + ".py:1 f" for i in range(80)]
    for r in range(4000):
        sj.apply(exit_exc(r, 2, 100.0 + r / 1e4, "RuntimeError: " + "y" * 5000, "RuntimeError", long_frames),
                 101.0, S)
    summary = sj.summary(101.0, S)
    body = summary.to_body()
    assert len(msgpack.packb(body, use_bin_type=True)) < MAX_SUMMARY_BYTES
    back = ShardSummary.from_body(decode(encode(Envelope("shard", "j", -1, "h", 1, 1, 1, body))).body)
    assert back.failures == summary.failures and back.failures[0].rank == 0 and back.failures[0].frames
    assert len(back.failures) <= 32 and not back.failures[-1].frames


def test_summary_without_failures_is_unchanged_and_bad_failures_are_rejected():
    sj = ShardJob("j", 0)
    sj.apply(beat(0, 0, 3, 100.0), 100.0, S)
    body = sj.summary(100.0, S).to_body()
    assert "failures" not in body
    with pytest.raises(WireError):
        ShardSummary.from_body({**body, "failures": [[1, "h"]]})
    with pytest.raises(WireError):
        ShardSummary.from_body({**body, "failures": "x"})


def test_exit_frames_are_validated_at_the_boundary():
    bad = Envelope("exit", "j", 0, "h", 1, 1, 1, {"step": 1, "reason": "exception", "detail": "x", "frames": [1]})
    with pytest.raises(WireError):
        encode(bad)
