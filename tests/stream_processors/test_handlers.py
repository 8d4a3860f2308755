"""The faust worker's agents and timers as plain handlers (stream_processors/handlers.py), driven
with a manual clock and real stage-one shard summaries: no faust and no Kafka."""

from __future__ import annotations

import json

from rankscope.clock import ManualClock
from rankscope.config import Settings
from rankscope.producers.trace_events import summarize, to_columnar
from rankscope.protocol.alerts import Alert
from rankscope.protocol.deadletter import DeadLetterCounter
from rankscope.protocol.envelope import Envelope, decode, encode
from rankscope.protocol.trace_summary import summary_body
from rankscope.stream_processors.handlers import Handlers, Source
from rankscope.stream_processors.stages import EnvelopeEncoder, JobStage, ShardStage
from rankscope.topics import Topic

S = Settings(hang_min_s=10, hang_factor=8, dead_after_s=6, report_deadline_s=30, auto_trace_steps=3,
             auto_trace_interval_s=600)
STEP_NS = 10_000_000
HANG = ["train.py:10 <module>", "train.py:40 train", "train.py:20 hang_forever"]
WAIT = ["train.py:10 <module>", "train.py:42 train", "torch/distributed/c10d_logger.py:81 wrapper"]


def msg(kind: str, rank: int, body: dict, job: str = "j") -> Envelope:
    return Envelope(kind=kind, job=job, rank=rank, host="h", pid=100 + rank, seq=1, sent_ns=0, body=body)


def rig() -> tuple[Handlers, ShardStage, ManualClock, list[str]]:
    clock = ManualClock(1000.0)
    dead: list[str] = []
    sender = EnvelopeEncoder("test", 1)
    h = Handlers(S, clock, JobStage(S), sender, DeadLetterCounter(), on_dead_letter=dead.append)
    return h, ShardStage(S, sender), clock, dead


