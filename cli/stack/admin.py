"""Kafka topic administration through ``confluent_kafka.admin.AdminClient``.

Works the same against the project-managed local broker and an external cluster.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from rankscope.config import Settings
from rankscope.kafka_client import FirstFailureOnly, client_conf
from rankscope.topics import all_topic_names, topic_configs

log = logging.getLogger(__name__)
# librdkafka's own log lines (e.g. "connection refused" while a broker starts) go here instead
# of raw stderr; they are only emitted while a client call is running.
_client_log = logging.getLogger("rankscope.kafka.client")
_client_log.addFilter(FirstFailureOnly())


class KafkaUnavailable(RuntimeError):
    """No Kafka cluster answered at the bootstrap address in time."""


def admin_client(target: str | Settings) -> AdminClient:
    """An admin client for a bootstrap address (plain) or for ``Settings`` (with their security;
    a rejected login raises KafkaAuthError from the client's ``poll``)."""
    base: dict[str, Any] = {"bootstrap.servers": target} if isinstance(target, str) else client_conf(target, fatal=True)
    return AdminClient({**base, "logger": _client_log})  # type: ignore[dict-item]


def kafka_answers(target: str | Settings, timeout_s: float = 2.0) -> bool:
    """One metadata round trip: True when the cluster answered within ``timeout_s``.

    Raises KafkaAuthError when the broker rejects the credentials of ``Settings``."""
    client = admin_client(target)
    try:
        md = client.list_topics(timeout=timeout_s)
    except KafkaException:
        client.poll(0)
        return False
    return bool(md.brokers)


def wait_for_kafka(target: str | Settings, timeout_s: float = 30.0) -> None:
    """Block until a metadata request succeeds; raise KafkaUnavailable otherwise, KafkaAuthError
    (at once) when the broker rejects the credentials."""
    deadline = time.monotonic() + timeout_s
    bootstrap = target if isinstance(target, str) else target.bootstrap
    client = admin_client(target)
    last: Exception | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise KafkaUnavailable(f"Kafka at {bootstrap} did not answer within {timeout_s:.0f}s: {last}")
        try:
            if client.list_topics(timeout=min(2.0, max(remaining, 0.1))).brokers:
                return
        except KafkaException as e:
            last = e
            client.poll(0)
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))


def ensure_topics(settings: Settings, timeout_s: float = 30.0) -> list[str]:
    """Create every rankscope topic: ``settings.topic_partitions`` partitions, ``topic_replication``
    replicas (0: the cluster's default), and the configuration of :func:`rankscope.topics.topic_configs`
    (retention, ``min.insync.replicas``).

    Idempotent: topics that already exist are left as they are, and each way one differs from the
    settings is logged once (:func:`topic_differences`). Returns when all topics are visible in the
    cluster metadata with a leader for every partition.
    """
    deadline = time.monotonic() + timeout_s
    wait_for_kafka(settings, timeout_s)
    topics = all_topic_names(settings)
    names = list(topics.values())
    configs = topic_configs(settings)
    client = admin_client(settings)
    existing = set(client.list_topics(timeout=max(deadline - time.monotonic(), 1.0)).topics)
    missing = [t for t, n in topics.items() if n not in existing]
    if missing:
        futures = client.create_topics(
            [NewTopic(topics[t], num_partitions=settings.topic_partitions,
                      replication_factor=settings.topic_replication or -1, config=configs[t]) for t in missing],
            operation_timeout=max(deadline - time.monotonic(), 1.0),
            request_timeout=max(deadline - time.monotonic(), 1.0))
        for name, fut in futures.items():
            try:
                fut.result(timeout=max(deadline - time.monotonic(), 1.0))
                log.info("created topic %s (%d partitions)", name, settings.topic_partitions)
            except KafkaException as e:
                err = e.args[0] if e.args else None
                if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    continue  # created concurrently by another process
                raise
    _wait_visible(client, names, deadline, settings.bootstrap)
    if len(missing) < len(topics):
        try:
            for line in topic_differences(settings, timeout_s=max(deadline - time.monotonic(), 5.0)):
                log.warning("%s", line)
        except KafkaException as e:
            log.warning("could not compare the existing topics with the settings: %s", e)
    return names


def topic_differences(settings: Settings, timeout_s: float = 30.0) -> list[str]:
    """Each way an existing rankscope topic differs from what the settings would create: its
    partitions, replicas (when ``topic_replication`` is set), retention and ``min.insync.replicas``
    (when set). One line per difference; topics that do not exist are not listed."""
    topics = all_topic_names(settings)
    client = admin_client(settings)
    meta = client.list_topics(timeout=timeout_s).topics
    present = {t: n for t, n in topics.items() if n in meta and meta[n].error is None}
    wanted = topic_configs(settings)
    futures = client.describe_configs([ConfigResource(ResourceType.TOPIC, n) for n in present.values()],
                                      request_timeout=timeout_s)
    actual = {res.name: fut.result(timeout=timeout_s) for res, fut in futures.items()}
    out = []
    for t, name in present.items():
        parts = meta[name].partitions
        if len(parts) != settings.topic_partitions:
            out.append(f"topic {name}: {len(parts)} partitions, the settings say {settings.topic_partitions}")
        replicas = min((len(p.replicas) for p in parts.values()), default=0)
        if settings.topic_replication and replicas != settings.topic_replication:
            out.append(f"topic {name}: {replicas} replicas, the settings say {settings.topic_replication}")
        for key, value in wanted[t].items():
            entry = actual.get(name, {}).get(key)
            have = getattr(entry, "value", None)
            if have != value:
                out.append(f"topic {name}: {key} is {have}, the settings say {value}{_as_hours(key, value)}")
    return out


def _as_hours(key: str, value: str) -> str:
    return f" ({int(value) / 3_600_000:g} h)" if key == "retention.ms" else ""


def _wait_visible(client: AdminClient, names: list[str], deadline: float, bootstrap: str) -> None:
    pending = list(names)
    while True:
        try:
            topics = client.list_topics(timeout=max(min(deadline - time.monotonic(), 2.0), 0.5)).topics
            pending = [n for n in names if n not in topics or topics[n].error is not None
                       or not topics[n].partitions
                       or any(p.leader < 0 for p in topics[n].partitions.values())]
        except KafkaException:
            pass
        if not pending:
            return
        if time.monotonic() >= deadline:
            raise KafkaUnavailable(f"topics not ready on {bootstrap}: {pending}")
        time.sleep(0.1)


def delete_topics(settings: Settings, names: Iterable[str], timeout_s: float = 30.0) -> None:
    """Delete topics (missing ones are ignored). Mostly for tests."""
    names = list(names)
    if not names:
        return
    client = admin_client(settings)
    futures = client.delete_topics(names, operation_timeout=timeout_s, request_timeout=timeout_s)
    for _name, fut in futures.items():
        try:
            fut.result(timeout=timeout_s)
        except KafkaException as e:
            err = e.args[0] if e.args else None
            if isinstance(err, KafkaError) and err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                continue
            raise
