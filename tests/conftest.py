"""Shared pytest fixtures.

Kafka: one real broker per test session (``kafka_settings``), started from the project's own
jars (cli/stack/broker.py) on free loopback ports with a throw-away data dir under /tmp.
Set RANKSCOPE_BOOTSTRAP_SERVERS to run against an external cluster instead (no local broker).
If the broker cannot start, the fixture raises: Kafka tests fail, they are never skipped.
Every broker the suite starts (this one, the fault tests' own, those of CLI commands it runs) runs
its JVM with :data:`TEST_BROKER_JVM_OPTS` unless RANKSCOPE_KAFKA_JVM_OPTS says otherwise.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator

import pytest

from rankscope.cli.stack.admin import delete_topics, ensure_topics
from rankscope.cli.stack.broker import LocalBroker
from rankscope.config import Settings
from rankscope.topics import all_topic_names

# The client JIT only and one GC thread: a test broker's CPU roughly halves (README, RANKSCOPE_KAFKA_JVM_OPTS),
# which the suite's other processes on the same two cores get instead.
TEST_BROKER_JVM_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
os.environ.setdefault("RANKSCOPE_KAFKA_JVM_OPTS", TEST_BROKER_JVM_OPTS)


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs a CLI command in-process (which points the root logger at its stderr) leaves
    the root logger's handlers and level as it found them: later tests never write to a stream
    pytest has closed."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


@pytest.fixture(scope="session")
def kafka_settings() -> Iterator[Settings]:
    """Settings pointing at a running Kafka with all rankscope topics created (session-wide)."""
    data_dir = tempfile.mkdtemp(prefix="rankscope-test-", dir="/tmp")
    settings = Settings.from_env(
        data_dir=data_dir,
        kafka_port=free_port(),
        kafka_controller_port=free_port(),
        topic_prefix=f"t{uuid.uuid4().hex[:8]}.",
    )
    broker = None if settings.bootstrap_servers else LocalBroker(settings)
    try:
        if broker is not None:
            broker.start(timeout_s=120)  # raises BrokerError (with the log tail) on failure
        ensure_topics(settings, timeout_s=60)
        yield settings
    finally:
        if broker is not None:
            broker.stop()
        if not os.environ.get("RANKSCOPE_KEEP_TEST_DATA"):
            shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture
def fresh_topics(kafka_settings: Settings) -> Iterator[Settings]:
    """A copy of ``kafka_settings`` with its own topic prefix and freshly created topics,
    so a test never sees another test's messages. Topics are deleted afterwards."""
    settings = kafka_settings.with_overrides(topic_prefix=f"t{uuid.uuid4().hex[:10]}.")
    ensure_topics(settings, timeout_s=60)
    yield settings
    try:
        delete_topics(settings, all_topic_names(settings).values())
    except Exception:  # best effort: the broker may already be gone
        pass
