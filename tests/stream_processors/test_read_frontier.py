"""A partition read late (the processors lag behind its input) makes its ranks look older, not
dead: stage one judges silence at the send time it has read up to (its frontier) and sends it with
the summary; the job-wide dead-rank rule judges each rank at its shard's frontier."""

from __future__ import annotations

import pytest

from rankscope.config import Settings
from rankscope.protocol.envelope import Envelope, decode
from rankscope.stream_processors.monitor import JobMonitor
from rankscope.stream_processors.shard_summary import ShardSummary
from rankscope.stream_processors.stages import RECOVERY_FACTOR, EnvelopeEncoder, ShardStage

S = Settings(dead_after_s=10, hang_min_s=10, scan_interval_s=1.0)
T0 = 1_000.0


def beat(rank: int, t_s: float, step: int) -> Envelope:
    ns = int(t_s * 1e9)
    return Envelope(kind="beat", job="j", rank=rank, host="h", pid=100 + rank, seq=step + 1, sent_ns=ns,
                    body={"step": [step], "start_ns": [ns - 900_000_000], "end_ns": [ns - 100_000_000],
                          "comm_ns": [0], "hb_step": step, "since_step_s": 0.1, "dropped": 0, "world_size": 8,
                          "local_rank": rank, "stacks": None})


def feed(stage: ShardStage, partition: int, ranks: list[int], until_s: float, skip: int | None = None,
         skip_after_s: float = 0.0) -> None:
    """Beats once a second from T0 to ``until_s``; rank ``skip`` stops after ``skip_after_s``."""
    t, step = T0, 0
    while t <= until_s:
        for r in ranks:
            if r == skip and t > skip_after_s:
                continue
            stage.ingest(partition, beat(r, t, step), t)
        t, step = t + 1.0, step + 1


def summaries(stage: ShardStage, now_s: float) -> list[ShardSummary]:
    return [ShardSummary.from_body(decode(v).body) for topic, _, v in stage.tick(now_s) if topic.name == "SHARDS"]


def test_a_shard_read_late_is_judged_at_its_frontier_not_the_wall_clock() -> None:
    stage = ShardStage(S, EnvelopeEncoder("w", 1))
    feed(stage, 0, [0, 1, 2, 3], until_s=T0 + 20)
    stage.mark_read(0, waiting=True)              # more of partition 0 is waiting: we are 40 s behind
    [late] = summaries(stage, now_s=T0 + 60)
    assert late.agg["frontier_ns"] == int((T0 + 20) * 1e9) and late.agg["silent"] == 0
    stage.mark_read(0, waiting=False)             # caught up: nothing came for 40 s, the shard is silent
    [caught_up] = summaries(stage, now_s=T0 + 60)
    assert caught_up.agg["frontier_ns"] == int((T0 + 60) * 1e9) and caught_up.agg["silent"] == 4


def test_the_dead_rank_rule_judges_each_rank_at_its_shards_frontier() -> None:
    on_time, late = ShardStage(S, EnvelopeEncoder("w1", 1)), ShardStage(S, EnvelopeEncoder("w2", 2))
    now = T0 + 60
    feed(on_time, 0, [0, 2, 4, 6], until_s=now)
    # Partition 1 is read 25 s late; rank 5 stopped 15 s before what has been read of it.
    feed(late, 1, [1, 3, 5, 7], until_s=now - 25, skip=5, skip_after_s=now - 40)
    late.mark_read(1, waiting=True)
    mon = JobMonitor(job="j")
    for s in summaries(on_time, now) + summaries(late, now):
        mon.add_summary(s)
    view = mon.view(now, S)
    assert view is not None
    assert mon.dead_ranks(view, now, S) == [5]    # not 1, 3 and 7, whose newer beats wait unread
    alerts = mon.scan(now, S)
    assert [(a.kind, a.ranks) for a in alerts] == [("dead_rank", [5])]


def test_summaries_without_a_frontier_are_judged_at_the_wall_clock() -> None:
    stage = ShardStage(S, EnvelopeEncoder("w", 1))
    now = T0 + 30
    feed(stage, 0, [0, 1, 2, 3], until_s=now, skip=2, skip_after_s=T0 + 5)
    [s] = summaries(stage, now)
    del s.agg["frontier_ns"]                      # a worker that does not send it
    mon = JobMonitor(job="j")
    mon.add_summary(s)
    view = mon.view(now, S)
    assert view is not None and mon.dead_ranks(view, now, S) == [2]