def beat(shards: ShardStage, now_s: float, first: int, n: int, stacks: dict[int, list[str]] | None = None,
         since: float = 0.0) -> None:
    for r in range(4):
        s = list(range(first, first + n))
        start = [i * STEP_NS for i in s]
        if n:
            shards.ingest(0, msg("steps", r, {"step": s, "start_ns": start, "end_ns": [a + STEP_NS for a in start],
                                             "comm_ns": [STEP_NS // 2] * n}), now_s)
        frames = (stacks or {}).get(r)
        shards.ingest(0, msg("heartbeat", r, {"step": first + n - 1, "since_step_s": since, "dropped": 0,
                                              "world_size": 4, "local_rank": r,
                                              "stacks": [{"thread": "MainThread", "frames": frames}] if frames else None}),
                      now_s)


def judge(h: Handlers, shards: ShardStage, now_s: float) -> list:
    out = []
    for i, (topic, _key, value) in enumerate(shards.tick(now_s)):
        if topic is Topic.SHARDS:
            out += h.on_shard(Source("p.shards", 0, i), value)
    return out


def test_input_that_does_not_decode_is_a_dead_letter_and_the_agent_goes_on():
    h, _, _, dead = rig()
    [garbage] = h.on_shard(Source("p.shards", 2, 17), b"\x00not msgpack")
    [wrong] = h.on_shard(Source("p.shards", 2, 18), encode(msg("heartbeat", 0, {
        "step": 1, "since_step_s": 0.0, "dropped": 0, "world_size": 1, "local_rank": 0, "stacks": None})))
    [bad_summary] = h.on_summary(Source("p.summaries", 0, 3), b"\x93")
    assert {o.topic for o in (garbage, wrong, bad_summary)} == {Topic.DEADLETTER}
    letter = json.loads(garbage.value)
    assert (letter["source_topic"], letter["partition"], letter["offset"], letter["stage"]) == ("p.shards", 2, 17,
                                                                                                "processors")
    assert json.loads(wrong.value)["reason"] == "unexpected_kind"
    assert len(dead) == 3 and h.counter.snapshot()["processors:unexpected_kind"] == 1


def test_a_hang_is_alerted_once_and_asks_every_rank_for_its_flight_record():
    h, shards, clock, _ = rig()
    beat(shards, clock.monotonic(), 0, 30)
    assert judge(h, shards, clock.monotonic()) == [] and h.on_tick() == []
    clock.advance(12.0)
    beat(shards, clock.monotonic(), 29, 0, {r: HANG if r == 3 else WAIT for r in range(4)}, since=12.0)
    judge(h, shards, clock.monotonic())
    out = h.on_tick()
    assert [o.topic for o in out] == [Topic.ALERTS, Topic.CONTROL]
    alert = Alert.from_json(out[0].value)
    assert (alert.kind, alert.status, alert.ranks) == ("hang", "open", [3])
    control = decode(out[1].value)
    assert control.kind == "control" and control.job == "j"
    assert control.body["command"] == "flight" and control.body["request_id"] == f"flight-{alert.alert_id}"
    clock.advance(1.0)
    beat(shards, clock.monotonic(), 29, 0, {r: HANG if r == 3 else WAIT for r in range(4)}, since=13.0)
    judge(h, shards, clock.monotonic())
    assert h.on_tick() == []                           # the same incident: nothing new


def test_a_partition_handed_over_keeps_its_open_incident_and_a_revoked_one_is_not_judged():
    """Worker A opens a hang; the shards partition moves to worker B. B takes no summary before it
    restored A's incidents (else it would open the hang again under a new id), and A, whose late
    events of the revoked partition still come, judges none of them."""
    a, shards, clock, _ = rig()
    beat(shards, clock.monotonic(), 0, 30)
    judge(a, shards, clock.monotonic())
    clock.advance(12.0)
    beat(shards, clock.monotonic(), 29, 0, {r: HANG if r == 3 else WAIT for r in range(4)}, since=12.0)
    judge(a, shards, clock.monotonic())
    [opened] = [Alert.from_json(o.value) for o in a.on_tick() if o.topic is Topic.ALERTS]
    assert (opened.kind, opened.status) == ("hang", "open")

    b = Handlers(S, clock, JobStage(S), EnvelopeEncoder("b", 2), DeadLetterCounter())
    a.job_stage.revoke({0})
    b.job_stage.assigning([0])
    clock.advance(1.0)
    beat(shards, clock.monotonic(), 29, 0, {r: HANG if r == 3 else WAIT for r in range(4)}, since=13.0)
    judge(a, shards, clock.monotonic())
    judge(b, shards, clock.monotonic())               # read while B still restores: not taken
    assert a.on_tick() == [] and b.on_tick() == []
    assert a.job_stage.monitors == {} and b.job_stage.monitors == {}
    b.job_stage.restore(0, [opened])
    clock.advance(1.0)
    beat(shards, clock.monotonic(), 29, 0, {r: HANG if r == 3 else WAIT for r in range(4)}, since=14.0)
    judge(b, shards, clock.monotonic())
    assert b.on_tick() == []                           # the same incident, under the same id: nothing new
    assert b.job_stage.monitors["j"].incidents["hang"]["alert_id"] == opened.alert_id


def test_automatic_trace_windows_are_rate_limited_per_job():
    h, _, clock, _ = rig()
    [first] = h.auto_trace("j", clock.wall_ns() / 1e9)
    body = decode(first.value).body
    assert first.topic is Topic.CONTROL and body["command"] == "trace" and body["args"]["steps"] == 3
    assert body["args"]["reason"] == "auto: slow rank"
    clock.advance(599.0)
    assert h.auto_trace("j", clock.wall_ns() / 1e9) == []
    assert len(h.auto_trace("other", clock.wall_ns() / 1e9)) == 1
    clock.advance(2.0)
    assert len(h.auto_trace("j", clock.wall_ns() / 1e9)) == 1


def _summary(rank: int, window_id: str) -> bytes:
    events = [{"type": "user_annotation", "name": "ProfilerStep#5", "start_ns": 0, "dur_ns": 1000, "tid": 1},
              {"type": "cpu_op", "name": "aten::mm", "start_ns": 10, "dur_ns": 300 * (1 + rank), "tid": 1}]
    col = to_columnar(events, window_id, 5)
    return encode(msg("summary", rank, summary_body(col, summarize(col, compact_paths=True), events_sent=2,
                                                     truncated=False)))


def test_a_report_is_published_when_every_rank_reported_or_at_the_deadline():
    h, shards, clock, _ = rig()
    beat(shards, clock.monotonic(), 0, 30)
    judge(h, shards, clock.monotonic())
    h.on_tick()
    outs = [h.on_summary(Source("p.summaries", 0, r), _summary(r, "w-all")) for r in range(4)]
    assert outs[:3] == [[], [], []]
    reports = [o for o in outs[3] if o.topic is Topic.REPORTS]
    assert len(reports) == 1 and json.loads(reports[0].value)["window_id"] == "w-all"
    # A window rank 3 never finishes: reported once the deadline passes, naming the missing rank.
    for r in range(3):
        assert h.on_summary(Source("p.summaries", 0, 10 + r), _summary(r, "w-part")) == []
    assert h.on_report_deadlines() == []
    clock.advance(S.report_deadline_s)
    beat(shards, clock.monotonic(), 30, 30)             # the job still runs
    judge(h, shards, clock.monotonic())
    [late] = [o for o in h.on_report_deadlines() if o.topic is Topic.REPORTS]
    report = json.loads(late.value)
    assert report["window_id"] == "w-part" and 3 in report["missing_ranks"]
    assert h.on_report_deadlines() == []
