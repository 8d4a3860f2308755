"""The sink: pure row conversion, then real Kafka -> real chDB (valid input interleaved with garbage,
and a store that fails its first insert)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest

from rankscope.config import Settings
from rankscope.protocol.alerts import Alert
from rankscope.protocol.deadletter import DeadLetter
from rankscope.protocol.envelope import Envelope, decode, encode
from rankscope.protocol.errors import WireError
from rankscope.protocol.hardware import check_hw
from rankscope.storage.columns import TABLE_COLUMNS, Columns, InvalidMessage
from rankscope.storage.rows import hw_columns, merge_rank, steps_columns, summary_columns, trace_columns
from rankscope.storage.sink import RetryPolicy, Sink
from rankscope.storage.store import Store, StoreError, close_store, open_store
from rankscope.topics import Topic

DEADLINE_S = 60.0
T0 = (time.time_ns() // 10**9 - 3600) * 10**9  # an hour ago: inside the tables' TTLs


# ----------------------------------------------------------------------------------------------
# Message builders
# ----------------------------------------------------------------------------------------------

def env(kind: str, body: dict[str, Any], *, job: str = "job-a", rank: int = 0, seq: int = 0, sent_ns: int = T0,
        pid: int = 1000, host: str = "node0") -> Envelope:
    return Envelope(kind=kind, job=job, rank=rank, host=host, pid=pid + rank, seq=seq, sent_ns=sent_ns, body=body)


def steps_msg(rank: int, first: int, n: int, seq: int, job: str = "job-a") -> bytes:
    steps = list(range(first, first + n))
    start = [T0 + s * 10_000_000 for s in steps]
    end = [a + 8_000_000 + rank * 1000 for a in start]
    comm = [3_000_000 if s % 5 else 9_000_000 for s in steps]  # every 5th step: comm > duration -> busy 0
    return encode(env("steps", {"step": steps, "start_ns": start, "end_ns": end, "comm_ns": comm},
                      job=job, rank=rank, seq=seq, sent_ns=end[-1]))


def heartbeat_msg(rank: int, step: int, seq: int, sent_ns: int, stacks: list | None = None,
                  job: str = "job-a") -> bytes:
    return encode(env("heartbeat", {"step": step, "since_step_s": 0.5, "dropped": 0, "world_size": 2,
                                    "local_rank": rank, "stacks": stacks},
                      job=job, rank=rank, seq=seq, sent_ns=sent_ns))


def beat_msg(steps: Envelope, hb: Envelope) -> bytes:
    body = {**steps.body, "hb_step": hb.body["step"], **{k: v for k, v in hb.body.items() if k != "step"}}
    return encode(dataclasses.replace(hb, kind="beat", body=body))


def flight_msg(rank: int, seq: int, sent_ns: int, steps: list, job: str = "job-a") -> bytes:
    """A flight record, packed without encode's check: the test sends a bad one too."""
    return msgpack.packb(env("flight", {"steps": steps, "stacks": [{"thread": "MainThread", "frames": ["train.py:56 hang"]}],
                                        "reason": "alert job-a:hang:1", "request_id": "flight-1"},
                             job=job, rank=rank, seq=seq, sent_ns=sent_ns).to_dict(), use_bin_type=True)


def exit_msg(rank: int, step: int, seq: int, sent_ns: int, job: str = "job-a") -> bytes:
    return encode(env("exit", {"step": step, "reason": "exception", "detail": "RuntimeError: boom"},
                      job=job, rank=rank, seq=seq, sent_ns=sent_ns))


def stats_msg(ts_ns: int, step: int, job: str = "job-a") -> bytes:
    ranks = [{"rank": r, "ts_ns": ts_ns, "step": step, "window_steps": 20, "median_step_ns": 8_000_000,
              "p95_step_ns": 9_000_000, "median_busy_ns": 5_000_000, "median_comm_ns": 3_000_000,
              "busy_z": 0.1 * r, "state": "ok"} for r in range(2)]
    return encode(env("stats", {"ranks": ranks}, job=job, rank=-1, sent_ns=ts_ns))


def hw_msg(rank: int, ts: list[int], job: str = "job-a") -> bytes:
    n = len(ts)
    return encode(env("hw", {"ts_ns": ts, "device": [rank] * n,
                             "metrics": {"gpu_util": [50.0] * n, "mem_used": [1e9] * n, "power_w": [None] * n}},
                      job=job, rank=rank, sent_ns=ts[-1]))


