"""``rankscope run`` on an unmodified script: real torchrun ranks (gloo) -> real Kafka -> processors
-> alerts topic and chDB. The script (tests/integration/scripts/plain_ddp.py) imports nothing of
rankscope and calls no tracer: steps come from its two optimizers, DDP is found by itself.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankscope.config import Settings
from rankscope.protocol.envelope import decode
from rankscope.storage.store import Store
from rankscope.topics import Topic
from tests.integration.helpers import (
    AlertReader,
    TopicReader,
    processors_and_sink,
    rankscope_run,
    stop_process,
    tail,
    wait_until,
)

pytestmark = [pytest.mark.kafka, pytest.mark.clickhouse, pytest.mark.torchrun]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "plain_ddp.py"
# Rule settings of this module's processors, explicit: a short hang threshold keeps the hang job
# short; the slow-rank rule judges over at least 10 s.
RULES = {"RANKSCOPE_HANG_MIN_S": "6", "RANKSCOPE_STRAGGLER_MIN_S": "10"}

Stack = tuple[Settings, Store, Path]


@pytest.fixture(scope="module")
def stack(kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Fresh topics, a processors worker subprocess with RULES, and a sink thread writing chDB in tmp."""
    work = tmp_path_factory.mktemp("attach")
    with processors_and_sink(kafka_settings, work, RULES) as (settings, store):
        yield settings, store, work


def run_job(settings: Settings, job: str, log: Path, *args: str, nproc: int = 4) -> subprocess.Popen[bytes]:
    """``rankscope run -- torchrun ... plain_ddp.py ARGS`` as a user would type it."""
    return rankscope_run(settings, job, log, SCRIPT, *args, nproc=nproc, rules=RULES)


def diagnostics(work: Path, log: Path) -> str:
    return "job log:\n" + tail(log) + "\nprocessors log:\n" + tail(work / "processors.log")


def test_the_script_is_unmodified() -> None:
    text = SCRIPT.read_text()
    assert "rankscope" not in text.split('"""', 2)[2] and "Tracer" not in text


def test_a_slow_ddp_rank_is_named_without_watch_ddp(stack: Stack) -> None:
    settings, _store, work = stack
    job = f"attach-slow-{uuid.uuid4().hex[:6]}"
    log = work / f"{job}.log"
    reader = AlertReader(settings)
    proc = run_job(settings, job, log, "--steps", "100000", "--slow-rank", "1", "--slow-factor", "4")
    try:
        slow = reader.wait_for(lambda a: a.job == job and a.kind == "slow_rank" and a.status in ("open", "update"),
                               300, "slow_rank", lambda: diagnostics(work, log))
        assert slow.ranks == [1], slow.summary
        assert proc.poll() is None, tail(log)      # named while the job runs
    finally:
        stop_process(proc)
        reader.close()


def test_a_hang_in_a_dataset_getitem_is_named_with_that_frame(stack: Stack) -> None:
    settings, _store, work = stack
    job = f"attach-hang-{uuid.uuid4().hex[:6]}"
    log = work / f"{job}.log"
    reader = AlertReader(settings)
    # Batches of 32: index 32 * 60 is the first sample of iteration 60.
    proc = run_job(settings, job, log, "--steps", "100000", "--hang-rank", "2", "--hang-at-index", str(32 * 60),
                   nproc=3)
    try:
        hang = reader.wait_for(lambda a: a.job == job and a.kind == "hang" and a.status in ("open", "update"),
                               300, "hang", lambda: diagnostics(work, log))
        assert hang.ranks == [2], hang.summary
        assert hang.step == 59, hang.summary       # iterations 0..59 done: stuck loading iteration 60
        culprit = [g for g in hang.stack_groups if 2 in g.ranks]
        assert culprit and not culprit[0].waiting_in_collective
        assert any("plain_ddp.py" in f and "__getitem__" in f for f in culprit[0].frames), culprit[0].frames
        # The peers wait in DDP's gradient all-reduce, inside backward.
        waiting = [g for g in hang.stack_groups if 2 not in g.ranks]
        assert waiting and all(g.waiting_in_collective for g in waiting), waiting
        assert sorted(r for g in hang.stack_groups for r in g.ranks) == [0, 1, 2]
    finally:
        stop_process(proc)
        reader.close()


def drain(reader: TopicReader, timeout_s: float) -> None:
    """Poll ``reader`` until it has read every message its topic held when this was called."""
    consumer = reader.consumer
    parts = wait_until(lambda: (reader.poll(0.5), consumer.assignment())[1], timeout_s, "partitions assigned")
    ends = {(p.topic, p.partition): consumer.get_watermark_offsets(p, timeout=10) for p in parts}

    def caught_up() -> bool:
        reader.poll(0.5)
        return all(lo == hi or p.offset >= hi
                   for p in consumer.position(parts) for lo, hi in [ends[(p.topic, p.partition)]])

    wait_until(caught_up, timeout_s, "the end of the topic")


