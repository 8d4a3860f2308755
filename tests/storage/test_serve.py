"""``rankscope serve``: sink thread + Streamlit in one process sharing the embedded store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from rankscope.cli.stack.ports import free_port
from rankscope.config import ConfigError, Settings
from rankscope.protocol.envelope import Envelope, encode
from rankscope.storage.serve import export_settings, option_flags, streamlit_options
from rankscope.storage.store import close_store, open_store
from rankscope.topics import Topic

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 60.0

PAGE = textwrap.dedent("""
    import streamlit as st

    from rankscope.config import Settings
    from rankscope.storage.serve import running_sink
    from rankscope.storage.store import open_store

    settings = Settings.from_env()
    store = open_store(settings.store_dsn)
    n = store.query_rows("SELECT count() FROM rankscope.steps FINAL")[0][0]
    st.write(f"steps={n} prefix={settings.topic_prefix} sink={'yes' if running_sink() else 'no'}")
""")


def test_export_settings_round_trips() -> None:
    env: dict[str, str] = {}
    s = Settings(data_dir="/tmp/x", dashboard_port=9999, sink_batch_s=0.25, topic_prefix="p.")
    written = export_settings(s, env)
    assert written["RANKSCOPE_DASHBOARD_PORT"] == "9999"
    assert set(written) == set(Settings.env_names())
    assert Settings.from_env(env) == s
    with pytest.raises(ConfigError, match="topic_prefix"):
        export_settings(Settings(data_dir="/tmp/x", topic_prefix=""), {})


def test_streamlit_options_bind_loopback() -> None:
    opts = streamlit_options(Settings(dashboard_port=8123))
    assert opts["server_port"] == 8123 and opts["server_address"] == "127.0.0.1"
    assert opts["server_headless"] is True and opts["browser_gatherUsageStats"] is False
    assert opts.get("server_enableAgentApi") is True  # streamlit 1.67 has the agent API
    assert opts["client_toolbarMode"] == "minimal"  # no Deploy button or developer menu
    assert opts["server_fileWatcherType"] == "none"


def test_option_flags_are_what_streamlit_run_takes() -> None:
    assert option_flags({"server_port": 8501, "server_headless": True, "browser_gatherUsageStats": False,
                         "server_fileWatcherType": "none"}) == [
        "--server.port", "8501", "--server.headless", "true", "--browser.gatherUsageStats", "false",
        "--server.fileWatcherType", "none"]


def agent_text(port: int) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/_stcore/agent/interact", data=b"{}",
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        doc = json.load(resp)
    return json.dumps(doc["tree"])


@pytest.mark.kafka
@pytest.mark.clickhouse
def test_serve_runs_sink_and_dashboard_in_one_process(fresh_topics: Settings, tmp_path: Path) -> None:
    settings = fresh_topics.with_overrides(clickhouse_dsn=f"chdb://{tmp_path / 'ch'}", dashboard_port=free_port(),
                                           sink_group=f"serve-{uuid.uuid4().hex[:8]}", sink_batch_s=0.2)
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": settings.bootstrap})
    now = time.time_ns()
    for rank in range(2):
        body = {"step": list(range(20)), "start_ns": [now + i for i in range(20)],
                "end_ns": [now + i + 10 for i in range(20)], "comm_ns": [1] * 20}
        p.produce(Topic.STEPS.name_for(settings), key=b"job-s", value=encode(
            Envelope(kind="steps", job="job-s", rank=rank, host="h", pid=10 + rank, seq=1, sent_ns=now, body=body)))
    assert p.flush(30) == 0

    page = tmp_path / "page.py"
    page.write_text(PAGE)
    env = dict(os.environ)
    export_settings(settings, env)
    log_path = tmp_path / "serve.log"
    log_file = log_path.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "rankscope", "serve", "--script", str(page)], cwd=REPO, env=env,
                            stdout=log_file, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + DEADLINE_S
        text = ""
        while "steps=40" not in text:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < end, f"the page never showed 40 steps; last: {text[-500:]}"
            try:
                text = agent_text(settings.dashboard_port)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        assert f"prefix={settings.topic_prefix}" in text and "sink=yes" in text

        # While serve holds the embedded store, the sink command refuses with a clear message.
        other = subprocess.run([sys.executable, "-m", "rankscope", "sink"], cwd=REPO, env=env, capture_output=True,
                               text=True, timeout=120)
        assert other.returncode == 2, other.stderr[-2000:]
        assert "open in another process" in other.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log_file.close()
    assert proc.returncode == 0, log_path.read_text()[-3000:]
    # The directory is released and holds the rows.
    store = open_store(settings.store_dsn)
    try:
        assert store.query_rows("SELECT count() FROM rankscope.steps FINAL") == [(40,)]
    finally:
        close_store(settings.store_dsn)
