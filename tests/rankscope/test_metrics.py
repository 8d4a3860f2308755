"""rankscope.metrics: counting consumed batches, lag, the /metrics server, restarts from the supervisor.

Consumer messages are small fakes with confluent-kafka's accessors; the HTTP server and the
supervisor are real.
"""

from __future__ import annotations

import socket
import sys
import threading
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rankscope.cli.stack.supervisor import BackoffPolicy, ServiceSpec, Supervisor
from rankscope.config import RESTARTS_ENV, ConfigError, Settings
from rankscope.metrics import Metrics, start_metrics
from rankscope.version import package_version
from tests.integration.helpers import free_port, wait_until
from tests.kafka_fakes import Message as Msg

NOW_NS = 1_800_000_000_000_000_000


class Watermarks:
    def __init__(self, high: dict[tuple[str, int], int]) -> None:
        self.high = high

    def get_watermark_offsets(self, tp: Any, cached: bool = False) -> tuple[int, int]:
        assert cached, "metrics must not ask the broker"
        return 0, self.high.get((tp.topic, tp.partition), -1001)


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_a_batch_is_counted_by_topic_with_lag_per_partition() -> None:
    m = Metrics()
    now_ms = NOW_NS // 1_000_000
    msgs = [Msg("p.steps", 0, 10, ts_ms=now_ms - 4000), Msg("p.steps", 0, 11, ts_ms=now_ms - 2500),
            Msg("p.steps", 1, 5, ts_ms=now_ms - 100), Msg("p.hw", 2, 7, ts_ms=0), Msg("p.steps", 3, 1, ts_ms=1, error="eof")]
    m.consumed(msgs, Watermarks({("p.steps", 0): 20, ("p.steps", 1): 6}), NOW_NS)
    assert value(m, "rankscope_messages_consumed_total", topic="p.steps") == 3
    assert value(m, "rankscope_messages_consumed_total", topic="p.hw") == 1
    assert value(m, "rankscope_consumer_lag_seconds", topic="p.steps", partition="0") == pytest.approx(2.5)
    assert value(m, "rankscope_consumer_lag_seconds", topic="p.steps", partition="1") == pytest.approx(0.1)
    assert value(m, "rankscope_consumer_lag_messages", topic="p.steps", partition="0") == 8   # 12..19 left
    assert value(m, "rankscope_consumer_lag_messages", topic="p.steps", partition="1") == 0
    # no timestamp, no cached watermark: nothing is guessed
    assert value(m, "rankscope_consumer_lag_seconds", topic="p.hw", partition="2") is None
    assert value(m, "rankscope_consumer_lag_messages", topic="p.hw", partition="2") is None
    assert value(m, "rankscope_messages_consumed_total", topic="p.steps") == 3   # the error message is not counted

    m.forget_partitions("p.steps", [0])
    assert value(m, "rankscope_consumer_lag_seconds", topic="p.steps", partition="0") is None
    assert value(m, "rankscope_consumer_lag_seconds", topic="p.steps", partition="1") is not None


def test_observing_never_raises_into_the_loop() -> None:
    m = Metrics()
    m.consumed([object()], None, NOW_NS)                  # not a message at all
    m.consumed([Msg("t", 0, 1, ts_ms=5)], object(), NOW_NS)      # a consumer without watermarks
    assert value(m, "rankscope_consumer_lag_messages", topic="t", partition="0") is None
    m.consumed_event(object(), None, NOW_NS)


def test_a_faust_event_is_counted_with_its_lag() -> None:
    m = Metrics()
    tp = ("p.shards", 1)
    app = SimpleNamespace(consumer=SimpleNamespace(highwater=lambda t: {tp: 30}[t]))
    msg = SimpleNamespace(topic="p.shards", partition=1, offset=26, timestamp=NOW_NS / 1e9 - 1.5, tp=tp)
    m.consumed_event(msg, app, NOW_NS)
    assert value(m, "rankscope_messages_consumed_total", topic="p.shards") == 1
    assert value(m, "rankscope_consumer_lag_messages", topic="p.shards", partition="1") == 3
    assert value(m, "rankscope_consumer_lag_seconds", topic="p.shards", partition="1") == pytest.approx(1.5)


