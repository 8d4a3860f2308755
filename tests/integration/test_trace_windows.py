"""Trace windows end to end: `rankscope trace` -> control topic -> real 2-rank torchrun job ->
torch.profiler for exactly the requested steps -> traces/summaries topics -> sink -> chDB."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from confluent_kafka import Producer

from rankscope.cli.stack.admin import ensure_topics
from rankscope.config import Settings
from rankscope.protocol.envelope import Envelope, encode
from rankscope.storage.sink import Sink
from rankscope.storage.store import Store, close_store, open_store
from rankscope.topics import Topic
from tests.integration.helpers import (
    TopicReader,
    child_env,
    start_job,
    start_processors,
    stop_process,
    tail,
    wait_until,
)

pytestmark = [pytest.mark.kafka, pytest.mark.clickhouse, pytest.mark.torchrun, pytest.mark.fault_lane]


@pytest.fixture(scope="module")
def traced_job(kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[Settings, Store, str, Path]]:
    work = tmp_path_factory.mktemp("tw")
    settings = kafka_settings.with_overrides(topic_prefix=f"w{uuid.uuid4().hex[:8]}.", data_dir=str(work),
                                             clickhouse_dsn=f"chdb://{work / 'ch'}", sink_batch_s=0.5)
    ensure_topics(settings, timeout_s=60)
    processors = start_processors(settings, work / "processors.log")
    store = open_store(settings.store_dsn)
    sink = Sink(settings, store)
    stop = threading.Event()
    thread = threading.Thread(target=sink.run, args=(stop,), daemon=True)
    thread.start()
    job = f"tw-{uuid.uuid4().hex[:6]}"
    log = work / "job.log"
    # Each step waits 30 ms as on a device: the windows need steps, not a job that takes the cores
    # from the other lanes for the whole module.
    proc = start_job(settings, job, log, "--steps", "100000", "--wait-ms", "30", nproc=2)
    try:
        wait_until(lambda: rankscope(settings, "trace", "--job", "nope-job", "--steps", "1", "--timeout", "1").returncode == 2
                   and job_known(settings, job), 180, f"processors to publish stats for {job}")
        yield settings, store, job, work
    finally:
        stop_process(proc)
        stop.set()
        thread.join(30)
        stop_process(processors)
        close_store(settings.store_dsn)
        print("job log:\n" + tail(log))


def rankscope(settings: Settings, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rankscope", *args], env=child_env(settings), capture_output=True,
                          text=True, timeout=timeout)


def job_known(settings: Settings, job: str) -> bool:
    from rankscope.control_io import known_ranks

    return known_ranks(settings, job).get(job) == [0, 1]


def test_window_covers_exactly_the_requested_steps(traced_job: tuple[Settings, Store, str, Path]) -> None:
    settings, store, job, _ = traced_job
    out = rankscope(settings, "trace", "--job", job, "--steps", "3", "--wait-done", "--timeout", "120")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(": done window") == 2, out.stdout
    # Both ranks read the window in C++ (make test builds the reader).
    assert out.stdout.count("(C++ reader)") == 2, out.stdout
    request_id = out.stdout.split()[1]

    def windows() -> list[tuple]:
        return store.query_rows(
            "SELECT rank, window_id, first_step, last_step, events, truncated, thread_cpu_ns, thread_runq_ns "
            "FROM rankscope.trace_windows FINAL "
            "WHERE job = {job:String} AND startsWith(window_id, {rid:String}) ORDER BY rank",
            parameters={"job": job, "rid": request_id})

    rows = wait_until(lambda: len(windows()) == 2 and windows(), 120, "two trace_windows rows")
    for _rank, _window_id, first, last, events, truncated, cpu_ns, runq_ns in rows:
        assert last - first + 1 == 3 and truncated == 0 and events > 0
        assert cpu_ns > 0 and runq_ns >= 0      # the training thread's CPU time and wait over the window
    assert rows[0][2] == rows[1][2], "both ranks start at the same step"
    window_id = rows[0][1]

    def counts() -> dict[tuple[int, str], int]:
        return {(r, c): n for r, c, n in store.query_rows(
            "SELECT rank, category, count() FROM rankscope.trace_events WHERE job = {job:String} "
            "AND window_id = {w:String} GROUP BY rank, category", parameters={"job": job, "w": window_id})}

    got = wait_until(lambda: (lambda c: c if sum(c.values()) == sum(r[4] for r in rows) else None)(counts()), 120,
                     "all raw events stored")
    for rank in (0, 1):
        for cat in ("cpu_op", "python", "collective"):
            assert got.get((rank, cat), 0) > 0, (rank, cat, got)
    steps = store.query_rows("SELECT DISTINCT step FROM rankscope.trace_events WHERE job = {job:String} AND "
                             "window_id = {w:String} AND step >= 0 ORDER BY step", parameters={"job": job, "w": window_id})
    assert [s[0] for s in steps] == list(range(rows[0][2], rows[0][3] + 1))
    # The tracer's own threads (heartbeat, transport, hw sampler, control, sender) are not the job's.
    own = store.query_rows(
        "SELECT rank, name FROM rankscope.trace_events WHERE job = {job:String} AND window_id = {w:String} "
        "AND category = 'python' AND match(name, '_heartbeat_loop|_work_loop|transport.py\\(\\d+\\): _run')",
        parameters={"job": job, "w": window_id})
    assert own == [], own[:5]
    # On-rank summaries agree with the raw events they summarise.
    mismatch = store.query_rows(
        "SELECT s.rank, s.category, s.name, s.count, s.total_ns, e.n, e.total FROM rankscope.function_summaries AS s FINAL "
        "INNER JOIN (SELECT rank, category, name, count() AS n, sum(dur_ns) AS total FROM rankscope.trace_events "
        "  WHERE job = {job:String} AND window_id = {w:String} GROUP BY rank, category, name) AS e "
        "ON s.rank = e.rank AND s.category = e.category AND s.name = e.name "
        "WHERE s.job = {job:String} AND s.window_id = {w:String} AND (s.count != e.n OR s.total_ns != e.total)",
        parameters={"job": job, "w": window_id})
    assert mismatch == []
    n_summ = store.query_rows("SELECT count() FROM rankscope.function_summaries FINAL WHERE job = {job:String} "
                              "AND window_id = {w:String}", parameters={"job": job, "w": window_id})[0][0]
    assert n_summ > 10


def test_small_budget_reports_truncation(traced_job: tuple[Settings, Store, str, Path]) -> None:
    settings, store, job, _ = traced_job
    out = rankscope(settings, "trace", "--job", job, "--ranks", "1", "--steps", "2", "--byte-budget", "4000",
                    "--wait-done", "--timeout", "120")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "TRUNCATED" in out.stdout and "rank 1: done" in out.stdout and "rank 0" not in out.stdout.split("sent")[-1]
    rid = out.stdout.split()[1]
    rows = wait_until(lambda: store.query_rows(
        "SELECT truncated, events FROM rankscope.trace_windows FINAL WHERE job = {job:String} AND rank = 1 "
        "AND startsWith(window_id, {rid:String})", parameters={"job": job, "rid": rid}), 120, "truncated window row")
    assert rows[0][0] == 1


def test_bad_requests_are_answered_and_the_job_goes_on(traced_job: tuple[Settings, Store, str, Path]) -> None:
    settings, store, job, _ = traced_job
    out = rankscope(settings, "trace", "--job", "no-such-job", "--steps", "2")
    assert out.returncode == 2 and "unknown job 'no-such-job'" in out.stderr
    out = rankscope(settings, "trace", "--job", job, "--ranks", "0,7", "--steps", "2")
    assert out.returncode == 2 and "has no rank [7]" in out.stderr
    out = rankscope(settings, "trace", "--job", job, "--ranks", "x-y")
    assert out.returncode == 2 and "bad rank range" in out.stderr
    # A malformed command (steps out of range) reaches the ranks and is rejected with a reason.
    control = TopicReader(settings, Topic.CONTROL)
    replies = TopicReader(settings, Topic.REPLIES)
    control.poll(2.0)
    replies.poll(1.0)
    before = store.query_rows("SELECT max(step) FROM rankscope.steps WHERE job = {job:String}",
                              parameters={"job": job})[0][0]
    producer = Producer({"bootstrap.servers": settings.bootstrap})
    env = Envelope(kind="control", job=job, rank=-1, host="t", pid=0, seq=1, sent_ns=time.time_ns(),
                   body={"command": "trace", "request_id": "bad-steps", "ranks": None, "args": {"steps": -5}})
    producer.produce(Topic.CONTROL.name_for(settings), key=job.encode(), value=encode(env))
    garbage = msgpack.packb({"v": 1, "kind": "control", "job": job, "body": {"request_id": "bad-shape"}})
    producer.produce(Topic.CONTROL.name_for(settings), key=job.encode(), value=garbage)
    producer.flush(10)

    def rejections() -> dict[str, set[int]]:
        replies.poll(1.0)
        out: dict[str, set[int]] = {}
        for v in replies.values:
            m = msgpack.unpackb(v)
            if m.get("kind") == "ack" and m["body"]["status"] == "rejected":
                out.setdefault(m["body"]["request_id"], set()).add(m["rank"])
        return out

    got = wait_until(lambda: (lambda r: r if r.get("bad-steps") == {0, 1} and r.get("bad-shape") == {0, 1} else None)(
        rejections()), 60, "both ranks to reject both malformed commands")
    assert got
    acks = [msgpack.unpackb(v) for v in replies.values]
    reasons = [m["body"]["detail"] for m in acks if m.get("kind") == "ack" and m["body"]["request_id"] == "bad-steps"]
    assert any("steps=-5" in r for r in reasons), reasons
    # The ranks read the control topic, so it holds commands only: their answers are on the replies topic.
    control.poll(1.0)
    assert {msgpack.unpackb(v).get("kind") for v in control.values} == {"control"}
    control.close()
    replies.close()
    wait_until(lambda: store.query_rows("SELECT max(step) FROM rankscope.steps WHERE job = {job:String}",
                                        parameters={"job": job})[0][0] > before + 50, 120, "the job to keep stepping")


def test_flight_recorder_is_sent_on_request(traced_job: tuple[Settings, Store, str, Path]) -> None:
    settings, store, job, _ = traced_job
    replies = TopicReader(settings, Topic.REPLIES)
    replies.poll(2.0)
    producer = Producer({"bootstrap.servers": settings.bootstrap})
    env = Envelope(kind="control", job=job, rank=-1, host="t", pid=0, seq=1, sent_ns=time.time_ns(),
                   body={"command": "flight", "request_id": "fl-1", "ranks": [1], "args": {"reason": "test"}})
    producer.produce(Topic.CONTROL.name_for(settings), key=job.encode(), value=encode(env))
    producer.flush(10)

    def answers(kind: str) -> list[dict]:
        replies.poll(1.0)
        return [m for m in (msgpack.unpackb(v) for v in replies.values)
                if m.get("kind") == kind and m["body"].get("request_id") == "fl-1"]

    got = wait_until(lambda: answers("flight"), 60, "a flight record from rank 1")
    wait_until(lambda: answers("ack"), 60, "rank 1's ack of the flight request")
    time.sleep(2.0)
    # Only rank 1 answers, once. (When flight records went to the control topic, every rank of the
    # job read rank 1's record as a malformed command and answered it with a 'rejected' ack.)
    assert [(m["rank"], m["body"]["status"]) for m in answers("ack")] == [(1, "done")]
    replies.close()
    assert [m["rank"] for m in got] == [1]
    body = got[0]["body"]
    assert len(body["steps"]) == settings.flight_steps  # the ring buffer is full after hundreds of steps
    steps = [s[0] for s in body["steps"]]
    assert steps == sorted(steps) and steps[-1] - steps[0] == settings.flight_steps - 1
    assert any(s["thread"] == "MainThread" for s in body["stacks"])
    # ... and stored by the sink.
    sql = f"SELECT rank, request_id, steps FROM rankscope.flight_records WHERE job = '{job}' AND request_id = 'fl-1'"
    rows = wait_until(lambda: store.query_rows(sql), 60, "the flight record in ClickHouse")
    assert rows[0][0] == 1 and len(json.loads(rows[0][2])) == settings.flight_steps


def test_a_window_asked_of_a_hung_job_says_why_it_does_not_start(traced_job: tuple[Settings, Store, str, Path]
                                                                 ) -> None:
    from rankscope.control_io import latest_stats

    settings, _, _, work = traced_job
    job = f"twh-{uuid.uuid4().hex[:6]}"
    log = work / f"{job}.log"
    proc = start_job(settings, job, log, "--steps", "100000", "--hang-rank", "1", "--hang-after-s", "3",
                     "--wait-ms", "30", nproc=2)
    try:
        at = wait_until(lambda: re.search(r"rank 1: hanging at step (\d+)", log.read_text(errors="replace")), 240,
                        "rank 1 to hang")
        hang_step = int(at.group(1)) - 1
        # The latest stats hold both ranks' last steps, and no step has ended for the hang threshold.
        def idle_s() -> float:
            rows = latest_stats(settings).get(job, [])
            if len(rows) < 2 or min(r["step"] for r in rows) < hang_step - 1:
                return 0.0
            return (time.time_ns() - max(r["step_end_ns"] for r in rows)) / 1e9
        wait_until(lambda: idle_s() > settings.hang_min_s + 1, 180, f"{job}'s stats to stop at step {hang_step}")
        out = rankscope(settings, "trace", "--job", job, "--steps", "3", "--wait-done", "--timeout", "8")
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"note: job {job} is not stepping (ranks [0, 1] without a step for" in out.stderr, out.stderr
        assert "starts only when their steps resume" in out.stderr and f"rankscope alerts --job {job}" in out.stderr
        assert "did not finish their window within 8s (the job was not stepping when asked" in out.stderr, out.stderr
    finally:
        stop_process(proc)
        print("hung job log:\n" + tail(log))
