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
import tempfile
import uuid
from collections.abc import Iterator

import pytest

from rankscope.cli.stack.admin import delete_topics, ensure_topics
from rankscope.cli.stack.broker import BrokerError, LocalBroker
from rankscope.cli.stack.ports import free_port
from rankscope.config import Settings
from rankscope.topics import all_topic_names

pytest_plugins = ["tests.cpu_time"]

# The client JIT only and one GC thread: a test broker's CPU roughly halves (README, RANKSCOPE_KAFKA_JVM_OPTS),
# which the suite's other processes on the same two cores get instead.
TEST_BROKER_JVM_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
os.environ.setdefault("RANKSCOPE_KAFKA_JVM_OPTS", TEST_BROKER_JVM_OPTS)


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


def start_broker_on_free_ports(settings: Settings, attempts: int = 3) -> tuple[Settings, LocalBroker]:
    """A LocalBroker on two free ports, started. Ports are free when drawn, not when the broker binds them:
    another lane's server may take one in between, so a start that fails on a taken port is tried again on
    new ones. Any other failure raises BrokerError with the broker's log tail."""
    for attempt in range(1, attempts + 1):
        settings = settings.with_overrides(kafka_port=free_port(), kafka_controller_port=free_port())
        broker = LocalBroker(settings)
        try:
            broker.start(timeout_s=120)
            return settings, broker
        except BrokerError as e:
            broker.stop()
            if "already in use" not in str(e) or attempt == attempts:
                raise
            logging.getLogger(__name__).warning("broker start attempt %d found a port taken; new ports", attempt)
            shutil.rmtree(settings.data_dir, ignore_errors=True)
            os.makedirs(settings.data_dir, exist_ok=True)
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def kafka_settings() -> Iterator[Settings]:
    """Settings pointing at a running Kafka with all rankscope topics created (session-wide)."""
    data_dir = tempfile.mkdtemp(prefix="rankscope-test-", dir="/tmp")
    settings, broker = Settings.from_env(data_dir=data_dir, topic_prefix=f"t{uuid.uuid4().hex[:8]}."), None
    try:
        if not settings.bootstrap_servers:
            settings, broker = start_broker_on_free_ports(settings)
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