def test_a_healthy_run_stays_silent_and_counts_one_step_per_iteration(stack: Stack) -> None:
    settings, store, work = stack
    job = f"attach-ok-{uuid.uuid4().hex[:6]}"
    log = work / f"{job}.log"
    # At least 1,500 steps and 30 s of stored steps (31 s: step 0, the start-up, has no record). Each
    # step waits 15 ms as on a device, so the four ranks leave the 2 cores room: four ranks that each
    # want a whole core, beside the lane's broker, processors and sink, can starve one of them long
    # enough that the rule names it slow, as it should for a rank its host holds back.
    proc = run_job(settings, job, log, "--steps", "1501", "--min-seconds", "31", "--wait-ms", "15")
    assert proc.wait(900) == 0, tail(log)
    stats = TopicReader(settings, Topic.STATS)
    alerts = AlertReader(settings)

    def all_exited() -> dict[int, int] | None:
        stats.poll(1.0)
        got: dict[int, tuple[str, int]] = {}
        for v in stats.values:
            env = decode(v)
            if env.job == job:
                got.update({r["rank"]: (r["state"], r["step"]) for r in env.body["ranks"]})
        done = sorted(got) == [0, 1, 2, 3] and all(state == "exited" for state, _ in got.values())
        return {r: step for r, (_, step) in got.items()} if done else None

    last = wait_until(all_exited, 120, "processors to see all four ranks exit")
    final = last[0]
    assert set(last.values()) == {final} and final >= 1500, last      # the ranks agreed on the last step
    drain(alerts, 120)
    assert alerts.alerts(job) == [], [(a.summary, a.details) for a in alerts.alerts(job)]
    # Two optimizers step per iteration, one step is counted; step 0 (start-up) has no record.
    def stored() -> tuple | None:
        row = tuple(store.query_rows("SELECT count(), min(step), max(step), uniqExact(rank), "
                                     "(max(end_ns) - min(start_ns)) / 1e9 FROM rankscope.steps "
                                     "FINAL WHERE job = {job:String}", parameters={"job": job})[0])
        return row if row[0] >= 4 * final else None

    count, first, top, ranks, seconds = wait_until(stored, 120, f"{4 * final} step rows in ClickHouse")
    assert (count, first, top, ranks) == (4 * final, 1, final, 4)
    assert seconds >= 30, seconds
    exits = store.query_rows("SELECT rank, exit_reason FROM rankscope.ranks FINAL WHERE job = {job:String} ORDER BY rank",
                             parameters={"job": job})
    assert [tuple(r) for r in exits] == [(r, "completed") for r in range(4)]
    stats.close()
    alerts.close()


def test_a_raised_exception_is_recorded_with_its_type_and_frames(stack: Stack) -> None:
    settings, _store, work = stack
    job = f"attach-crash-{uuid.uuid4().hex[:6]}"
    log = work / f"{job}.log"
    steps = TopicReader(settings, Topic.STEPS)
    reader = AlertReader(settings)
    proc = run_job(settings, job, log, "--steps", "100000", "--crash-rank", "1", "--crash-at-step", "30", nproc=3)
    try:
        assert wait_until(lambda: proc.poll() is not None, 240, "the job to end after the failure"), tail(log)
        assert proc.returncode != 0

        def exits() -> dict[int, dict]:
            steps.poll(1.0)
            return {e.rank: e.body for e in map(decode, steps.values) if e.job == job and e.kind == "exit"}

        got = wait_until(lambda: (lambda x: x if 1 in x else None)(exits()), 120, "rank 1's exit record")
        body = got[1]
        assert body["reason"] == "exception" and body["step"] == 29, body
        assert body["exc_type"] == "StepFailed", body       # named as tracebacks name it
        assert body["detail"] == "StepFailed: rank 1: planted failure at step 30", body
        assert body["frames"][-1].endswith(" main") and "plain_ddp.py:" in body["frames"][-1], body["frames"]
        alert = reader.wait_for(lambda a: a.job == job and a.kind == "rank_failed", 120, "rank_failed",
                                lambda: diagnostics(work, log))
        assert alert.ranks == [1] and alert.step == 30, alert.summary
        assert alert.details["exc_type"] == "StepFailed", alert.details
    finally:
        stop_process(proc)
        steps.close()
        reader.close()