def alert_json(version: int, status: str, job: str = "job-a") -> bytes:
    return Alert(alert_id="a-1", job=job, kind="slow_rank", status=status, severity="warning", ranks=[1], step=40,
                 opened_ns=T0, updated_ns=T0 + version, version=version, summary=f"rank 1 slow v{version}",
                 lost_rank_seconds=1.5 * version).to_json()


def unknown_version(data: bytes) -> bytes:
    obj = msgpack.unpackb(data, raw=False)
    obj["v"] = 99
    return msgpack.packb(obj, use_bin_type=True)


GARBAGE = b"\xc1\xffnot msgpack at all"


# ----------------------------------------------------------------------------------------------
# Pure conversion
# ----------------------------------------------------------------------------------------------

def test_steps_columns_duration_and_busy() -> None:
    cols = Columns(["job", "rank", "step", "start_ns", "end_ns", "duration_ns", "comm_ns", "busy_ns", "host", "pid",
                    "seq"])
    e = env("steps", {"step": [1, 2], "start_ns": [100, 200], "end_ns": [150, 230], "comm_ns": [20, 40]}, rank=3)
    assert steps_columns(e, cols) == 2
    assert cols.rows == 2
    assert cols.data["duration_ns"] == [50, 30]
    assert cols.data["busy_ns"] == [30, 0]
    assert cols.data["rank"] == [3, 3] and cols.data["pid"] == [1003, 1003]
    huge = env("steps", {"step": [1], "start_ns": [0], "end_ns": [2**64], "comm_ns": [0]})
    with pytest.raises(InvalidMessage, match="out of range"):
        steps_columns(huge, cols)


def test_hw_columns_long_format_skips_none() -> None:
    cols = Columns(["job", "rank", "host", "device", "ts_ns", "metric", "value"])
    hw_columns(env("hw", {"ts_ns": [1, 2], "device": [0, 0], "metrics": {"util": [1, None], "mem": [3, 4]}}), cols)
    assert sorted(zip(cols.data["ts_ns"], cols.data["metric"], cols.data["value"], strict=True)) == [
        (1, "mem", 3.0), (1, "util", 1.0), (2, "mem", 4.0)]
    with pytest.raises(WireError, match="must be a list of 1 values"):
        check_hw({"ts_ns": [1], "device": [0], "metrics": {"util": [1, 2]}})


def test_merge_rank_carries_fields_forward_and_detects_restart() -> None:
    s = {"job": "j", "rank": 0, "host": "", "pid": 0, "local_rank": -1, "world_size": -1, "last_step": -1,
         "last_seen_ns": 0, "exit_reason": "", "exit_detail": ""}
    merge_rank(s, {"host": "h", "pid": 5, "last_seen_ns": 10, "last_step": 3, "world_size": 4, "local_rank": 0})
    merge_rank(s, {"host": "h", "pid": 5, "last_seen_ns": 20, "last_step": 7})           # steps: no world size
    merge_rank(s, {"host": "h", "pid": 5, "last_seen_ns": 15, "last_step": 5})           # late, older
    assert (s["world_size"], s["local_rank"], s["last_step"], s["last_seen_ns"]) == (4, 0, 7, 20)
    merge_rank(s, {"host": "h", "pid": 5, "last_seen_ns": 30, "last_step": 7, "exit_reason": "signal",
                   "exit_detail": "SIGTERM"})
    merge_rank(s, {"host": "h", "pid": 5, "last_seen_ns": 31, "last_step": 7})           # after exit: kept
    assert s["exit_reason"] == "signal"
    merge_rank(s, {"host": "h2", "pid": 9, "last_seen_ns": 25, "last_step": 100})        # older other pid
    assert (s["pid"], s["last_step"], s["exit_reason"]) == (5, 7, "signal")
    merge_rank(s, {"host": "h2", "pid": 9, "last_seen_ns": 40, "last_step": 2})          # restarted rank
    assert (s["host"], s["pid"], s["last_step"], s["exit_reason"], s["world_size"]) == ("h2", 9, 2, "", 4)


