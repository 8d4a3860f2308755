"""Each service's /metrics, scraped over HTTP from real processes: `rankscope processors`, `rankscope
sink` and `rankscope serve` against the real broker, each sink with its own chDB store. Messages go
in through a real producer (valid step records and one that is not msgpack); the test scrapes again
until the counters moved. Deadlines are generous; nothing waits a fixed time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families

from rankscope.config import RESTARTS_ENV, Settings
from rankscope.gc_tuning import STREAMING_THRESHOLDS
from rankscope.protocol.envelope import Envelope, encode, rank_key
from rankscope.topics import Topic
from tests.integration.helpers import REPO, child_env, free_port, stop_process, tail, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.clickhouse]
DEADLINE_S = 240
RANKS, STEPS_PER_MSG = 4, 5

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples | None:
    """Every sample of the page, or None while nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over the samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def start(name: str, settings: Settings, log: Path, *args: str, **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "rankscope", name, *args], env=child_env(settings, **env),
                            cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def steps_message(job: str, rank: int, first: int) -> bytes:
    now = time.time_ns()
    steps = list(range(first, first + STEPS_PER_MSG))
    start_ns = [now - (STEPS_PER_MSG - i) * 50_000_000 for i in range(STEPS_PER_MSG)]
    body = {"step": steps, "start_ns": start_ns, "end_ns": [s + 40_000_000 for s in start_ns],
            "comm_ns": [5_000_000] * STEPS_PER_MSG}
    return encode(Envelope(kind="steps", job=job, rank=rank, host="node0", pid=4000 + rank, seq=first,
                           sent_ns=now, body=body))


@pytest.fixture
def stack(fresh_topics: Settings, tmp_path: Path) -> Iterator[tuple[dict[str, Settings], dict[str, Path]]]:
    base = fresh_topics.with_overrides(
        metrics_port_processors=free_port(), metrics_port_sink=free_port(), metrics_port_serve=free_port(),
        log_format="json", sink_batch_s=0.2)
    settings = {
        "processors": base,
        "sink": base.with_overrides(data_dir=str(tmp_path / "sink"), sink_group=f"sink-{uuid.uuid4().hex[:8]}"),
        "serve": base.with_overrides(data_dir=str(tmp_path / "serve"), sink_group=f"serve-{uuid.uuid4().hex[:8]}",
                                     dashboard_port=free_port()),
    }
    logs = {name: tmp_path / f"{name}.log" for name in settings}
    procs = [start("processors", settings["processors"], logs["processors"], **{RESTARTS_ENV: "2"}),
             start("sink", settings["sink"], logs["sink"]),
             start("serve", settings["serve"], logs["serve"])]
    try:
        yield settings, logs
    finally:
        for p in procs:
            stop_process(p)


def test_each_service_serves_metrics_and_its_counters_move(
        stack: tuple[dict[str, Settings], dict[str, Path]]) -> None:
    settings, logs = stack
    urls: dict[str, str] = {}
    for name, s in settings.items():
        url = s.metrics_url(name)
        assert url is not None, name
        urls[name] = url
    diag = lambda: "\n".join(f"--- {n}\n{tail(p, 40)}" for n, p in logs.items())  # noqa: E731
    steps_topic = Topic.STEPS.name_for(settings["processors"])

    first: dict[str, Samples] = {}
    for name, url in urls.items():
        first[name] = wait_until(partial(scrape, url), DEADLINE_S, f"{name} to serve {url}\n{diag()}")
        assert total(first[name], "rankscope_service_info", service=name) == 1
        assert total(first[name], "rankscope_messages_consumed_total", topic=steps_topic) == 0
        assert total(first[name], "rankscope_dead_letters_total") == 0
    assert total(first["processors"], "rankscope_service_restarts", service="processors") == 2
    assert total(first["sink"], "rankscope_service_restarts", service="sink") == 0

    job = f"metrics-{uuid.uuid4().hex[:6]}"
    producer = Producer({"bootstrap.servers": settings["processors"].bootstrap})
    for rank in range(RANKS):
        for first_step in (0, STEPS_PER_MSG):
            producer.produce(steps_topic, key=rank_key(job, rank), value=steps_message(job, rank, first_step))
    producer.produce(steps_topic, key=rank_key(job, 0), value=b"\xc1 this is not msgpack")
    assert producer.flush(30) == 0
    sent = RANKS * 2 + 1

    def moved(name: str) -> Samples | None:
        now = scrape(urls[name])
        if now is None or total(now, "rankscope_messages_consumed_total", topic=steps_topic) < sent:
            return None
        if total(now, "rankscope_dead_letters_total", stage="sink" if name != "processors" else "processors") < 1:
            return None
        if name != "processors" and (
                total(now, "rankscope_rows_inserted_total", table="steps") < RANKS * 2 * STEPS_PER_MSG
                # three dead letters reach each store: its own, the other sink's and the processors'
                or total(now, "rankscope_rows_inserted_total", table="deadletters") < 3):
            return None
        if name == "processors" and not (total(now, "rankscope_scan_duration_seconds_count", stage="jobs")
                                          and total(now, "rankscope_messages_consumed_total",
                                                    topic=Topic.SHARDS.name_for(settings["processors"]))):
            return None
        return now

    after = {name: wait_until(partial(moved, name), DEADLINE_S, f"{name}'s counters to move\n{diag()}")
             for name in urls}

    proc = after["processors"]
    assert total(proc, "rankscope_dead_letters_total", stage="processors", reason="not_msgpack") == 1
    assert total(proc, "rankscope_scan_duration_seconds_count", stage="shards") > 0
    for lag in ("rankscope_consumer_lag_messages", "rankscope_consumer_lag_seconds"):
        assert any(n == lag and ("topic", steps_topic) in lab for n, lab in proc), lag
    assert any(n == "rankscope_open_incidents" for n, _ in proc)
    # The stream services run with the collector thresholds of rankscope/gc_tuning.py; serve (the
    # dashboard's process) keeps CPython's defaults.
    for name, want in (("processors", STREAMING_THRESHOLDS), ("sink", STREAMING_THRESHOLDS),
                       ("serve", (700, 10, 10))):
        got = tuple(int(total(after[name], "rankscope_gc_threshold", generation=str(g))) for g in range(3))
        assert got == want, name
    for name in ("sink", "serve"):
        s = after[name]
        assert total(s, "rankscope_dead_letters_total", stage="sink", reason="not_msgpack") == 1
        assert total(s, "rankscope_insert_duration_seconds_count", table="steps") >= 1
        assert total(s, "rankscope_insert_errors_total") == 0
        assert total(s, "rankscope_messages_consumed_total", topic=Topic.DEADLETTER.name_for(settings[name])) >= 3
        for lag in ("rankscope_consumer_lag_messages", "rankscope_consumer_lag_seconds"):
            assert any(n == lag and ("topic", steps_topic) in lab for n, lab in s), lag

    # log_format=json: the services' own log lines are JSON objects naming the service
    for name in ("processors", "sink"):
        objs = [json.loads(ln) for ln in logs[name].read_text(errors="replace").splitlines() if ln.startswith("{")]
        assert objs and all(o["service"] == name and {"ts", "level", "logger", "message"} <= set(o) for o in objs)
    assert any("assigned steps partitions" in o["message"] for o in
               (json.loads(ln) for ln in logs["processors"].read_text().splitlines() if ln.startswith("{")))