def test_a_rank_read_late_is_not_taken_for_silent_before_a_failure() -> None:
    from rankscope.stream_processors.failures import silent_ranks
    from rankscope.stream_processors.shard_summary import Row

    now = T0 + 60
    first_failure_ns = int((now - 20) * 1e9)
    row = Row(rank=5, host="h", pid=105, last_step=30, last_step_end_ns=int((now - 31) * 1e9),
              hb_ns=int((now - 30) * 1e9), hb_since_s=0.1, step_med_ns=1, busy_med_ns=1, window_steps=1,
              stack_sig="", waiting=-1, exit_reason="", exit_detail="", dropped=0)
    assert [f.rank for f in silent_ranks([row], first_failure_ns, now, S)[0]] == [5]
    # Its partition has been read up to 1 s after its last beat: nothing says it stopped.
    silent, pending, _later = silent_ranks([row], first_failure_ns, now, S, {5: now - 29})
    assert silent == [] and pending


def test_a_partition_whose_leader_is_down_is_judged_at_its_frontier_until_its_ranks_catch_up() -> None:
    # A broker dies: partition 0's leader is gone for 12 s, its ranks' producers hold their beats.
    stage = ShardStage(S, EnvelopeEncoder("w", 1))
    feed(stage, 0, [0, 1, 2, 3], until_s=T0 + 20)
    stage.mark_reachable({0}, T0 + 21)
    [down] = summaries(stage, now_s=T0 + 32)
    assert down.agg["frontier_ns"] == int((T0 + 20) * 1e9) and down.agg["silent"] == 0
    # The new leader is up at T0 + 33; the ranks' producers have not sent what they held yet.
    stage.mark_reachable(set(), T0 + 33)
    [back] = summaries(stage, now_s=T0 + 33 + 2 * S.dead_after_s)
    assert back.agg["frontier_ns"] == int((T0 + 20) * 1e9) and back.agg["silent"] == 0
    # Past RECOVERY_FACTOR x dead_after_s, the partition is judged at the wall clock again: ranks that
    # still send nothing are silent, as in the caught-up case above.
    end = T0 + 33 + RECOVERY_FACTOR * S.dead_after_s
    stage.mark_reachable(set(), end)
    [later] = summaries(stage, now_s=end)
    assert later.agg["frontier_ns"] == int(end * 1e9) and later.agg["silent"] == 4


def test_a_partition_back_from_an_outage_is_judged_at_the_wall_clock_once_its_ranks_delivered() -> None:
    stage = ShardStage(S, EnvelopeEncoder("w", 1))
    feed(stage, 0, [0, 1, 2, 3], until_s=T0 + 20)
    stage.mark_reachable({0}, T0 + 21)
    stage.mark_reachable(set(), T0 + 33)
    # Ranks 0-2 deliver what they held and beat on; rank 3 died during the outage.
    for t in range(21, 36):
        for r in (0, 1, 2):
            stage.ingest(0, beat(r, T0 + t, t), T0 + 34)
    [waiting] = summaries(stage, now_s=T0 + 36)
    assert waiting.agg["frontier_ns"] == int((T0 + 20) * 1e9) and waiting.agg["silent"] == 0
    # Rank 3 never catches up: past the cap it is the one rank silent.
    end = T0 + 33 + RECOVERY_FACTOR * S.dead_after_s + 1
    for r in (0, 1, 2):
        stage.ingest(0, beat(r, end, 99), end)
    [judged] = summaries(stage, now_s=end)
    assert judged.agg["frontier_ns"] == int(end * 1e9) and judged.agg["silent"] == 1
    # All four delivered: the outage is over at once.
    stage2 = ShardStage(S, EnvelopeEncoder("w", 1))
    feed(stage2, 1, [0, 1, 2, 3], until_s=T0 + 20)
    stage2.mark_reachable({1}, T0 + 21)
    stage2.mark_reachable(set(), T0 + 33)
    for r in (0, 1, 2, 3):
        stage2.ingest(1, beat(r, T0 + 33.5, 40), T0 + 34)
    [over] = summaries(stage2, now_s=T0 + 34)
    assert over.agg["frontier_ns"] == int((T0 + 34) * 1e9) and over.agg["silent"] == 0


