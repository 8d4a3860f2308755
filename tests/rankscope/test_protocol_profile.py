"""The ``profile`` kind at the decoding boundary: well-formed bodies decode, every bound is refused
with ``bad_body``, and a v1 envelope cannot carry it."""

from __future__ import annotations

import copy

import pytest

from rankscope.protocol.envelope import Envelope, decode, encode
from rankscope.protocol.errors import WireError
from rankscope.protocol.profile import MAX_DEPTH, MAX_ROWS, rows, validate

GOOD = {"t0_ns": 10**18, "t1_ns": 10**18 + 10**10, "hz": 20.0, "ticks": 200, "roles": ["training", "other"],
        "names": ["train.py:1 <module>", "train.py:5 step", "mod.py:9 slow"],
        "paths": [[-1, 0], [0, 1], [1, 2]], "path": [1, 2], "role": [0, 1], "count": [150, 40], "other": [10, 0]}


def env(body: dict, v: int = 2) -> bytes:
    return encode(Envelope("profile", "j", 3, "h", 1, 1, 10**18, body, v=v)) if v == 2 else \
        __import__("msgpack").packb({"v": v, "kind": "profile", "job": "j", "rank": 3, "host": "h", "pid": 1,
                                     "seq": 1, "sent_ns": 1, "body": body})


def test_a_good_body_decodes_into_rows_of_role_call_path_and_count() -> None:
    got = rows(validate(decode(env(GOOD)).body))
    assert got == [("training", "train.py:1 <module>;train.py:5 step", 150),
                   ("other", "train.py:1 <module>;train.py:5 step;mod.py:9 slow", 40), ("training", "", 10)]


def bad(**change) -> dict:
    b = copy.deepcopy(GOOD)
    b.update(change)
    return b


@pytest.mark.parametrize("body", [
    bad(hz=0.0), bad(hz=5000.0), bad(t1_ns=1), bad(ticks=-1), bad(roles=["gpu", "other"]),
    bad(other=[1]), bad(path=[1, 9]), bad(role=[0, 5]), bad(count=[150]), bad(count=[0, 40]),
    bad(count=[2**31, 1]), bad(paths=[[-1, 0], [0, 7], [1, 2]]), bad(paths=[[2, 0], [0, 1], [1, 2]]),
    bad(names=["x" * 301, "a", "b"]), bad(path=list(range(MAX_ROWS + 1))), bad(count="many"),
    bad(hz="20"), {k: v for k, v in GOOD.items() if k != "ticks"}])
def test_bounds_and_shapes_are_refused_at_the_boundary(body: dict) -> None:
    with pytest.raises(WireError) as e:
        decode(env(body))
    assert e.value.reason == "bad_body"


def test_a_path_table_with_a_cycle_or_a_forward_parent_is_refused() -> None:
    for paths in ([[1, 0], [0, 1], [1, 2]], [[-1, 0], [2, 1], [1, 2]]):
        with pytest.raises(WireError, match="earlier entry"):
            decode(env(bad(paths=paths)))


def test_a_v1_envelope_cannot_carry_a_profile() -> None:
    with pytest.raises(WireError) as e:
        decode(env(GOOD, v=1))
    assert e.value.reason == "unknown_kind"


def test_a_call_path_deeper_than_max_depth_is_refused_and_one_at_it_is_not() -> None:
    def chain(depth: int) -> dict:
        return bad(names=["f"], paths=[[-1, 0]] + [[i, 0] for i in range(depth - 1)], path=[depth - 1], role=[0],
                   count=[5])

    assert rows(validate(chain(MAX_DEPTH)))[0][1] == ";".join(["f"] * MAX_DEPTH)
    with pytest.raises(ValueError, match="deeper than"):
        rows(validate(chain(MAX_DEPTH + 1)))
    with pytest.raises(WireError):      # the sink dead-letters it (storage/rows.py: bad_body)
        from rankscope.storage.columns import TABLE_COLUMNS, Columns
        from rankscope.storage.rows import profile_columns

        profile_columns(decode(env(chain(MAX_DEPTH + 1))), Columns(TABLE_COLUMNS["profile_samples"]))
