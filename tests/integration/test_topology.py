"""docker-compose.yml's topology without Docker: each service its own process, configured by
deploy/rankscope.env, against the real loopback broker and the embedded store.

The env file is used as it is, plus the overrides that point it at this machine: the broker address,
the data dir and the store (an embedded chdb:// store instead of the ClickHouse server), a topic
prefix of its own, and free ports. chDB lets one process open a directory, so the sink and the
dashboard take the store in turn: the sink stores the rank's beat and stops, the test queries the
store, then the dashboard serves it. Services are started in compose's order: topics (one-shot),
processors, sink; then a rank.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import urllib.request
import uuid
from pathlib import Path

import pytest

from rankscope.config import Settings
from rankscope.storage.store import close_store, open_store
from tests.integration.helpers import REPO, free_port, stop_process, tail, wait_until
from tests.rankscope.test_compose import read_env_file

pytestmark = [pytest.mark.kafka, pytest.mark.clickhouse]

COMMANDS = {"topics": ["kafka", "topics", "--timeout", "120"], "processors": ["processors"],
            "sink": ["sink"], "dashboard": ["serve", "--no-sink"]}


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.read().decode() if r.status == 200 else None
    except OSError:
        return None


def _counter(metrics_text: str | None, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition (0 when absent)."""
    if not metrics_text:
        return 0.0
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(want)}\}} (\S+)$", metrics_text, re.M)
    return float(m.group(1)) if m else 0.0


def test_compose_topology_as_processes(kafka_settings: Settings, tmp_path: Path) -> None:
    file_env = read_env_file()
    ports = {"RANKSCOPE_METRICS_PORT_PROCESSORS": free_port(), "RANKSCOPE_METRICS_PORT_SINK": free_port(),
             "RANKSCOPE_METRICS_PORT_SERVE": free_port(), "RANKSCOPE_DASHBOARD_PORT": free_port()}
    overrides = {"RANKSCOPE_BOOTSTRAP_SERVERS": kafka_settings.bootstrap, "RANKSCOPE_DATA_DIR": str(tmp_path),
                 "RANKSCOPE_CLICKHOUSE_DSN": f"chdb://{tmp_path / 'clickhouse'}",
                 "RANKSCOPE_TOPIC_PREFIX": f"topo{uuid.uuid4().hex[:8]}.",
                 **{k: str(v) for k, v in ports.items()}}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env.update({**file_env, **overrides, "PYTHONUNBUFFERED": "1"})
    settings = Settings.from_env(env)
    assert settings.topic_partitions == int(file_env["RANKSCOPE_TOPIC_PARTITIONS"])  # the file is in force
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"{name}.log", "wb")
        procs[name] = subprocess.Popen([sys.executable, "-m", "rankscope", *COMMANDS[name]], cwd=tmp_path, env=env,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return procs[name]

    def alive(name: str) -> None:
        proc = procs[name]
        assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{tail(tmp_path / f'{name}.log')}"

    job = f"topo-{uuid.uuid4().hex[:8]}"
    try:
        topics = start("topics")
        assert topics.wait(180) == 0, tail(tmp_path / "topics.log")
        start("processors")
        start("sink")
        sink_metrics = f"http://127.0.0.1:{ports['RANKSCOPE_METRICS_PORT_SINK']}/metrics"
        proc_metrics = f"http://127.0.0.1:{ports['RANKSCOPE_METRICS_PORT_PROCESSORS']}/metrics"
        wait_until(lambda: (alive("processors"), _get(proc_metrics))[1], 180, "the processors' /metrics")
        wait_until(lambda: (alive("sink"), _get(sink_metrics))[1], 180, "the sink's /metrics")

        rank = textwrap.dedent("""
            import time
            from rankscope import Tracer
            tracer = Tracer(install_collective_timing=False, handle_signals=False)
            for _ in range(40):
                time.sleep(0.02)
                tracer.step()
            tracer.close()
        """)
        rank_env = {k: v for k, v in env.items() if k in ("PATH", "HOME", "PYTHONUNBUFFERED")}
        rank_env.update({"RANKSCOPE_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
                         "RANKSCOPE_TOPIC_PREFIX": settings.topic_prefix, "RANKSCOPE_DATA_DIR": str(tmp_path),
                         "RANKSCOPE_JOB_ID": job, "RANKSCOPE_RANK": "0", "RANKSCOPE_WORLD_SIZE": "1",
                         "RANKSCOPE_LOCAL_RANK": "0", "RANKSCOPE_HW_SAMPLE_S": "0",
                         "PYTHONPATH": str(REPO)})
        res = subprocess.run([sys.executable, "-c", rank], cwd=tmp_path, env=rank_env, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr

        def stored() -> bool:
            alive("sink")
            text = _get(sink_metrics)
            return all(_counter(text, "rankscope_rows_inserted_total", table=t) > 0
                       for t in ("steps", "heartbeats", "worker_stats"))

        # worker_stats rows come from the processors (stats topic), the others straight from the rank
        wait_until(stored, 180, "steps, heartbeats and the processors' worker_stats rows in the sink's /metrics")
        alive("processors")
        stop_process(procs["sink"])  # SIGTERM: the sink writes and commits its open batch, then exits
        assert procs["sink"].returncode == 0, tail(tmp_path / "sink.log")

        store = open_store(settings.store_dsn)
        try:
            steps = store.query_rows("SELECT count(), max(step) FROM rankscope.steps WHERE job = {j:String}",
                                     {"j": job})[0]
            beats = store.query_rows("SELECT count() FROM rankscope.heartbeats WHERE job = {j:String}",
                                     {"j": job})[0][0]
            stats = store.query_rows("SELECT count() FROM rankscope.worker_stats WHERE job = {j:String}",
                                     {"j": job})[0][0]
        finally:
            close_store(settings.store_dsn)
        assert steps[0] == 40 and steps[1] >= 39, steps
        assert beats >= 1 and stats >= 1, (beats, stats)

        start("dashboard")  # the dashboard service reads the same store
        url = f"http://127.0.0.1:{ports['RANKSCOPE_DASHBOARD_PORT']}"
        wait_until(lambda: (alive("dashboard"), _get(f"{url}/_stcore/health"))[1], 180, "the dashboard's health")
        assert _get(url + "/") is not None
    finally:
        for proc in procs.values():
            stop_process(proc)
        for name in procs:
            print(f"--- {name} log tail:\n{tail(tmp_path / f'{name}.log', 15)}")
    for name in ("processors", "sink", "dashboard"):
        assert "Traceback" not in (tmp_path / f"{name}.log").read_text(), tail(tmp_path / f"{name}.log")
