"""Settings from the environment, and their validation."""

from __future__ import annotations

import pytest

from rankscope.config import ConfigError, Settings


def test_settings_from_env_and_validation():
    s = Settings.from_env({"RANKSCOPE_KAFKA_PORT": "19092", "RANKSCOPE_HANG_MIN_S": "2.5"}, topic_prefix="x.")
    assert s.kafka_port == 19092 and s.hang_min_s == 2.5 and s.topic_prefix == "x."
    assert s.bootstrap == "127.0.0.1:19092" and s.local_broker
    assert Settings.from_env(s.to_env()) == s
    with pytest.raises(ConfigError, match="RANKSCOPE_KAFKA_PORT"):
        Settings.from_env({"RANKSCOPE_KAFKA_PORT": "many"})
    with pytest.raises(ConfigError, match="topic_partitions"):
        Settings(topic_partitions=0)
    with pytest.raises(ConfigError, match="clickhouse_dsn"):
        Settings(clickhouse_dsn="mysql://x")
    assert Settings.from_env({"RANKSCOPE_PRODUCER_COMPRESSION": "lz4"}).producer_compression == "lz4"
    with pytest.raises(ConfigError, match="producer_compression must be one of none, gzip, snappy, lz4, zstd"):
        Settings.from_env({"RANKSCOPE_PRODUCER_COMPRESSION": "brotli"})