def _trace_window(compact_paths: bool = True) -> tuple[list[bytes], bytes]:
    """A small window made by producers/trace_events.py: trace chunks and the summary message."""
    from rankscope.producers.trace_events import chunk, summarize, summary_body, to_columnar

    t = T0
    events = [
        {"type": "user_annotation", "name": "ProfilerStep#0", "start_ns": t, "dur_ns": 1000, "tid": 7},
        {"type": "python_function", "name": "train.py(3): main", "start_ns": t + 1, "dur_ns": 900, "tid": 7,
         "py_id": 1, "py_parent": -1},
        {"type": "python_function", "name": "train.py(9): step", "start_ns": t + 2, "dur_ns": 800, "tid": 7,
         "py_id": 2, "py_parent": 1},
        {"type": "cpu_op", "name": "aten::mm", "start_ns": t + 10, "dur_ns": 300, "tid": 7, "corr": 3},
        {"type": "user_annotation", "name": "gloo:all_reduce", "start_ns": t + 400, "dur_ns": 50, "tid": 8,
         "shapes": [[4, 4]], "dtypes": ["float"]},
        {"type": "kernel", "name": "gemm", "start_ns": t + 500, "dur_ns": 100, "device": 1, "stream": 7,
         "corr": 99, "linked": 3, "meta": {"grid": [1, 2, 3], "block": [32, 1, 1]}},
    ]
    col = to_columnar(events, "win-1", 40)
    bodies, truncated, sent = chunk(col, 1_000_000, max_chunk_bytes=400)
    traces = [encode(env("trace", b, rank=1, seq=i, sent_ns=t + 2000)) for i, b in enumerate(bodies)]
    functions = summarize(col, compact_paths=compact_paths)       # compact: what ranks send
    summary = encode(env("summary", summary_body(col, functions, events_sent=sent, truncated=truncated),
                         rank=1, seq=len(bodies), sent_ns=t + 3000))
    return traces, summary


def test_trace_and_summary_rows() -> None:
    from rankscope.protocol.envelope import decode
    from rankscope.protocol.trace_rows import chunk_columns

    traces, summary = _trace_window()
    assert len(traces) > 1  # self-contained chunks, each with its own tables
    cols = Columns(TABLE_COLUMNS["trace_events"])
    assert sum(trace_columns(decode(m), cols) for m in traces) == 6
    rows = sorted(zip(*(cols.data[c] for c in ("category", "name", "start_ns", "dur_ns", "device", "stream",
                                                  "step", "bytes", "attrs")), strict=True), key=lambda r: r[2])
    assert rows == [
        ("annotation", "ProfilerStep#0", T0, 1000, -1, -1, 40, 0, {}),
        ("python", "train.py(3): main", T0 + 1, 900, -1, -1, 40, 0, {}),
        ("python", "train.py(3): main;train.py(9): step", T0 + 2, 800, -1, -1, 40, 0, {}),
        ("cpu_op", "aten::mm", T0 + 10, 300, -1, -1, 40, 0, {}),
        ("collective", "gloo:all_reduce", T0 + 400, 50, -1, -1, 40, 64,
         {"op": "allreduce", "in_nelems": "16", "dtype": "float"}),
        ("kernel", "gemm", T0 + 500, 100, 1, 7, 40, 0, {"grid": "[1,2,3]", "block": "[32,1,1]"}),
    ]
    assert set(cols.data["window_id"]) == {"win-1"} and set(cols.data["rank"]) == {1}

    fcols = Columns(TABLE_COLUMNS["function_summaries"])
    window = summary_columns(decode(summary), fcols)
    assert window == {"job": "job-a", "window_id": "win-1", "rank": 1, "status": "done", "first_step": 40,
                      "last_step": 40, "start_ns": T0, "end_ns": T0 + 1000, "events": 6, "truncated": 0,
                      "updated_ns": T0 + 3000, "thread_cpu_ns": -1, "thread_runq_ns": -1}
    by_name = {n: i for i, n in enumerate(fcols.data["name"])}
    i = by_name["train.py(3): main;train.py(9): step"]
    assert (fcols.data["category"][i], fcols.data["count"][i], fcols.data["total_ns"][i],
            fcols.data["exclusive_ns"][i], fcols.data["window_ns"][i]) == ("python", 1, 800, 500, 1000)
    assert fcols.rows == 6

    # A malformed chunk is refused whole: nothing is appended.
    bad = decode(traces[0])
    types = bad.body["column_types"]
    names = bytearray(bad.body["events"]["name"])
    names[0:int(types["name"][1])] = b"\x7f" + b"\x00" * (int(types["name"][1]) - 1)   # 127: no such name
    bad.body["events"]["name"] = bytes(names)
    before = cols.rows
    with pytest.raises(InvalidMessage, match="names table"):
        trace_columns(bad, cols)
    bad = decode(traces[0])
    bad.body["paths"] = [[0, 0]] * len(bad.body["paths"])  # a cycle
    if any(p >= 0 for p in chunk_columns(bad.body)["path"]):
        with pytest.raises(InvalidMessage, match="malformed"):
            trace_columns(bad, cols)
    assert cols.rows == before
    bad = decode(summary)
    bad.body["functions"]["count"] = bad.body["functions"]["count"][:-1]
    with pytest.raises(InvalidMessage):
        summary_columns(bad, Columns(TABLE_COLUMNS["function_summaries"]))
    for spoil in ({"path": [5] * 6}, {"path": [0]}, {"call_paths": {"names": ["a"], "paths": [[0, 0]]}},
                  {"call_paths": {"names": [1], "paths": [[-1, 0]]}}, {"call_paths": [1, 2]}):
        bad = decode(summary)
        bad.body["functions"].update(spoil)
        with pytest.raises(InvalidMessage, match="summary.functions"):
            summary_columns(bad, Columns(TABLE_COLUMNS["function_summaries"]))

    # The training thread's CPU time and run-queue wait over the window, when the rank sends them.
    timed = decode(summary)
    timed.body["thread_cpu"] = [700, 300]
    assert summary_columns(timed, Columns(TABLE_COLUMNS["function_summaries"])) == {
        **window, "thread_cpu_ns": 700, "thread_runq_ns": 300}
    for spoil in ([1], [-1, 2], ["a", 1], 5):
        bad = decode(summary)
        bad.body["thread_cpu"] = spoil
        with pytest.raises(InvalidMessage, match="thread_cpu"):
            summary_columns(bad, Columns(TABLE_COLUMNS["function_summaries"]))

    # Summaries that spell every call path out (what ranks sent before compact paths) give the same rows.
    plain = Columns(TABLE_COLUMNS["function_summaries"])
    assert summary_columns(decode(_trace_window(compact_paths=False)[1]), plain) == window
    assert plain.data == fcols.data


