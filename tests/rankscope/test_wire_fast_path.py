"""decode's fast checks for the high-rate kinds give the same answer as the full checks: the same
envelope for what both accept, the same WireError for what the full checks reject."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest

from rankscope.wire import Envelope, WireError, _checked_envelope, decode

BEAT = {"step": [4, 5], "start_ns": [10, 30], "end_ns": [20, 40], "comm_ns": [1, 2], "hb_step": 5,
        "since_step_s": 0.1, "dropped": 0, "world_size": 8, "local_rank": 3, "stacks": None}
HEARTBEAT = {"step": 5, "since_step_s": 1, "dropped": 0, "world_size": 8, "local_rank": 3, "stacks": None}
STEPS = {"step": [1], "start_ns": [0], "end_ns": [9], "comm_ns": [0]}
HW = {"ts_ns": [1], "device": [0], "metrics": {"gpu_util": [50.0]}}
ENVELOPE = {"v": 2, "job": "j", "rank": 1, "host": "h", "pid": 7, "seq": 3, "sent_ns": 99}
ODD_VALUES: list[Any] = [True, False, None, 1.5, -1, 2**63 - 1, "", "x", [], [1], [True], [1.5], {}, {"a": 1},
                         [{"thread": "t", "frames": []}], [{"thread": 1}]]


def outcome(data: bytes) -> Any:
    try:
        return decode(data)
    except WireError as e:
        return ("error", str(e))


def checked(data: bytes) -> Any:
    try:
        return _checked_envelope(msgpack.unpackb(data, raw=False, strict_map_key=False))
    except WireError as e:
        return ("error", str(e))


def variants() -> list[dict[str, Any]]:
    """Well-formed messages of each fast kind, then each with one field removed or replaced by an odd
    value (in the envelope and in the body), with v1 and v2."""
    rng = random.Random(7)
    out: list[dict[str, Any]] = []
    for kind, body in (("beat", BEAT), ("heartbeat", HEARTBEAT), ("steps", STEPS), ("hw", HW)):
        for v in (1, 2):
            base = {**ENVELOPE, "v": v, "kind": kind, "body": body}
            out.append(base)
            for name in base:
                out.append({k: x for k, x in base.items() if k != name})
                out.extend({**base, name: odd} for odd in ODD_VALUES)
            for name in body:
                out.append({**base, "body": {k: x for k, x in body.items() if k != name}})
                out.extend({**base, "body": {**body, name: odd}} for odd in ODD_VALUES)
            if kind in ("beat", "steps"):
                for _ in range(50):   # one element of one step column made odd
                    col = rng.choice(["step", "start_ns", "end_ns", "comm_ns"])
                    values = list(body[col])
                    values[rng.randrange(len(values))] = rng.choice(ODD_VALUES)
                    out.append({**base, "body": {**body, col: values}})
    return out


@pytest.mark.parametrize("message", variants())
def test_fast_and_full_checks_agree(message: dict[str, Any]) -> None:
    data = msgpack.packb(message, use_bin_type=True)
    assert outcome(data) == checked(data)


def test_the_fast_path_makes_a_real_envelope() -> None:
    env = decode(msgpack.packb({**ENVELOPE, "kind": "beat", "body": BEAT}))
    assert type(env) is Envelope and env == Envelope(kind="beat", body=BEAT, **ENVELOPE)
    with pytest.raises(AttributeError):
        env.job = "other"   # type: ignore[misc]
