"""Topic durability from the settings: replicas, min.insync.replicas and retention per topic, on the
test broker, read back from the broker; existing topics that differ are reported."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka.admin import ConfigResource, ResourceType

from rankscope.cli import main
from rankscope.cli.stack.admin import admin_client, delete_topics, ensure_topics, topic_differences
from rankscope.config import ConfigError, Settings
from rankscope.retention import TOPIC_RETENTION_H, overrides
from rankscope.topics import Topic, all_topic_names, topic_configs

HOUR_MS = 3_600_000


def test_retention_overrides_and_their_errors() -> None:
    assert overrides(" traces=12, alerts=720 ", TOPIC_RETENTION_H, "topic_retention_h") == {
        "traces": 12.0, "alerts": 720.0}
    assert overrides("", TOPIC_RETENTION_H, "topic_retention_h") == {}
    for bad in ("trace=1", "traces", "traces=0", "traces=abc", "alerts=-1"):
        with pytest.raises(ConfigError, match="topic_retention_h"):
            Settings(topic_retention_h=bad)
    with pytest.raises(ConfigError, match="cannot exceed"):
        Settings(topic_replication=2, topic_min_insync=3)
    with pytest.raises(ConfigError, match=">= 0"):
        Settings(topic_replication=-1)


def test_every_topic_has_a_retention_and_min_insync_only_when_set() -> None:
    assert set(TOPIC_RETENTION_H) == {t.value for t in Topic}
    conf = topic_configs(Settings(topic_retention_h="traces=12"))
    assert conf[Topic.TRACES] == {"retention.ms": str(12 * HOUR_MS)}
    assert conf[Topic.ALERTS] == {"retention.ms": str(168 * HOUR_MS)}
    assert topic_configs(Settings(topic_min_insync=2))[Topic.STEPS]["min.insync.replicas"] == "2"


def _broker_configs(settings: Settings) -> dict[str, dict[str, str]]:
    client = admin_client(settings)
    names = list(all_topic_names(settings).values())
    futures = client.describe_configs([ConfigResource(ResourceType.TOPIC, n) for n in names], request_timeout=30)
    return {res.name: {k: v.value for k, v in fut.result(30).items()} for res, fut in futures.items()}


def test_topics_are_created_with_the_settings_and_differences_are_reported(
        kafka_settings: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    settings = kafka_settings.with_overrides(topic_prefix=f"t{uuid.uuid4().hex[:10]}.", topic_replication=1,
                                             topic_min_insync=1, topic_retention_h="traces=12,alerts=720")
    try:
        ensure_topics(settings, timeout_s=60)
        got = _broker_configs(settings)
        names = all_topic_names(settings)
        assert got[names[Topic.TRACES]]["retention.ms"] == str(12 * HOUR_MS)
        assert got[names[Topic.ALERTS]]["retention.ms"] == str(720 * HOUR_MS)
        assert got[names[Topic.STEPS]]["retention.ms"] == str(72 * HOUR_MS)
        assert {c["min.insync.replicas"] for c in got.values()} == {"1"}
        meta = admin_client(settings).list_topics(timeout=30).topics
        assert {len(p.replicas) for n in names.values() for p in meta[n].partitions.values()} == {1}
        assert topic_differences(settings) == []

        # The same topics seen with other settings: each difference is one line, and the CLI prints them.
        other = settings.with_overrides(topic_retention_h="traces=6", topic_partitions=8)
        lines = topic_differences(other)
        assert f"topic {names[Topic.TRACES]}: retention.ms is {12 * HOUR_MS}, the settings say {6 * HOUR_MS} (6 h)" \
            in lines
        assert f"topic {names[Topic.ALERTS]}: retention.ms is {720 * HOUR_MS}, the settings say {168 * HOUR_MS} " \
               "(168 h)" in lines
        assert sum("4 partitions, the settings say 8" in line for line in lines) == len(Topic)
        rc = main(["kafka", "topics", "--bootstrap-servers", settings.bootstrap, "--topic-prefix",
                   settings.topic_prefix])
        out = capsys.readouterr().out
        assert rc == 0 and "differs:" in out and f"topic {names[Topic.ALERTS]}: retention.ms is {720 * HOUR_MS}" in out
    finally:
        delete_topics(settings, all_topic_names(settings).values())
