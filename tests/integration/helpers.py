"""Helpers for end-to-end tests: real processes, real broker, real chDB. Poll with deadlines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from rankscope.alert_schema import validate as validate_alert
from rankscope.cli.stack.ports import free_port
from rankscope.config import Settings
from rankscope.protocol.alerts import Alert
from rankscope.topics import Topic

REPO = Path(__file__).resolve().parents[2]


def child_env(settings: Settings, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env.update(settings.to_env())
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_processors(settings: Settings, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "rankscope", "processors"], env=child_env(settings),
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def start_job(settings: Settings, job: str, log: Path, *args: str, nproc: int = 4,
              master_port: int = 0) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(master_port or free_port()),
           "-m", "rankscope.demo.train", *args]
    return subprocess.Popen(cmd, env=child_env(settings, RANKSCOPE_JOB_ID=job), cwd=REPO,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


@contextmanager
def processors_and_sink(kafka_settings: Settings, work: Path, rules: dict[str, str]) -> Iterator[tuple[Settings, Any]]:
    """Fresh topics, a processors worker subprocess with ``rules`` (RANKSCOPE_* variables), and a
    sink thread writing a chDB store in ``work``: yields the settings and the store."""
    from rankscope.cli.stack.admin import ensure_topics
    from rankscope.storage.sink import Sink
    from rankscope.storage.store import close_store, open_store

    settings = kafka_settings.with_overrides(topic_prefix=f"s{uuid.uuid4().hex[:8]}.", data_dir=str(work),
                                             clickhouse_dsn=f"chdb://{work / 'ch'}", sink_batch_s=0.5)
    ensure_topics(settings, timeout_s=60)
    proc_log = work / "processors.log"
    processors = subprocess.Popen([sys.executable, "-m", "rankscope", "processors"],
                                  env=child_env(settings, **rules), stdout=open(proc_log, "wb"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
    store = open_store(settings.store_dsn)
    sink = Sink(settings, store)
    stop = threading.Event()
    sink_thread = threading.Thread(target=sink.run, args=(stop,), daemon=True)
    sink_thread.start()
    try:
        yield settings, store
    finally:
        stop.set()
        sink_thread.join(30)
        stop_process(processors)
        close_store(settings.store_dsn)
        print("processors log tail:\n" + tail(proc_log))


def rankscope_run(settings: Settings, job: str, log: Path, script: Path, *args: str, nproc: int = 4,
                  rules: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``rankscope run -- torchrun ... SCRIPT ARGS`` as a user would type it."""
    cmd = [sys.executable, "-m", "rankscope", "run", "--job-id", job, "--",
           sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args]
    return subprocess.Popen(cmd, env=child_env(settings, **(rules or {})), cwd=REPO, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except OSError:
        pass
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


class TopicReader:
    """Reads a topic from the beginning, accumulating messages across polls.

    A topic that exists is read by assigning every partition from its first offset: no consumer
    group, so nothing depends on a group coordinator (a broker a fault test kills may be it) or on
    how often the test polls. A topic not created yet is subscribed to, and read once it is."""

    def __init__(self, settings: Settings, topic: Topic) -> None:
        self.consumer = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"test-{uuid.uuid4().hex}",
                                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
        name = topic.name_for(settings)
        meta = self.consumer.list_topics(timeout=30).topics.get(name)
        if meta is not None and meta.error is None and meta.partitions:
            self.consumer.assign([TopicPartition(name, p, OFFSET_BEGINNING) for p in sorted(meta.partitions)])
        else:
            self.consumer.subscribe([name])
        self.values: list[bytes] = []

    def poll(self, seconds: float = 0.5) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            msg = self.consumer.poll(0.1)
            if msg is not None and not msg.error():
                self.values.append(msg.value())

    def close(self) -> None:
        self.consumer.close()


class AlertReader(TopicReader):
    """Reads the alerts topic; every alert read must match rankscope/alert.schema.json."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings, Topic.ALERTS)

    def poll(self, seconds: float = 0.5) -> None:
        seen = len(self.values)
        super().poll(seconds)
        for v in self.values[seen:]:
            validate_alert(json.loads(v))

    def alerts(self, job: str | None = None) -> list[Alert]:
        out = [Alert.from_json(v) for v in self.values]
        return [a for a in out if job is None or a.job == job]

    def wait_for(self, pred: Callable[[Alert], bool], timeout_s: float, what: str,
                 on_timeout: Callable[[], str] | None = None) -> Alert:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll(0.5)
            for a in self.alerts():
                if pred(a):
                    return a
        extra = on_timeout() if on_timeout else ""
        raise AssertionError(f"no alert {what} within {timeout_s}s; got {[a.summary for a in self.alerts()]}\n{extra}")


def wait_until(pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