def test_a_partition_rebuilt_during_an_outage_is_judged_at_what_was_rebuilt() -> None:
    # The broker lost was also the group coordinator: the partitions are assigned again while
    # partition 0 has no leader, and rebuilt from its recent input.
    source = ShardStage(S, EnvelopeEncoder("w", 1))
    feed(source, 0, [0, 1, 2, 3], until_s=T0 + 20)
    stage = ShardStage(S, EnvelopeEncoder("w2", 2))
    stage.install(source.shards.values())
    stage.mark_reachable({0}, T0 + 25)
    [down] = summaries(stage, now_s=T0 + 40)
    assert down.agg["frontier_ns"] == int((T0 + 20) * 1e9) and down.agg["silent"] == 0


def test_partitions_whose_leader_is_not_connected_are_read_from_the_consumer_statistics() -> None:
    from rankscope.stream_processors.shard_loop import unreachable_partitions

    stats = {"brokers": {"127.0.0.1:9092/1": {"nodeid": 1, "state": "UP"},
                         "127.0.0.1:9093/2": {"nodeid": 2, "state": "CONNECT"},
                         "GroupCoordinator": {"nodeid": -1, "state": "UP"}},
             "topics": {"steps": {"partitions": {"0": {"leader": 1}, "1": {"leader": 2}, "2": {"leader": -1},
                                                 "-1": {"leader": -1}}},
                        "other": {"partitions": {"5": {"leader": 2}}}}}
    assert unreachable_partitions(stats, "steps") == {1, 2}
    assert unreachable_partitions(stats, "missing") == set() and unreachable_partitions({}, "steps") == set()


def test_partitions_with_a_live_leader_are_held_when_a_broker_is_lost_until_their_ranks_deliver() -> None:
    # A broker dies at T0 + 21. Partition 1's leader lives on, but the lost broker is one of its
    # in-sync replicas: nothing new is readable until the controller drops it (T0 + 30). Then ranks
    # 0-2 deliver at once and rank 3's producer, retrying, a few seconds later: not a dead rank.
    stage = ShardStage(S, EnvelopeEncoder("w", 1))
    feed(stage, 1, [0, 1, 2, 3], until_s=T0 + 20)
    stage.mark_reachable(set(), T0 + 21, stalled={1})
    for t in range(21, 33):
        for r in (0, 1, 2):
            stage.ingest(1, beat(r, T0 + t, t), T0 + 32)
    [held] = summaries(stage, now_s=T0 + 33)
    assert held.agg["frontier_ns"] == int((T0 + 20) * 1e9) and held.agg["silent"] == 0
    # The next statistics, the broker still lost, do not start the hold again.
    stage.mark_reachable(set(), T0 + 34, stalled=set())
    stage.ingest(1, beat(3, T0 + 34, 34), T0 + 34)
    [over] = summaries(stage, now_s=T0 + 35)
    assert over.agg["frontier_ns"] == int((T0 + 35) * 1e9) and over.agg["silent"] == 0


def test_a_rank_that_dies_while_a_broker_is_lost_is_found_once_the_hold_ends() -> None:
    stage = ShardStage(S, EnvelopeEncoder("w", 1))
    feed(stage, 1, [0, 1, 2, 3], until_s=T0 + 20)
    stage.mark_reachable(set(), T0 + 21, stalled={1})
    end = T0 + 21 + RECOVERY_FACTOR * S.dead_after_s
    for t in range(21, int(end - T0) + 1):
        for r in (0, 1, 2):
            stage.ingest(1, beat(r, T0 + t, t), T0 + t)
    stage.mark_reachable(set(), end, stalled=set())
    [judged] = summaries(stage, now_s=end)
    assert judged.agg["frontier_ns"] == int(end * 1e9) and judged.agg["silent"] == 1


def test_the_brokers_up_are_read_from_the_consumer_statistics() -> None:
    from rankscope.stream_processors.shard_loop import up_brokers

    stats = {"brokers": {"127.0.0.1:9092/1": {"nodeid": 1, "state": "UP"},
                         "127.0.0.1:9093/2": {"nodeid": 2, "state": "TRY_CONNECT"},
                         "127.0.0.1:9094/3": {"nodeid": 3, "state": "INIT"},
                         "127.0.0.1:9092/bootstrap": {"nodeid": -1, "state": "UP"}}}
    assert up_brokers(stats) == {1}
    assert up_brokers({}) == set()


