"""A beat's collective records at the decoding boundary (rankscope/protocol/collectives.py)."""

from __future__ import annotations

import pytest

from rankscope.protocol.collectives import MAX_RECORDS, lateness, op_label, records, validate
from rankscope.protocol.envelope import Envelope, decode, encode
from rankscope.protocol.errors import WireError

GROUP = {"pg": "0", "size": 4, "seq": [7, 8], "op": [0, 1], "reach_ns": [100, 200], "dur_ns": [-1, 5],
         "ops": ["all_reduce float32[8]", "broadcast int64[1]"], "last": [8, -1, 7]}


def beat(coll: object) -> Envelope:
    body = {"step": [1], "start_ns": [0], "end_ns": [10], "comm_ns": [0], "hb_step": 1, "since_step_s": 0.0,
            "dropped": 0, "world_size": 4, "local_rank": 0, "stacks": None, "coll": coll}
    return Envelope(kind="beat", job="j", rank=0, host="h", pid=1, seq=1, sent_ns=1, body=body)


def test_a_beat_with_collectives_round_trips() -> None:
    env = decode(encode(beat([GROUP])))
    assert env.body["coll"] == [GROUP]
    assert records(env.body["coll"][0]) == [(7, 100, -1, "all_reduce float32[8]"), (8, 200, 5, "broadcast int64[1]")]


@pytest.mark.parametrize("bad", [
    "x", [1], [{**GROUP, "pg": 3}], [{**GROUP, "size": -1}], [{**GROUP, "seq": [7]}],
    [{**GROUP, "op": [0, 2]}], [{**GROUP, "last": [1, 2]}], [{**GROUP, "reach_ns": [1, True]}],
    [{**GROUP, "ops": ["x"] * 65}], [{**GROUP, "seq": list(range(MAX_RECORDS + 1))}], [GROUP] * 17,
])
def test_malformed_collective_records_are_refused_with_a_reason(bad: object) -> None:
    with pytest.raises(WireError) as e:
        validate(bad)
    assert e.value.reason == "bad_body"
    import msgpack
    raw = msgpack.packb(beat(bad).to_dict(), use_bin_type=True)
    with pytest.raises(WireError) as e:
        decode(raw)
    assert e.value.reason == "bad_body" and "coll" in str(e.value)


def test_op_labels_and_lateness() -> None:
    assert op_label("nccl:all_reduce", [[1024], [2, 3]], ["bfloat16", "float32"]) == \
        "all_reduce bfloat16[1024] float32[2,3]"
    assert op_label("gloo:barrier", [], []) == "barrier"
    # Timed: the member that ran it shortest reached it last; untimed: the latest reach.
    assert lateness(100, 5) > lateness(50, 9) and lateness(100, -1) > lateness(50, -1)
