"""Messages to a batch of rows without Kafka or a store: storage/convert.py's RowBuilder."""

from __future__ import annotations

import msgpack
import pytest

from rankscope.protocol.envelope import Envelope, encode
from rankscope.storage.columns import InvalidMessage
from rankscope.storage.convert import Batch, RowBuilder
from rankscope.topics import Topic


def beat(rank: int, step: int, sent_ns: int) -> bytes:
    return encode(Envelope("beat", "j", rank, "h", 10 + rank, step, sent_ns,
                           {"step": [step], "start_ns": [step * 100], "end_ns": [step * 100 + 90],
                            "comm_ns": [30], "hb_step": step, "since_step_s": 0.0, "dropped": 0, "world_size": 2,
                            "local_rank": rank, "stacks": None}))


def test_beats_become_step_and_heartbeat_rows_and_rank_state():
    rows, batch = RowBuilder(), Batch(started_at=0.0)
    for step in range(3):
        for rank in range(2):
            rows.add(Topic.STEPS, beat(rank, step, 1000 + step), batch)
    steps = batch.tables["steps"].data
    assert steps["step"] == [0, 0, 1, 1, 2, 2] and steps["busy_ns"] == [60] * 6
    assert len(batch.tables["heartbeats"].data["ts_ns"]) == 6 and batch.rows == 12
    assert rows.ranks[("j", 1)]["last_step"] == 2 and rows.ranks[("j", 1)]["world_size"] == 2
    assert rows.jobs["j"]["last_seen_ns"] == 1002 and batch.ranks == {("j", 0), ("j", 1)}


def test_bad_input_raises_and_adds_nothing():
    rows, batch = RowBuilder(), Batch(started_at=0.0)
    with pytest.raises(InvalidMessage) as e:
        rows.add(Topic.STEPS, b"\x00 not msgpack", batch)
    assert e.value.reason == "not_msgpack"
    with pytest.raises(InvalidMessage):
        rows.add(Topic.STEPS, msgpack.packb({"v": 99, "kind": "steps"}), batch)
    with pytest.raises(InvalidMessage):
        rows.add(Topic.ALERTS, b"{}", batch)
    assert batch.rows == 0 and batch.tables == {} and rows.ranks == {}


def test_kinds_the_store_does_not_keep_are_counted_as_skipped():
    rows, batch = RowBuilder(), Batch(started_at=0.0)
    ack = encode(Envelope("ack", "j", 0, "h", 1, 1, 1, {"request_id": "r", "status": "accepted", "detail": ""}))
    rows.add(Topic.REPLIES, ack, batch)
    assert rows.skipped == {"ack": 1} and batch.rows == 0


def fr_dump(dump: str) -> bytes:
    return encode(Envelope("fr_dump", "j", 1, "h", 11, 5, 2000,
                           {"request_id": "flight-a", "reason": "alert a", "dump": dump, "truncated": False}))


def test_flight_recorder_dumps_are_kept_and_garbage_ones_refused():
    rows, batch = RowBuilder(), Batch(started_at=0.0)
    rows.add(Topic.REPLIES, fr_dump('{"version": "2.10", "entries": [], "pg_status": {}}'), batch)
    t = batch.tables["fr_dumps"].data
    assert t["request_id"] == ["flight-a"] and t["rank"] == [1] and t["truncated"] == [0] and batch.rows == 1
    for bad in ("not json", '{"no": "entries"}', "[1, 2]"):
        with pytest.raises(InvalidMessage) as e:
            rows.add(Topic.REPLIES, fr_dump(bad), batch)
        assert e.value.reason == "bad_body"
    assert batch.rows == 1


PROFILE = {"t0_ns": 10**18, "t1_ns": 10**18 + 10**10, "hz": 20.0, "ticks": 200, "roles": ["training", "dataloader"],
           "names": ["train.py:1 <module>", "data.py:7 Dataset.__getitem__"], "paths": [[-1, 0], [-1, 1]],
           "path": [0, 1], "role": [0, 1], "count": [190, 55], "other": [10, 0]}


def test_profiles_become_one_row_per_call_path_and_garbage_ones_are_refused():
    rows, batch = RowBuilder(), Batch(started_at=0.0)
    rows.add(Topic.PROFILES, encode(Envelope("profile", "j", 2, "h", 77, 5, 2000, PROFILE)), batch)
    t = batch.tables["profile_samples"].data
    assert list(zip(t["role"], t["path"], t["samples"], strict=True)) == [
        ("training", "train.py:1 <module>", 190), ("dataloader", "data.py:7 Dataset.__getitem__", 55),
        ("training", "", 10)]
    assert set(t["pid"]) == {77} and set(t["interval_ns"]) == {10**10} and set(t["ts_ns"]) == {10**18}
    garbage = msgpack.packb({"v": 2, "kind": "profile", "job": "j", "rank": 2, "host": "h", "pid": 1, "seq": 1,
                             "sent_ns": 1, "body": {**PROFILE, "path": [0, 5]}})
    with pytest.raises(InvalidMessage) as e:
        rows.add(Topic.PROFILES, garbage, batch)
    assert e.value.reason == "bad_body" and batch.tables["profile_samples"].rows == 3
