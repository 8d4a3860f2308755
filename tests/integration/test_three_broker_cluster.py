"""A broker lost mid-job on a three-node KRaft cluster loses no step and no alert.

Three nodes from the project's own start-up (cli/stack/broker_cluster.py LocalCluster: each node a combined
broker + controller, one quorum, one cluster id), topics at replication 3 and min.insync.replicas 2.
A real torchrun job sends its steps; real `rankscope processors` and a real sink (a thread writing
chDB) consume them. Mid-job the node that leads the steps partitions of most of the job's ranks is
killed with SIGKILL (a real kill -9 of its java process). A hang planted after the kill is reported once, every step
every rank ran is stored, and the processors and the sink go on. Deadlines are generous; nothing
waits a fixed time.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import ConfigResource, ResourceType

from rankscope.cli.stack.admin import admin_client, ensure_topics
from rankscope.cli.stack.broker_cluster import LocalCluster
from rankscope.config import Settings
from rankscope.protocol.envelope import rank_key
from rankscope.topics import Topic, all_topic_names
from tests.integration.helpers import (
    AlertReader,
    child_env,
    free_port,
    start_job,
    stop_process,
    tail,
    wait_until,
)

pytestmark = [pytest.mark.kafka, pytest.mark.clickhouse, pytest.mark.torchrun, pytest.mark.fault_lane]

NODES = 3
RANKS = 4
HANG_RANK = 3


def distinct_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    ports = distinct_ports(2 * NODES)
    c = LocalCluster(Settings.from_env(data_dir=str(tmp_path / "kafka")), nodes=NODES,
                     ports=list(zip(ports[::2], ports[1::2], strict=True)))
    try:
        c.start(timeout_s=180)   # raises BrokerError with each node's log tail: the test fails, never skips
        yield c
    finally:
        c.stop()
        for n in c.nodes:
            print(f"--- node {n.node_id} broker.log\n{tail(n.log_path, 20)}")


@dataclass
class Pipeline:
    settings: Settings
    store: Any
    processors: subprocess.Popen[bytes]   # `rankscope processors`
    sink_thread: threading.Thread


@contextmanager
def processors_and_sink(settings: Settings, work: Path) -> Iterator[Pipeline]:
    """A processors worker subprocess and a sink thread writing a chDB store in ``work`` (as
    helpers.processors_and_sink, with both handles kept to check that they are still running)."""
    from rankscope.storage.sink import Sink
    from rankscope.storage.store import close_store, open_store

    proc_log = work / "processors.log"
    processors = subprocess.Popen([sys.executable, "-m", "rankscope", "processors"], env=child_env(settings),
                                  stdout=open(proc_log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    store = open_store(settings.store_dsn)
    sink = Sink(settings, store)
    stop = threading.Event()
    sink_thread = threading.Thread(target=sink.run, args=(stop,), name="sink", daemon=True)
    sink_thread.start()
    try:
        yield Pipeline(settings, store, processors, sink_thread)
    finally:
        stop.set()
        sink_thread.join(30)
        stop_process(processors)
        close_store(settings.store_dsn)
        print("processors log tail:\n" + tail(proc_log))


def leaders(settings: Settings) -> dict[str, dict[int, int]]:
    """Leader node of every partition of every rankscope topic (-1: none)."""
    md = admin_client(settings).list_topics(timeout=10)
    return {name: {p.id: p.leader for p in md.topics[name].partitions.values()}
            for name in all_topic_names(settings).values()}


def partition_of(settings: Settings, key: bytes) -> int:
    """The partition of ``key`` (murmur2, as faust and the ranks' producers hash)."""
    from aiokafka.partitioner import DefaultPartitioner

    parts = list(range(settings.topic_partitions))
    return int(DefaultPartitioner()(key, parts, parts))


def stored_steps(store: Any, job: str) -> dict[int, tuple[int, int, int]]:
    """rank -> (distinct steps, first, last) as stored."""
    rows = store.query_rows("SELECT rank, uniqExact(step), min(step), max(step) FROM rankscope.steps "
                            "WHERE job = {job:String} GROUP BY rank ORDER BY rank", parameters={"job": job})
    return {int(r[0]): (int(r[1]), int(r[2]), int(r[3])) for r in rows}


def test_a_broker_killed_mid_job_loses_no_step_and_no_alert(cluster: LocalCluster, tmp_path: Path) -> None:
    t_test = time.monotonic()
    work = tmp_path / "work"
    work.mkdir()
    settings = Settings(data_dir=str(work), bootstrap_servers=cluster.bootstrap, topic_replication=3,
                        topic_min_insync=2, topic_prefix=f"c{uuid.uuid4().hex[:8]}.",
                        clickhouse_dsn=f"chdb://{work / 'ch'}", sink_batch_s=0.5)
    ensure_topics(settings, timeout_s=60)
    names = all_topic_names(settings)
    client = admin_client(settings)

    def replicated() -> bool:
        """Every node listed, every partition of every topic on 3 replicas, all in sync (the node
        the client asks may learn of new topics a moment after the one that created them)."""
        try:
            md = client.list_topics(timeout=10)
        except KafkaException:
            return False
        return sorted(md.brokers) == [1, 2, 3] and all(
            name in md.topics and len(md.topics[name].partitions) == settings.topic_partitions
            and all(len(p.replicas) == 3 and len(p.isrs) == 3 for p in md.topics[name].partitions.values())
            for name in names.values())
    wait_until(replicated, 60, "every topic on 3 in-sync replicas")
    configs = client.describe_configs([ConfigResource(ResourceType.TOPIC, n) for n in names.values()],
                                      request_timeout=30)
    for res, fut in configs.items():
        assert fut.result(timeout=30)["min.insync.replicas"].value == "2", res.name

    job = f"kill9-{uuid.uuid4().hex[:6]}"
    log = work / "job.log"
    alerts = AlertReader(settings)
    with processors_and_sink(settings, work) as pipe:
        store = pipe.store
        diag = lambda: ("job log:\n" + tail(log) + "\nprocessors log:\n"  # noqa: E731
                        + tail(work / "processors.log"))
        hang_file = work / "hang-now"
        proc = start_job(settings, job, log, "--steps", "1000000", "--hang-rank", str(HANG_RANK),
                         "--hang-when-file", str(hang_file), nproc=RANKS)
        try:
            # The pipeline works end to end before the kill: every rank's steps are stored.
            wait_until(lambda: len(stored_steps(store, job)) == RANKS, 180, "steps of every rank in ClickHouse")
            # The consumer groups have made __consumer_offsets: three replicas too.
            offsets = client.list_topics(topic="__consumer_offsets", timeout=10).topics["__consumer_offsets"]
            assert all(len(p.replicas) == 3 for p in offsets.partitions.values())
            before = leaders(settings)
            # The victim: the node that leads the steps partitions of most of the job's ranks (keyed
            # job/rank), then the one that leads the job's alerts partition (keyed by job).
            steps_leader = {r: before[names[Topic.STEPS]][partition_of(settings, rank_key(job, r))]
                            for r in range(RANKS)}
            alerts_leader = before[names[Topic.ALERTS]][partition_of(settings, job.encode())]
            victim = max(range(1, NODES + 1), key=lambda n: (list(steps_leader.values()).count(n), n == alerts_leader))
            on_victim = sorted(r for r, lead in steps_leader.items() if lead == victim)
            assert on_victim, steps_leader
            led = {name: sorted(p for p, lead in parts.items() if lead == victim) for name, parts in before.items()}
            kill_ns = time.time_ns()
            t_kill = time.monotonic()
            pid = cluster.kill9(victim)
            assert cluster.node(victim).pid() is None and not cluster.node(victim).is_running()

            def moved() -> bool:
                try:
                    now = leaders(settings)
                except Exception:
                    return False
                return all(lead not in (-1, victim) for parts in now.values() for lead in parts.values())
            wait_until(moved, 120, f"every partition led by node {victim} to get another leader")
            absorbed_ns, absorbed_s = time.time_ns(), time.monotonic() - t_kill
            # The hang is planted once the kill is absorbed: the rank's own log names the step it stopped before.
            hang_file.touch()
            at = wait_until(lambda: re.search(rf"rank {HANG_RANK}: hanging at step (\d+)",
                                              log.read_text(errors="replace")), 180, f"rank {HANG_RANK} to hang")
            hang_at = int(at.group(1))     # every rank completed loop steps 0 .. hang_at - 1
            hang = alerts.wait_for(lambda a: a.job == job and a.kind == "hang" and a.status == "open", 180,
                                   "the hang planted after the kill", diag)
            t_alert = time.monotonic()
            assert hang.ranks == [HANG_RANK], hang.summary
            assert hang.step == hang_at - 1, (hang.step, hang_at)
            # Every rank ran steps 0 .. hang_at - 1 (the others wait in step hang_at's all_reduce), and
            # each of them is stored: hang_at distinct steps per rank, from 0 to hang_at - 1.
            want = {r: (hang_at, 0, hang_at - 1) for r in range(RANKS)}
            try:
                wait_until(lambda: stored_steps(store, job) == want, 120,
                           f"steps 0..{hang_at - 1} of every rank in ClickHouse")
            except AssertionError as e:
                raise AssertionError(f"{e}; stored (steps, first, last) per rank: {stored_steps(store, job)}") from None
            during = store.query_rows(
                "SELECT rank, count() FROM rankscope.steps FINAL WHERE job = {job:String} AND end_ns BETWEEN "
                "{a:Int64} AND {b:Int64} GROUP BY rank ORDER BY rank",
                parameters={"job": job, "a": kill_ns, "b": absorbed_ns})
            assert len(during) == RANKS, f"steps made while node {victim} was lost: {during}"
            dropped = store.query_rows("SELECT max(dropped) FROM rankscope.heartbeats WHERE job = {job:String}",
                                       parameters={"job": job})[0][0]
            assert dropped == 0, f"ranks dropped {dropped} messages"
            # The alert is stored, once.
            stored = wait_until(lambda: store.query_rows(
                "SELECT alert_id, ranks, step FROM rankscope.alerts FINAL WHERE job = {job:String} AND kind = 'hang'",
                parameters={"job": job}), 120, "the hang alert in ClickHouse")
            assert [(r[0], list(r[1]), r[2]) for r in stored] == [(hang.alert_id, [HANG_RANK], hang_at - 1)]
            alerts.poll(3.0)
            got = alerts.alerts(job)
            opened = [a for a in got if a.kind == "hang" and a.status == "open"]
            assert len(opened) == 1, [(a.alert_id, a.status, a.summary) for a in got]
            assert {a.alert_id for a in got if a.kind == "hang"} == {hang.alert_id}
            # No other incident: while the killed node's partitions have no leader, the ranks whose steps
            # go there cannot deliver (their beats wait in their producers), and the processors judge
            # their silence at what they read of those partitions, not at the wall clock.
            others = [(a.kind, a.status, a.summary) for a in got if a.kind != "hang"]
            assert others == [], others
            # The processors and the sink went on through the kill.
            assert pipe.processors.poll() is None, tail(work / "processors.log")
            assert pipe.sink_thread.is_alive()
            assert cluster.pids()[victim] is None and all(p for n, p in cluster.pids().items() if n != victim)
            steps_stored = sum(n for n, _, _ in stored_steps(store, job).values())
            print(f"\nkilled node {victim} (pid {pid}; it led {led}); leaders moved {absorbed_s:.1f} s after the "
                  f"kill; steps made meanwhile per rank {[int(c) for _, c in during]}; hang at step {hang_at} "
                  f"alerted {t_alert - t_kill:.1f} s after the kill; {steps_stored} steps stored "
                  f"({hang_at} per rank); ranks on the node: {on_victim}; test {time.monotonic() - t_test:.1f} s")
        finally:
            stop_process(proc)
            alerts.close()