def test_list_form_trace_chunks_give_the_same_rows() -> None:
    """Chunks with int-list columns and a full attrs list (what ranks sent before packed columns)
    are still stored, row for row as the packed form; a packed chunk whose count disagrees is refused."""
    from rankscope.protocol.envelope import decode
    from rankscope.protocol.trace_events import WIRE_INT_COLUMNS
    from rankscope.protocol.trace_rows import chunk_columns

    traces, _ = _trace_window()
    packed, listed = Columns(TABLE_COLUMNS["trace_events"]), Columns(TABLE_COLUMNS["trace_events"])
    for m in traces:
        env = decode(m)
        trace_columns(env, packed)
        cols = chunk_columns(env.body)
        body = {k: v for k, v in env.body.items() if k not in ("column_types", "count")}
        body["events"] = {**{c: cols[c].tolist() for c in WIRE_INT_COLUMNS}, "attrs": cols["attrs"]}
        trace_columns(decode(encode(Envelope(kind="trace", job=env.job, rank=env.rank, host=env.host, pid=env.pid,
                                             seq=env.seq, sent_ns=env.sent_ns, body=body))), listed)
    assert packed.rows == listed.rows == 6 and packed.data == listed.data
    bad = decode(traces[0])
    bad.body["count"] += 1
    with pytest.raises(InvalidMessage, match="count"):
        trace_columns(bad, packed)
    bad = decode(traces[0])
    bad.body["events"]["attrs"] = [[99, {"a": 1}]]
    with pytest.raises(InvalidMessage, match="row in the chunk"):
        trace_columns(bad, packed)
    assert packed.rows == 6