def test_service_metrics() -> None:
    m = Metrics()
    m.dead_letter("sink", "not_msgpack")
    m.dead_letter("sink", "not_msgpack")
    m.inserted("steps", 120, 0.004)
    m.inserted("steps", 30, 0.2)
    m.insert_errors.inc()
    m.scanned("jobs", 0.003)
    m.set_open_incidents({"hang": 2})
    assert value(m, "rankscope_dead_letters_total", stage="sink", reason="not_msgpack") == 2
    assert value(m, "rankscope_rows_inserted_total", table="steps") == 150
    assert value(m, "rankscope_insert_duration_seconds_count", table="steps") == 2
    assert value(m, "rankscope_insert_duration_seconds_bucket", table="steps", le="0.005") == 1
    assert value(m, "rankscope_insert_errors_total") == 1
    assert value(m, "rankscope_scan_duration_seconds_count", stage="jobs") == 1
    assert value(m, "rankscope_open_incidents", kind="hang") == 2
    assert value(m, "rankscope_open_incidents", kind="slow_rank") == 0
    m.set_open_incidents({})
    assert value(m, "rankscope_open_incidents", kind="hang") == 0
    assert value(m, "process_cpu_seconds_total") is not None


def test_each_metrics_object_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()
    a.dead_letter("sink", "x")
    assert value(b, "rankscope_dead_letters_total", stage="sink", reason="x") is None


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_start_metrics_serves_http_with_restarts_and_info() -> None:
    port = free_port()
    settings = Settings.from_env({}, metrics_port_sink=port)
    m = Metrics()
    url = start_metrics(settings, "sink", m, environ={RESTARTS_ENV: "3"})
    try:
        assert url == f"http://127.0.0.1:{port}/metrics" == settings.metrics_url("sink")
        m.inserted("steps", 7, 0.01)
        got = scrape(url)
        assert got["rankscope_service_restarts"][(("service", "sink"),)] == 3
        (info,) = got["rankscope_service_info"]
        assert dict(info)["service"] == "sink" and dict(info)["version"] == package_version()
        assert got["rankscope_rows_inserted_total"][(("table", "steps"),)] == 7
    finally:
        m.stop_server()


def test_start_metrics_off_or_port_taken_leaves_the_service_running(caplog: pytest.LogCaptureFixture) -> None:
    assert start_metrics(Settings.from_env({}, metrics_port_serve=0), "serve", Metrics()) is None
    assert start_metrics(Settings.from_env({}), "demo-job", Metrics()) is None     # no port setting
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        m = Metrics()
        assert start_metrics(Settings.from_env({}, metrics_port_processors=port), "processors", m) is None
    assert f"cannot listen on 127.0.0.1:{port}" in caplog.text
    assert m.registry.get_sample_value("rankscope_service_restarts", {"service": "processors"}) == 0


@pytest.mark.parametrize("name", ["metrics_port_processors", "metrics_port_sink", "metrics_port_serve"])
def test_metrics_ports_are_validated(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Settings.from_env({}, **{name: 70000})


def test_the_supervisor_tells_each_child_its_restart_count(tmp_path: Path) -> None:
    settings = Settings.from_env({}, data_dir=str(tmp_path))
    out = tmp_path / "restarts.txt"
    code = f"import os; open({str(out)!r}, 'a').write(os.environ[{RESTARTS_ENV!r}] + chr(10)); raise SystemExit(1)"
    spec = ServiceSpec("crasher", (sys.executable, "-c", code))
    sup = Supervisor(settings, [spec], policy=BackoffPolicy(initial_s=0.05, max_s=0.05), tick_s=0.05)
    thread = threading.Thread(target=sup.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: out.exists() and len(out.read_text().split()) >= 3, 60, "three starts of the crasher")
    finally:
        sup.request_stop()
        thread.join(60)
    assert not thread.is_alive()
    assert out.read_text().split()[:3] == ["0", "1", "2"]