def test_the_shard_loop_holds_every_partition_once_when_a_connected_broker_is_lost() -> None:
    import json

    from rankscope.clock import ManualClock
    from rankscope.protocol.deadletter import DeadLetterCounter
    from rankscope.stream_processors.shard_loop import ShardLoop

    clock = ManualClock(T0 + 21)
    loop = ShardLoop(S, "g", clock, DeadLetterCounter(), EnvelopeEncoder("w", 1))
    loop.assigned = {0, 1, 2}
    for p in (0, 1, 2):
        feed(loop.stage, p, [p], until_s=T0 + 20)
    topic = loop._topic

    def stats(states: dict[int, str]) -> str:
        return json.dumps({"brokers": {f"h:{n}/{n}": {"nodeid": n, "state": st} for n, st in states.items()},
                           "topics": {topic: {"partitions": {"0": {"leader": 1}, "1": {"leader": 2},
                                                             "2": {"leader": 1}}}}})
    loop._on_stats(stats({1: "UP", 2: "CONNECT"}))          # a connection being set up is no loss
    assert loop.stage.outage_from_s == {1: T0 + 20}
    loop._on_stats(stats({1: "UP", 2: "UP"}))
    loop._on_stats(stats({1: "UP", 2: "DOWN"}))             # broker 2 lost: partition 1 has no leader,
    assert loop.stage.unreachable == {1}                    # partitions 0 and 2 stall behind it
    assert set(loop.stage.outage_from_s) == {0, 1, 2} and set(loop.stage.recovering_until_s) == {0, 2}
    held = dict(loop.stage.recovering_until_s)
    clock.advance(1.0)
    loop._on_stats(stats({1: "UP", 2: "TRY_CONNECT"}))      # still lost: the hold is not renewed
    assert loop.stage.recovering_until_s == held


def test_partitions_assigned_soon_after_a_broker_loss_are_held_from_what_their_rebuild_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's coordinator was on the lost broker: the group rebalances, the holds go with the
    revoked partitions, and the same partitions come back rebuilt while their ranks' producers still
    wait on the lost replica. They are held again from what the rebuild read; long after the loss,
    a new assignment is judged at the wall clock as usual."""
    import json

    from rankscope.clock import ManualClock
    from rankscope.protocol.deadletter import DeadLetterCounter
    from rankscope.stream_processors import shard_loop
    from rankscope.stream_processors.shard_loop import ShardLoop

    clock = ManualClock(T0 + 21)
    loop = ShardLoop(S, "g", clock, DeadLetterCounter(), EnvelopeEncoder("w", 1))
    monkeypatch.setattr(loop, "_assign_profiles", lambda partitions: None)
    monkeypatch.setattr(loop.metrics, "forget_partitions", lambda *a: None)
    monkeypatch.setattr(loop, "profiles_consumer", None, raising=False)

    def rebuilt_from_kafka(settings: Settings, partitions: list[int], now_s: float) -> list:
        other = ShardStage(S, EnvelopeEncoder("w", 1))       # what a rebuild reads: beats up to T0 + 20
        for p in partitions:
            feed(other, p, [p], until_s=T0 + 20)
        return list(other.shards.values())
    monkeypatch.setattr(shard_loop, "rebuild_shards", rebuilt_from_kafka)

    class TP:
        def __init__(self, p: int) -> None:
            self.partition = p

    loop._on_assign(None, [TP(0), TP(1)])
    assert loop.stage.outage_from_s == {}                    # no broker lost: no hold
    stats = {"brokers": {"h:1/1": {"nodeid": 1, "state": "UP"}, "h:2/2": {"nodeid": 2, "state": "UP"}},
             "topics": {loop._topic: {"partitions": {"0": {"leader": 1}, "1": {"leader": 1}}}}}
    loop._on_stats(json.dumps(stats))
    stats["brokers"]["h:2/2"]["state"] = "DOWN"
    loop._on_stats(json.dumps(stats))                       # broker 2 lost: both partitions held
    assert set(loop.stage.outage_from_s) == {0, 1}

    clock.advance(10.0)                                     # the group's session times out: revoked
    loop._on_revoke(None, [TP(0), TP(1)])
    assert loop.stage.outage_from_s == {}
    loop._on_assign(None, [TP(0), TP(1)])                   # and assigned again, rebuilt
    assert loop.stage.outage_from_s == {0: T0 + 20, 1: T0 + 20}
    assert loop.stage.frontier_s(0, clock.wall_ns() / 1e9) == T0 + 20     # silence judged at the rebuild

    loop._on_revoke(None, [TP(0), TP(1)])
    clock.advance(RECOVERY_FACTOR * S.dead_after_s)        # long after the loss
    loop._on_assign(None, [TP(0), TP(1)])
    assert loop.stage.outage_from_s == {}
    assert loop.stage.frontier_s(0, clock.wall_ns() / 1e9) == clock.wall_ns() / 1e9