@pytest.mark.clickhouse
def test_trace_and_summary_rows_insert_into_chdb(tmp_path: Path) -> None:
    from rankscope.protocol.envelope import decode

    traces, summary = _trace_window()
    tables = {t: Columns(TABLE_COLUMNS[t]) for t in ("trace_events", "function_summaries", "trace_windows")}
    for m in traces:
        trace_columns(decode(m), tables["trace_events"])
    tables["trace_windows"].add_row(**summary_columns(decode(summary), tables["function_summaries"]))
    dsn = f"chdb://{tmp_path / 'ch'}"
    store = open_store(dsn)
    try:
        for name, cols in tables.items():
            assert store.insert_columns(name, cols.data) == cols.rows
        db = store.database
        assert store.query_rows(f"SELECT name, attrs['op'], bytes FROM {db}.trace_events "
                                "WHERE category = 'collective'") == [("gloo:all_reduce", "allreduce", 64)]
        assert store.query_rows(f"SELECT events, truncated, first_step, thread_cpu_ns FROM {db}.trace_windows") == [
            (6, 0, 40, -1)]
        assert int(store.query_rows(f"SELECT count() FROM {db}.function_summaries")[0][0]) == 6
    finally:
        close_store(dsn)


# ----------------------------------------------------------------------------------------------
# Real Kafka + chDB
# ----------------------------------------------------------------------------------------------

@pytest.fixture
def sink_settings(fresh_topics: Settings, tmp_path: Path) -> Iterator[Settings]:
    settings = fresh_topics.with_overrides(clickhouse_dsn=f"chdb://{tmp_path / 'ch'}",
                                           sink_group=f"sink-{uuid.uuid4().hex[:8]}",
                                           sink_batch_rows=200, sink_batch_s=0.3)
    yield settings
    close_store(settings.store_dsn)


def produce(settings: Settings, items: Sequence[tuple[Topic, bytes | None, bytes]]) -> None:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": settings.bootstrap, "linger.ms": 5})
    errors: list[Any] = []
    for topic, key, value in items:
        p.produce(topic.name_for(settings), key=key, value=value,
                  on_delivery=lambda err, _m: errors.append(err) if err else None)
    assert p.flush(30) == 0
    assert not errors


def wait_until(what: str, cond: Callable[[], bool], deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s:.0f}s waiting for {what}")
        time.sleep(0.1)


def count(store: Store, sql: str) -> int:
    return int(store.query_rows(sql)[0][0])


def read_topic(settings: Settings, topic: Topic, expect: int) -> list[bytes]:
    from confluent_kafka import Consumer

    c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"reader-{uuid.uuid4().hex[:8]}",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe([topic.name_for(settings)])
    out: list[bytes] = []
    end = time.monotonic() + DEADLINE_S
    try:
        while len(out) < expect and time.monotonic() < end:
            for m in c.consume(100, 0.5):
                if m.error() is None:
                    out.append(m.value() or b"")
    finally:
        c.close()
    return out


def committed_offsets(settings: Settings, topics: list[Topic]) -> dict[tuple[str, int], int]:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": settings.sink_group,
                  "enable.auto.commit": False})
    try:
        tps = [TopicPartition(t.name_for(settings), p) for t in topics for p in range(settings.topic_partitions)]
        return {(tp.topic, tp.partition): tp.offset for tp in c.committed(tps, timeout=10)}
    finally:
        c.close()


