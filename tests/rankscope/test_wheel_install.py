"""The built wheel installed without ``-e`` into fresh venvs, offline from the wheelhouse, as users do.

- rank side (``pip install rankscope``): only the rank dependencies arrive (no server library, no
  torch); a Tracer in that venv sends to the real broker and its messages arrive; server commands
  stop with a message naming the extra to install;
- server side (``pip install 'rankscope[server]'``): ``rankscope serve`` comes up and answers HTTP.

The wheelhouse is the Makefile's (``WHEELHOUSE``, default ~/.cache/rankscope/wheels), which
``make install`` fills from requirements.lock. Each venv install prints its duration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from rankscope.config import Settings
from rankscope.protocol.envelope import decode
from rankscope.topics import Topic
from tests.integration.helpers import TopicReader, free_port, stop_process, tail, wait_until
from tests.rankscope.test_wheel import build_wheel

pytestmark = pytest.mark.kafka

WHEELHOUSE = Path(os.environ.get("WHEELHOUSE") or Path.home() / ".cache" / "rankscope" / "wheels")
NOT_ON_RANKS = {"streamlit", "faust-streaming", "chdb", "chdb-core", "pandas", "pyarrow", "torch",
                "clickhouse-connect", "aiokafka"}
RANK_DISTS = {"rankscope", "confluent-kafka", "msgpack", "numpy", "psutil"}


def _venv(path: Path, requirement: str) -> Path:
    """A fresh venv at ``path`` with ``requirement`` installed offline; returns its bin folder."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300, capture_output=True)
    t1 = time.monotonic()
    res = subprocess.run([str(path / "bin" / "pip"), "install", "-q", "--no-index", "--find-links", str(WHEELHOUSE),
                          requirement], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    print(f"venv {path.name}: created in {t1 - t0:.1f} s, {requirement.rsplit('/', 1)[-1]} installed in "
          f"{time.monotonic() - t1:.1f} s")
    return path / "bin"


def _env(**extra: str) -> dict[str, str]:
    """The environment of a user's process: nothing of this repo's venv, path or settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANKSCOPE_", "PYTHON", "VIRTUAL_ENV"))}
    env.update({"PYTHONUNBUFFERED": "1", **extra})
    return env


def _distributions(bin_dir: Path) -> set[str]:
    out = subprocess.run([str(bin_dir / "python"), "-m", "pip", "list", "--format", "json"], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return {d["name"].lower().replace("_", "-") for d in json.loads(out)}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert WHEELHOUSE.is_dir(), f"no wheelhouse at {WHEELHOUSE}: run make install"
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def rank_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _venv(tmp_path_factory.mktemp("venvs") / "rank", str(wheel))


def test_rank_side_installs_only_the_rank_dependencies(rank_venv: Path) -> None:
    dists = _distributions(rank_venv)
    print("rank venv:", sorted(dists))
    assert RANK_DISTS <= dists, dists
    assert not dists & NOT_ON_RANKS, sorted(dists & NOT_ON_RANKS)


def test_rank_side_tracer_sends_to_the_real_broker(rank_venv: Path, fresh_topics: Settings,
                                                   tmp_path: Path) -> None:
    job = f"wheel-{uuid.uuid4().hex[:8]}"
    script = textwrap.dedent("""
        import importlib.util, rankscope, sys, time
        from rankscope import Tracer
        print("rankscope from", rankscope.__file__)
        print("pynvml installed:", importlib.util.find_spec("pynvml") is not None)
        tracer = Tracer(install_collective_timing=False, handle_signals=False)
        for _ in range(5):
            tracer.step()
        time.sleep(1.5)  # the hardware sampler takes host samples (no NVML without the gpu extra)
        tracer.close()
        print("torch imported:", "torch" in sys.modules)
    """)
    env = _env(RANKSCOPE_BOOTSTRAP_SERVERS=fresh_topics.bootstrap, RANKSCOPE_TOPIC_PREFIX=fresh_topics.topic_prefix,
               RANKSCOPE_DATA_DIR=str(tmp_path), RANKSCOPE_JOB_ID=job, RANKSCOPE_RANK="0",
               RANKSCOPE_WORLD_SIZE="1", RANKSCOPE_LOCAL_RANK="0")
    res = subprocess.run([str(rank_venv / "python"), "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"rankscope from {rank_venv.parent}" in res.stdout, res.stdout
    assert "torch imported: False" in res.stdout and "pynvml installed: False" in res.stdout, res.stdout
    readers = [TopicReader(fresh_topics, Topic.STEPS), TopicReader(fresh_topics, Topic.HW)]
    try:
        def arrived() -> set[str]:
            kinds = set()
            for reader in readers:
                reader.poll(0.5)
                kinds |= {e.kind for e in map(decode, reader.values) if e.job == job}
            return kinds if {"beat", "exit", "hw"} <= kinds else set()

        wait_until(arrived, 60, f"the step records, host samples and the exit record of {job}")
    finally:
        for reader in readers:
            reader.close()


@pytest.mark.parametrize(("command", "extra"), [("processors", "rankscope[processors]"),
                                                ("serve", "rankscope[dashboard,sink,embedded]"),
                                                ("sink", "rankscope[sink,embedded]")])
def test_rank_side_server_commands_name_the_extra(rank_venv: Path, tmp_path: Path, command: str,
                                                  extra: str) -> None:
    res = subprocess.run([str(rank_venv / "rankscope"), command], cwd=tmp_path,
                         env=_env(RANKSCOPE_DATA_DIR=str(tmp_path), RANKSCOPE_BOOTSTRAP_SERVERS="127.0.0.1:1"),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"pip install '{extra}'" in res.stderr and "Traceback" not in res.stderr, res.stderr


@pytest.mark.clickhouse
def test_server_side_serve_comes_up(wheel: Path, fresh_topics: Settings,
                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    bin_dir = _venv(tmp_path_factory.mktemp("venvs") / "server", f"{wheel}[server]")
    dists = _distributions(bin_dir)
    assert {"streamlit", "faust-streaming", "chdb", "clickhouse-connect"} <= dists
    assert "torch" not in dists and "pytest" not in dists
    work = tmp_path_factory.mktemp("serve")
    port, metrics = free_port(), free_port()
    log = work / "serve.log"
    env = _env(RANKSCOPE_BOOTSTRAP_SERVERS=fresh_topics.bootstrap, RANKSCOPE_TOPIC_PREFIX=fresh_topics.topic_prefix,
               RANKSCOPE_DATA_DIR=str(work), RANKSCOPE_DASHBOARD_PORT=str(port),
               RANKSCOPE_METRICS_PORT_SERVE=str(metrics))
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(bin_dir / "rankscope"), "serve"], cwd=work, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def answers(url: str) -> bool:
        assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{tail(log)}"
        try:
            with urllib.request.urlopen(url, timeout=3) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/_stcore/health"), 180, "the dashboard's health")
        assert answers(f"http://127.0.0.1:{port}/")
        wait_until(lambda: answers(f"http://127.0.0.1:{metrics}/metrics"), 60, "serve's /metrics")
    finally:
        stop_process(proc)
    text = log.read_text()
    assert "Traceback" not in text, tail(log)
    assert f"dashboard on http://127.0.0.1:{port}" in text and "sink consuming" in text, tail(log)
