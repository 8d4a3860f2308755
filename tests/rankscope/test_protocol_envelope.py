from __future__ import annotations

import msgpack
import pytest

from rankscope.protocol.envelope import (
    SCHEMA_VERSION,
    Envelope,
    decode,
    encode,
    rank_key,
    split_beat,
    steps_rows,
)
from rankscope.protocol.errors import WireError


def env(kind="steps", body=None, **kw):
    body = body if body is not None else {"step": [0, 1], "start_ns": [0, 10], "end_ns": [10, 20], "comm_ns": [1, 2]}
    base = dict(kind=kind, job="j", rank=1, host="h", pid=7, seq=3, sent_ns=99, body=body)
    base.update(kw)
    return Envelope(**base)


def test_roundtrip_steps():
    e = decode(encode(env()))
    assert e.kind == "steps" and e.rank == 1 and e.v == SCHEMA_VERSION
    assert steps_rows(e)[1] == {"step": 1, "start_ns": 10, "end_ns": 20, "comm_ns": 2}


@pytest.mark.parametrize("payload,reason", [
    (b"", "empty"),
    (b"\xc1\xc1garbage", "not_msgpack"),
    (msgpack.packb([1, 2, 3]), "not_a_map"),
    (msgpack.packb({"kind": "steps"}), "missing_field"),
    (msgpack.packb({**env().to_dict(), "v": 99}), "unknown_version"),
    (msgpack.packb({**env().to_dict(), "kind": "nope"}), "unknown_kind"),
    (msgpack.packb({**env().to_dict(), "rank": "x"}), "bad_type"),
    (msgpack.packb({**env().to_dict(), "body": {"step": [1], "start_ns": [], "end_ns": [1], "comm_ns": [1]}}), "bad_body"),
    (msgpack.packb({**env().to_dict(), "job": ""}), "bad_type"),
])
def test_decode_rejects_with_reason(payload, reason):
    with pytest.raises(WireError) as ei:
        decode(payload)
    assert ei.value.reason == reason


BEAT = {"step": [4, 5], "start_ns": [0, 10], "end_ns": [10, 20], "comm_ns": [1, 2], "hb_step": 5,
        "since_step_s": 0.25, "dropped": 3, "world_size": 8, "local_rank": 1, "stacks": None}


def test_v2_beat_splits_into_the_v1_pair():
    e = decode(encode(env("beat", BEAT)))
    steps, hb = split_beat(e)
    assert (steps.kind, steps.rank, steps.seq, steps.sent_ns) == ("steps", 1, 3, 99)
    assert steps_rows(steps)[0] == {"step": 4, "start_ns": 0, "end_ns": 10, "comm_ns": 1}
    assert hb.kind == "heartbeat" and hb.body == {"step": 5, "since_step_s": 0.25, "dropped": 3, "world_size": 8,
                                                  "local_rank": 1, "stacks": None}
    assert rank_key("job-1", 7) == b"job-1/7"


def test_a_beat_may_carry_the_training_threads_cpu_counters():
    e = decode(encode(env("beat", {**BEAT, "cpu": [5_000, 700]})))
    assert split_beat(e)[1].body["cpu"] == [5_000, 700]
    assert "cpu" not in split_beat(decode(encode(env("beat", BEAT))))[1].body    # older ranks send none
    assert decode(encode(env("heartbeat", {**split_beat(e)[1].body}))).body["cpu"] == [5_000, 700]
    for bad in ([1], [1, -1], [1, 2.0], "1,2", [True, 1]):
        with pytest.raises(WireError, match="cpu must be") as ei:
            decode(encode(env("beat", {**BEAT, "cpu": bad})))
        assert ei.value.reason == "bad_body"


def test_v1_messages_still_decode_and_v1_cannot_carry_a_beat():
    v1 = msgpack.packb({**env().to_dict(), "v": 1})
    assert decode(v1).v == 1 and decode(v1).kind == "steps"
    with pytest.raises(WireError) as ei:
        decode(msgpack.packb({**env("beat", BEAT).to_dict(), "v": 1}))
    assert ei.value.reason == "unknown_kind"
    with pytest.raises(WireError) as ei:
        decode(encode(env("beat", {**BEAT, "comm_ns": [1]})))
    assert ei.value.reason == "bad_body"


def test_truncated_message_is_rejected():
    data = encode(env())
    with pytest.raises(WireError) as ei:
        decode(data[: len(data) // 2])
    assert ei.value.reason in ("not_msgpack", "bad_body", "missing_field")


def test_heartbeat_and_exit_validation():
    hb = {"step": 3, "since_step_s": 0.5, "dropped": 0, "world_size": 4, "local_rank": 0,
          "stacks": [{"thread": "MainThread", "frames": ["a.py:1 f"]}]}
    assert decode(encode(env("heartbeat", hb))).body["stacks"][0]["thread"] == "MainThread"
    with pytest.raises(WireError):
        encode(env("exit", {"step": 1, "reason": "exploded", "detail": ""}))


def test_decode_makes_a_real_frozen_envelope():
    e = decode(encode(env("beat", BEAT)))
    assert type(e) is Envelope and e == env("beat", BEAT)
    with pytest.raises(AttributeError):
        e.job = "other"   # type: ignore[misc]


@pytest.mark.parametrize("change,reason", [
    ({"v": True}, "unknown_version"),
    ({"rank": True}, "bad_type"),
    ({"body": {**BEAT, "hb_step": True}}, "bad_body"),
    ({"body": {**BEAT, "dropped": False}}, "bad_body"),
    ({"body": {**BEAT, "step": [True, 5]}}, "bad_body"),
    ({"body": {**BEAT, "stacks": [{"thread": 1, "frames": []}]}}, "bad_body"),
    ({"body": {k: v for k, v in BEAT.items() if k != "local_rank"}}, "bad_body"),
])
def test_types_are_exact_a_bool_is_not_an_int(change, reason):
    with pytest.raises(WireError) as ei:
        decode(msgpack.packb({**env("beat", BEAT).to_dict(), **change}))
    assert ei.value.reason == reason


@pytest.mark.parametrize("kind,body", [
    ("exit", {"step": True, "reason": "completed", "detail": ""}),
    ("exit", {"step": 1, "reason": "completed", "detail": "", "frames": [1]}),
    ("control", {"command": "trace", "request_id": "r", "ranks": 3, "args": {}}),
    ("ack", {"request_id": "r", "status": "ok"}),
    ("fr_dump", {"request_id": "r", "reason": "x", "dump": "{}", "truncated": 0}),
    ("flight", {"steps": [], "stacks": None}),
    ("stats", {"ranks": {}}),
    ("hw", {"ts_ns": [1], "device": 0, "metrics": {}}),
    ("trace", {"window_id": 1, "events": {}}),
    ("summary", {"window_id": "w", "functions": []}),
])
def test_each_kinds_body_is_checked(kind, body):
    with pytest.raises(WireError) as ei:
        decode(msgpack.packb({**env(kind, body).to_dict()}))
    assert ei.value.reason == "bad_body"


def test_decode_needs_nothing_but_the_standard_library_and_msgpack():
    # The rank side decodes; trace_rows.py (numpy) is imported only by those that read trace events.
    import subprocess
    import sys

    code = ("import sys, msgpack; before = set(sys.modules); import rankscope.protocol.envelope; "
            "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['rankscope']", out.stdout