@pytest.mark.kafka
@pytest.mark.clickhouse
def test_sink_stores_valid_records_and_dead_letters_the_rest(sink_settings: Settings) -> None:
    s = sink_settings
    store = open_store(s.store_dsn)
    key = b"job-a"
    bad: list[tuple[Topic, bytes | None, bytes]] = []
    for topic, valid in ((Topic.STEPS, steps_msg(0, 0, 3, 0)), (Topic.STATS, stats_msg(T0, 10)),
                         (Topic.HW, hw_msg(0, [T0, T0 + 1]))):
        bad += [(topic, key, GARBAGE), (topic, key, valid[: len(valid) // 2]), (topic, key, unknown_version(valid))]
    bad += [(Topic.ALERTS, key, b"{not json"), (Topic.ALERTS, key, b'{"schema_version": 7}'),
            (Topic.DEADLETTER, b"x", GARBAGE)]
    dl_manual = DeadLetter.make(ts_ns=T0, source_topic="elsewhere", partition=0, offset=7, stage="processors",
                                reason="bad_body", detail="test", payload=b"\x00")

    # Phase 1 (before the sink starts) and phase 2 (while it runs), valid and bad interleaved.
    steps_per_rank, chunk = 300, 50
    phase1: list[tuple[Topic, bytes | None, bytes]] = []
    phase2: list[tuple[Topic, bytes | None, bytes]] = []
    seq = {0: 0, 1: 0}
    for first in range(0, steps_per_rank, chunk):
        target = phase1 if first < steps_per_rank // 2 else phase2
        for rank in (0, 1):
            seq[rank] += 1
            steps = steps_msg(rank, first, chunk, seq[rank])
            hb = heartbeat_msg(rank, first + chunk - 1, seq[rank], T0 + (first + chunk) * 10_000_000,
                               stacks=[{"thread": "MainThread", "frames": ["train.py:10 step"]}] if rank else None)
            if rank == 0:   # a v1 rank: steps and heartbeat apart, keyed by job
                target += [(Topic.STEPS, key, steps), (Topic.STEPS, key, hb)]
            else:           # a v2 rank of the same job (rolling upgrade): one beat, keyed by rank
                target.append((Topic.STEPS, b"job-a/1", beat_msg(decode(steps), decode(hb))))
        target.append((Topic.STATS, key, stats_msg(T0 + first, first)))
        target.append((Topic.HW, b"job-a/0", hw_msg(0, [T0 + first * 1000 + i for i in range(4)])))
        if bad:
            target.append(bad.pop(0))
    phase2 += bad
    # Replies topic (and the control topic, where older ranks send them): flight records are
    # stored, commands and acks are not, a bad flight record is dead-lettered.
    phase2 += [(Topic.REPLIES, key, flight_msg(1, 1000, T0 + 10**12, [[298, T0, T0 + 8, 3], [299, T0 + 9, T0 + 17, 3]])),
               (Topic.CONTROL, key, encode(env("control", {"command": "flight", "request_id": "flight-1", "ranks": None,
                                                           "args": {}}, rank=-1, seq=1, sent_ns=T0))),
               (Topic.CONTROL, key, flight_msg(0, 1001, T0 + 10**12, [["not", "ints"]]))]
    phase2 += [(Topic.STEPS, key, exit_msg(1, steps_per_rank - 1, 999, T0 + 10**12)),
               (Topic.ALERTS, key, alert_json(1, "open")), (Topic.ALERTS, key, alert_json(2, "update")),
               (Topic.DEADLETTER, b"elsewhere", dl_manual.to_json())]
    n_bad = 13   # 3 x 3 bad in steps/stats/hw, 2 bad alerts, 1 bad dead letter, 1 bad flight record

    produce(s, phase1)
    sink = Sink(s, store)
    stop = threading.Event()
    thread = threading.Thread(target=sink.run, args=(stop,), name="sink", daemon=True)
    thread.start()
    try:
        produce(s, phase2)
        n_chunks = steps_per_rank // chunk
        expected = {"steps": 2 * steps_per_rank, "heartbeats": 2 * n_chunks, "worker_stats": 2 * n_chunks,
                    "hw_samples": n_chunks * 4 * 2, "alert_events": 2, "alerts": 1, "flight_records": 1}
        for table, n in expected.items():
            sql = f"SELECT count() FROM rankscope.{table} FINAL"
            wait_until(f"{n} rows in {table}", lambda sql=sql, n=n: count(store, sql) >= n)  # type: ignore[misc]
        wait_until("dead letters counted", lambda: sink.stats()["dead_letters"] >= n_bad)
        wait_until("sink dead letters stored",
                   lambda: count(store, "SELECT count() FROM rankscope.deadletters FINAL WHERE stage='sink'") >= n_bad)
        wait_until("manual dead letter stored",
                   lambda: count(store, "SELECT count() FROM rankscope.deadletters FINAL WHERE stage='processors'") == 1)
        wait_until("exit recorded",
                   lambda: count(store, "SELECT count() FROM rankscope.ranks FINAL WHERE exit_reason != ''") == 1)
        assert thread.is_alive(), "the sink stopped"

        # Nothing lost, nothing duplicated.
        for table, n in expected.items():
            assert count(store, f"SELECT count() FROM rankscope.{table} FINAL") == n, table
        got = set(store.query_rows("SELECT rank, step FROM rankscope.steps FINAL"))
        assert got == {(r, st) for r in (0, 1) for st in range(steps_per_rank)}
        steps = store.query_df("SELECT step, duration_ns, comm_ns, busy_ns FROM rankscope.steps FINAL WHERE rank = 1 "
                               "ORDER BY step LIMIT 6")
        assert steps["duration_ns"].tolist() == [8_001_000] * 6
        assert steps["busy_ns"].tolist() == [0, 5_001_000, 5_001_000, 5_001_000, 5_001_000, 0]
        stacks = store.query_rows("SELECT rank, any(stacks) FROM rankscope.heartbeats FINAL GROUP BY rank ORDER BY rank")
        assert stacks[0] == (0, "") and json.loads(stacks[1][1])[0]["thread"] == "MainThread"
        assert count(store, "SELECT count() FROM rankscope.hw_samples FINAL WHERE metric = 'power_w'") == 0
        [(fr_rank, fr_steps, fr_stacks)] = store.query_rows("SELECT rank, steps, stacks FROM rankscope.flight_records")
        assert fr_rank == 1 and json.loads(fr_steps)[-1][0] == 299 and "hang" in fr_stacks

        # A rank that only progressed is written at most every sink_ranks_s.
        wait_until("ranks' last steps written", lambda: count(
            store, f"SELECT count() FROM rankscope.ranks FINAL WHERE last_step = {steps_per_rank - 1}") == 2)
        ranks = store.query_df("SELECT * FROM rankscope.ranks FINAL ORDER BY rank").to_dict("records")
        assert [(r["rank"], r["host"], r["pid"], r["world_size"], r["local_rank"], r["last_step"]) for r in ranks] == [
            (0, "node0", 1000, 2, 0, steps_per_rank - 1), (1, "node0", 1001, 2, 1, steps_per_rank - 1)]
        assert (ranks[0]["exit_reason"], ranks[1]["exit_reason"]) == ("", "exception")
        assert ranks[1]["exit_detail"] == "RuntimeError: boom"
        assert store.query_rows("SELECT job, world_size FROM rankscope.jobs FINAL") == [("job-a", 2)]

        alert = store.query_df("SELECT * FROM rankscope.alerts FINAL").to_dict("records")[0]
        assert (alert["version"], alert["status"], list(alert["ranks"])) == (2, "update", [1])
        assert Alert.from_json(alert["body"]).summary == "rank 1 slow v2"

        reasons = sink.stats()["dead_letter_reasons"]
        assert reasons == {"sink:not_msgpack": 6, "sink:unknown_version": 3, "sink:bad_alert": 2,
                           "sink:bad_deadletter": 1, "sink:bad_body": 1}

        # The dead letters are on the deadletter topic itself, with the source and reason.
        values = read_topic(s, Topic.DEADLETTER, expect=1 + 1 + n_bad)
        sink_dls = []
        for v in values:
            try:
                dl = DeadLetter.from_json(v)
            except Exception:
                continue
            if dl.stage == "sink":
                sink_dls.append(dl)
        assert len(sink_dls) == n_bad
        assert {d.source_topic for d in sink_dls} == {t.name_for(s) for t in
                                                       (Topic.STEPS, Topic.STATS, Topic.HW, Topic.ALERTS,
                                                        Topic.DEADLETTER, Topic.CONTROL)}
        st = sink.stats()
        assert st["rows"]["steps"] == 2 * steps_per_rank and st["store_errors"] == 0 and st["last_commit"]
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
    # Everything consumed was committed on close.
    committed = committed_offsets(s, [Topic.STEPS])
    assert sum(o for o in committed.values() if o >= 0) == len([1 for t, _, _ in phase1 + phase2 if t is Topic.STEPS])


class FailingStore:
    """Delegates to a real store; the first ``fail`` inserts raise StoreError."""

    def __init__(self, store: Store, fail: int = 1) -> None:
        self._store = store
        self.fail = fail
        self.failures = 0

    def insert_columns(self, table: str, columns: dict[str, list[Any]],
                       arrow_types: dict[str, str] | None = None) -> int:
        if self.failures < self.fail:
            self.failures += 1
            raise StoreError(f"insert into {table}: injected failure")
        return self._store.insert_columns(table, columns, arrow_types)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.mark.kafka
@pytest.mark.clickhouse
def test_failed_insert_is_not_committed_and_retried_without_duplicates(sink_settings: Settings) -> None:
    # 100-row batches: the first one fills and fails in the middle of a consume() call (rewind path).
    s = sink_settings.with_overrides(sink_batch_rows=100, sink_batch_s=1.0)
    store = open_store(s.store_dsn)
    flaky = FailingStore(store, fail=1)
    msgs = [(Topic.STEPS, b"job-b", steps_msg(r, first, 20, first // 20 + 1, job="job-b"))
            for first in range(0, 200, 20) for r in range(3)]
    msgs.append((Topic.STEPS, b"job-b", heartbeat_msg(2, 199, 100, T0 + 10**10, job="job-b")))
    produce(s, msgs)

    sink = Sink(s, flaky, retry=RetryPolicy(initial_s=1.0, max_s=1.0))  # type: ignore[arg-type]
    try:
        end = time.monotonic() + DEADLINE_S
        while flaky.failures == 0:
            assert time.monotonic() < end, "the sink never tried to write"
            sink.poll_once(0.2)
        # The batch failed: nothing written, nothing committed, the batch waits for its retry.
        assert sink.stats()["pending_retry"] and sink.stats()["store_errors"] == 1
        assert count(store, "SELECT count() FROM rankscope.steps") == 0
        assert all(o < 0 for o in committed_offsets(s, [Topic.STEPS]).values())

        while count(store, "SELECT count() FROM rankscope.steps") < 600 or not sink.stats()["last_commit"]:
            assert time.monotonic() < end, f"rows did not arrive after the retry: {sink.stats()}"
            sink.poll_once(0.2)
        # Drain whatever else arrives (nothing should), then check: exactly once, physically too.
        for _ in range(5):
            sink.poll_once(0.2)
        assert count(store, "SELECT count() FROM rankscope.steps FINAL") == 600
        assert count(store, "SELECT count() FROM rankscope.steps") == 600
        assert store.query_rows("SELECT uniqExact(rank, step) FROM rankscope.steps") == [(600,)]
        assert count(store, "SELECT count() FROM rankscope.ranks FINAL") == 3
        assert store.query_rows("SELECT world_size FROM rankscope.ranks FINAL WHERE rank = 2") == [(2,)]
        assert sink.stats()["store_errors"] == 1 and not sink.stats()["pending_retry"]
        committed = committed_offsets(s, [Topic.STEPS])
        assert sum(o for o in committed.values() if o >= 0) == len(msgs)
    finally:
        sink.close()


@pytest.mark.kafka
@pytest.mark.clickhouse
def test_two_sinks_in_one_group_rebalance_without_loss(sink_settings: Settings) -> None:
    """A second sink joins mid-stream (eager rebalance: open batches are written on revoke); a job whose
    partition moves is picked up by the other sink, which fills its rank state from the store."""
    s = sink_settings
    store = open_store(s.store_dsn)  # one process, one chDB directory: both sinks share the client
    jobs = [f"job-{i}" for i in range(8)]
    per_phase, chunk = 100, 25

    def phase(first_step: int) -> list[tuple[Topic, bytes | None, bytes]]:
        out: list[tuple[Topic, bytes | None, bytes]] = []
        for first in range(first_step, first_step + per_phase, chunk):
            for job in jobs:
                out.append((Topic.STEPS, job.encode(), steps_msg(0, first, chunk, first // chunk + 1, job=job)))
        return out

    stop = threading.Event()
    sinks = [Sink(s, store)]
    threads = [threading.Thread(target=sinks[0].run, args=(stop,), daemon=True)]
    threads[0].start()
    try:
        produce(s, phase(0))
        wait_until("first half stored",
                   lambda: count(store, "SELECT count() FROM rankscope.steps FINAL") >= len(jobs) * per_phase)
        sinks.append(Sink(s, store))
        threads.append(threading.Thread(target=sinks[1].run, args=(stop,), daemon=True))
        threads[1].start()
        # (consumer methods must not be called from another thread: assignment() from here hangs)
        wait_until("the second sink got partitions", lambda: bool(sinks[1].stats()["assignment"]))
        produce(s, phase(per_phase))
        total = len(jobs) * 2 * per_phase
        wait_until("second half stored", lambda: count(store, "SELECT count() FROM rankscope.steps FINAL") >= total)
        assert all(t.is_alive() for t in threads)
        assert count(store, "SELECT count() FROM rankscope.steps FINAL") == total
        assert store.query_rows("SELECT uniqExact(job, step) FROM rankscope.steps") == [(total,)]
        assert sinks[1].stats()["messages"] > 0 or sinks[1].stats()["rows"], "the second sink took no work"
        wait_until("rank state current", lambda: store.query_rows(
            "SELECT min(last_step), max(last_step), min(pid), count() FROM rankscope.ranks FINAL")
            == [(2 * per_phase - 1, 2 * per_phase - 1, 1000, len(jobs))])
    finally:
        stop.set()
        for t in threads:
            t.join(30)
