"""The processors under real faults: kill -9 and SIGTERM restarts, a worker lost from a group of two,
and a job of 4,096 ranks. Real broker, real `rankscope processors` processes, simulated ranks that
send the real wire format through real producers (benchmarks/loadgen.py). Deadlines are generous;
nothing waits a fixed time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankscope.config import Settings
from rankscope.protocol.alerts import Alert
from rankscope.protocol.envelope import decode
from rankscope.topics import Topic
from tests.integration.helpers import (
    REPO,
    AlertReader,
    TopicReader,
    child_env,
    start_processors,
    stop_process,
    tail,
    wait_until,
)

pytestmark = [pytest.mark.kafka]
MAX_RECORD_BYTES = 64 * 1024


@pytest.fixture
def settings(fresh_topics: Settings) -> Settings:
    return fresh_topics.with_overrides(hang_min_s=8.0)


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


def start_load(settings: Settings, log: Path, job: str, ranks: int, duration_s: float, *args: str,
               procs: int = 1) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "benchmarks.loadgen", "--ranks", str(ranks), "--duration", str(duration_s),
           "--procs", str(procs), "--job", job, "--no-hw", *args]
    return subprocess.Popen(cmd, env=child_env(settings), cwd=REPO, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def end_load(load: subprocess.Popen[bytes], log: Path) -> None:
    """End a load before its ``--duration`` (SIGTERM to loadgen): its ranks send their exit records."""
    load.send_signal(signal.SIGTERM)
    assert load.wait(120) == 0, tail(log)
    summary = json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])
    assert summary["wall_s"] < summary["config"]["duration_s"], summary["wall_s"]   # it ended early


def kill9(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def ready_count(log: Path) -> int:
    """How many times a worker has taken its partitions (rebuilt them and is running)."""
    return tail(log, 10_000).count("assigned steps partitions")


def opened(alerts: list[Alert], job: str, kind: str) -> list[Alert]:
    """The incidents of ``kind`` opened for ``job``. The alerts topic is at least once: a message the
    producer sent again is the same (alert_id, version) and counts once, as its consumers keep one
    version per alert_id; an incident opened again is a new alert_id and counts twice."""
    seen: dict[tuple[str, int], Alert] = {}
    for a in alerts:
        if a.job == job and a.kind == kind and a.status == "open":
            seen.setdefault((a.alert_id, a.version), a)
    return list(seen.values())


def test_kill9_and_sigterm_restarts_miss_no_incident_and_duplicate_none(settings: Settings, work: Path) -> None:
    log1, log2, log3 = work / "proc1.log", work / "proc2.log", work / "proc3.log"
    alerts = AlertReader(settings)
    proc = start_processors(settings, log1)
    diag = lambda: "\n".join(f"--- {p.name}\n{tail(p, 60)}" for p in sorted(work.glob("*.log")))  # noqa: E731
    jobs = [f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}", f"c-{uuid.uuid4().hex[:6]}"]
    loads = []
    try:
        wait_until(lambda: ready_count(log1) >= 1, 120, "the first worker to take its partitions")
        # Job a hangs early (named before the kill); job b hangs later (after the kill -9 and restart);
        # job c hangs after a SIGTERM restart. Each rank sends a beat per second for 240 s.
        loads.append(start_load(settings, work / "a.log", jobs[0], 16, 240, "--hang-at", "8", "--hang-rank", "3", "--exit"))
        loads.append(start_load(settings, work / "b.log", jobs[1], 16, 240, "--hang-at", "60", "--hang-rank", "5", "--exit"))
        t_c = time.monotonic()
        loads.append(start_load(settings, work / "c.log", jobs[2], 16, 240, "--hang-at", "110", "--hang-rank", "9", "--exit"))
        a_open = alerts.wait_for(lambda a: a.job == jobs[0] and a.kind == "hang" and a.status == "open", 90,
                                 "job a's hang before the kill", diag)
        assert a_open.ranks == [3], a_open.summary
        kill9(proc)
        proc = start_processors(settings, log2)
        wait_until(lambda: ready_count(log2) >= 1, 120, "the restarted worker to take its partitions")
        b_open = alerts.wait_for(lambda a: a.job == jobs[1] and a.kind == "hang" and a.status == "open", 150,
                                 "job b's hang after the kill -9 restart", diag)
        assert b_open.ranks == [5], b_open.summary
        # SIGTERM restart with a non-empty broker: ready and alerting within 30 s.
        stop_process(proc)
        restarted = time.monotonic()
        proc = start_processors(settings, log3)
        wait_until(lambda: ready_count(log3) >= 1, 60, "the worker after SIGTERM to take its partitions")
        c_open = alerts.wait_for(lambda a: a.job == jobs[2] and a.kind == "hang" and a.status == "open", 200,
                                 "job c's hang after the SIGTERM restart", diag)
        got_c = time.monotonic()
        assert c_open.ranks == [9], c_open.summary
        hang_c_due = t_c + 110 + settings.hang_min_s
        assert got_c - max(restarted, hang_c_due) <= 30, (got_c - restarted, got_c - hang_c_due)
        for load, name in zip(loads, "abc", strict=True):
            end_load(load, work / f"{name}.log")
        wait_until(lambda: (alerts.poll(1.0), all(
            any(a.job == j and a.kind == "hang" and a.status == "resolved" for a in alerts.alerts()) for j in jobs))[1],
            120, "every hang to resolve when the ranks exit")
        alerts.poll(2.0)
        got = alerts.alerts()
        for job in jobs:
            hangs = [a for a in got if a.job == job and a.kind == "hang"]
            assert len(opened(got, job, "hang")) == 1, [a.summary for a in hangs]
            assert len({a.alert_id for a in hangs}) == 1, [(a.alert_id, a.status) for a in hangs]
        # job a's incident was open across both restarts: every later version kept its id
        assert {a.alert_id for a in got if a.job == jobs[0] and a.kind == "hang"} == {a_open.alert_id}
        others = [a.summary for a in got if a.job in jobs and a.kind != "hang"]
        assert others == [], others
        assert "Error in recovery" not in tail(log2, 10_000) + tail(log3, 10_000)
    finally:
        for load in loads:
            stop_process(load)
        stop_process(proc)
        alerts.close()


def test_a_survivor_takes_over_the_partitions_of_a_killed_worker(settings: Settings, work: Path) -> None:
    logs = [work / "w1.log", work / "w2.log"]
    alerts = AlertReader(settings)
    workers = [start_processors(settings, logs[0]), start_processors(settings, logs[1])]
    diag = lambda: "\n".join(f"--- {p.name}\n{tail(p, 60)}" for p in sorted(work.glob("*.log")))  # noqa: E731
    job = f"two-{uuid.uuid4().hex[:6]}"
    load = None
    try:
        wait_until(lambda: ready_count(logs[0]) >= 1 and ready_count(logs[1]) >= 1, 120, "both workers to join")
        load = start_load(settings, work / "job.log", job, 64, 150, "--hang-at", "45", "--hang-rank", "17", "--exit")
        # The job's ranks are folded on both workers (summaries from every partition); then the one
        # that folds the rank about to hang dies.
        summaries = TopicReader(settings, Topic.SHARDS)

        def both_fold() -> bool:
            summaries.poll(1.0)
            ours = [e for e in map(decode, summaries.values) if e.job == job]
            senders = {(e.pid, e.body["shard"]) for e in ours}
            return len({pid for pid, _ in senders}) == 2 and len({s for _, s in senders}) == settings.topic_partitions \
                and any(row[0] == 17 for e in ours for row in e.body["rows"])
        wait_until(both_fold, 120, "both workers to fold the job's ranks")
        holder = [e.pid for e in map(decode, summaries.values)
                  if e.job == job and any(row[0] == 17 for row in e.body["rows"])][-1:]
        summaries.close()
        [victim] = [w for w in workers if w.pid in holder]
        survivor = workers[1 - workers.index(victim)]
        survivor_log = logs[workers.index(survivor)]
        kill9(victim)
        hang = alerts.wait_for(lambda a: a.job == job and a.kind == "hang" and a.status == "open", 150,
                               "the job's hang after a worker died", diag)
        assert hang.ranks == [17], hang.summary
        end_load(load, work / "job.log")
        alerts.poll(3.0)
        got = [a for a in alerts.alerts() if a.job == job]
        assert len(opened(got, job, "hang")) == 1, [a.summary for a in got]
        assert [a.summary for a in got if a.kind != "hang"] == []
        assert survivor.poll() is None, tail(survivor_log)
    finally:
        if load is not None:
            stop_process(load)
        for w in workers:
            stop_process(w)
        alerts.close()


def test_a_4096_rank_job_stays_within_message_bounds(settings: Settings, work: Path) -> None:
    log = work / "proc.log"
    proc = start_processors(settings, log)
    job = f"big-{uuid.uuid4().hex[:6]}"
    alerts = AlertReader(settings)
    shards = TopicReader(settings, Topic.SHARDS)
    stats = TopicReader(settings, Topic.STATS)
    load = None
    try:
        wait_until(lambda: ready_count(log) >= 1, 120, "the worker to take its partitions")
        load = start_load(settings, work / "big.log", job, 4096, 45, "--hang-at", "25", "--hang-rank", "4000",
                          procs=2)
        assert load.wait(300) == 0, tail(work / "big.log")

        def summaries_seen() -> bool:
            shards.poll(1.0)
            return len(shards.values) >= settings.topic_partitions
        wait_until(summaries_seen, 120, "shard summaries")
        hang = alerts.wait_for(lambda a: a.job == job and a.kind == "hang" and a.status == "open", 180,
                               "the 4,096-rank job's hang", lambda: tail(log))
        assert 4000 in hang.ranks
        stats.poll(3.0)
        alerts.poll(1.0)
        sizes = {"shards": max(map(len, shards.values)), "stats": max(map(len, stats.values)),
                 "alerts": max(map(len, alerts.values))}
        assert all(n < MAX_RECORD_BYTES for n in sizes.values()), sizes
        text = tail(log, 100_000)
        assert "MessageSizeTooLarge" not in text and "too large" not in text.lower()
        assert proc.poll() is None, tail(log)
    finally:
        if load is not None:
            stop_process(load)
        stop_process(proc)
        for r in (alerts, shards, stats):
            r.close()


def jobs_on_every_partition(settings: Settings, prefix: str) -> list[str]:
    """One job id per partition of the shards topic (keyed by job, murmur2 as the clients hash)."""
    from aiokafka.partitioner import DefaultPartitioner

    parts = list(range(settings.topic_partitions))
    found: dict[int, str] = {}
    i = 0
    while len(found) < len(parts):
        job = f"{prefix}{i}"
        found.setdefault(DefaultPartitioner()(job.encode(), parts, parts), job)
        i += 1
    return [found[p] for p in parts]


def test_a_worker_added_mid_job_loses_no_incident(settings: Settings, work: Path) -> None:
    logs = [work / "w1.log", work / "w2.log"]
    alerts = AlertReader(settings)
    diag = lambda: "\n".join(f"--- {p.name}\n{tail(p, 60)}" for p in sorted(work.glob("*.log")))  # noqa: E731
    # One job per shards partition: whichever partitions the new worker takes, incidents move with them.
    jobs = jobs_on_every_partition(settings, f"add-{uuid.uuid4().hex[:4]}-")
    workers = [start_processors(settings, logs[0])]
    loads = []
    try:
        wait_until(lambda: ready_count(logs[0]) >= 1, 120, "the first worker to take its partitions")
        loads = [start_load(settings, work / f"{job}.log", job, 16, 100, "--dead-at", "10", "--dead-rank", "5",
                            "--hang-at", "55", "--hang-rank", "9", "--exit") for job in jobs]
        for job in jobs:
            alerts.wait_for(lambda a, job=job: a.job == job and a.kind == "dead_rank" and a.status == "open", 120,
                            f"{job}'s dead rank", diag)
        workers.append(start_processors(settings, logs[1]))

        def took_open_incidents() -> bool:
            moved = [line for line in tail(logs[1], 10_000).splitlines() if "assigned shards partitions [" in line
                     and "assigned shards partitions []" not in line]
            return bool(moved) and ready_count(logs[1]) >= 1 and not moved[-1].endswith("(0 open incidents)")
        wait_until(took_open_incidents, 120, "the new worker to take shards partitions with their open incidents")
        for job in jobs:
            alerts.wait_for(lambda a, job=job: a.job == job and a.kind == "hang" and a.status == "open", 150,
                            f"{job}'s hang after a worker joined", diag)
        for load, job in zip(loads, jobs, strict=True):
            end_load(load, work / f"{job}.log")
        alerts.poll(3.0)
        for job in jobs:
            got = [a for a in alerts.alerts() if a.job == job]
            dead = [a for a in got if a.kind == "dead_rank"]
            assert len(opened(got, job, "dead_rank")) == 1 and len({a.alert_id for a in dead}) == 1, \
                [(a.status, a.alert_id.rsplit(":", 1)[-1], a.version) for a in dead]
            [hang] = opened(got, job, "hang")
            assert hang.ranks == [9], hang.summary
            assert [a.summary for a in got if a.kind not in ("hang", "dead_rank")] == []
        assert all(w.poll() is None for w in workers), diag()
    finally:
        for load in loads:
            stop_process(load)
        for w in workers:
            stop_process(w)
        alerts.close()
