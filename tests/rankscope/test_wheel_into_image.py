"""The wheel installed into a training image's venv keeps the image's own packages.

A training image brings its own psutil and msgpack, often older than the ones requirements.lock
holds. The image venv here gets psutil 6 and msgpack 1.0 first, from the package index pip is
configured with (network: without it these tests fail), then the wheel offline from the wheelhouse
(``pip install rankscope`` in the image): the image's versions stay, and the rank side runs on them.
A second venv gets ``rankscope[analysis]`` offline and runs ``rankscope analyze`` without faust.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.rankscope.test_wheel import REPO, build_wheel
from tests.rankscope.test_wheel_install import WHEELHOUSE, _distributions, _env

IMAGE_PACKAGES = {"psutil": "6.1.1", "msgpack": "1.0.8"}
TRACES = REPO / "tests" / "data" / "hta_sampled2"
SERVER_DISTS = {"faust-streaming", "aiokafka", "streamlit", "chdb", "clickhouse-connect", "pyarrow"}


def _pip_install(bin_dir: Path, *args: str) -> None:
    res = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", *args], env=_env(),
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"pip install {' '.join(args)}:\n{res.stdout}{res.stderr}"


def _new_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300, capture_output=True)
    return path / "bin"


def _run(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], cwd=cwd, env=_env(RANKSCOPE_DATA_DIR=str(cwd)),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert WHEELHOUSE.is_dir(), f"no wheelhouse at {WHEELHOUSE}: run make install"
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def image_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    bin_dir = _new_venv(tmp_path_factory.mktemp("venvs") / "image")
    _pip_install(bin_dir, *(f"{dist}=={version}" for dist, version in IMAGE_PACKAGES.items()))
    _pip_install(bin_dir, "--no-index", "--find-links", str(WHEELHOUSE), str(wheel))
    return bin_dir


@pytest.mark.index
def test_rank_side_keeps_the_image_packages(image_venv: Path, tmp_path: Path) -> None:
    script = "import importlib.metadata as m, json; print(json.dumps({d: m.version(d) for d in %r}))"
    res = _run(image_venv, "python", "-c", script % sorted(IMAGE_PACKAGES), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout) == IMAGE_PACKAGES
    dists = _distributions(image_venv)
    assert "rankscope" in dists and not dists & (SERVER_DISTS | {"pandas", "msgspec"}), sorted(dists)


@pytest.mark.index
def test_rank_side_runs_on_the_image_packages(image_venv: Path, tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import time
        import psutil
        import rankscope
        from rankscope import Tracer
        from rankscope.producers.hw_host import HostSampler
        from rankscope.protocol.envelope import Envelope, decode, encode

        print("rankscope from", rankscope.__file__, "Tracer", Tracer.__name__)
        sampler = HostSampler(psutil)
        sampler.sample(time.monotonic())
        time.sleep(0.3)
        print("host metrics", sorted(sampler.sample(time.monotonic())))
        env = Envelope(kind="exit", job="j", rank=0, host="h", pid=1, seq=0, sent_ns=1,
                       body={"step": 3, "reason": "completed", "detail": ""})
        assert decode(encode(env)) == env, decode(encode(env))
    """)
    res = _run(image_venv, "python", "-c", script, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"rankscope from {image_venv.parent}" in res.stdout and "Tracer Tracer" in res.stdout, res.stdout
    for metric in ("cpu_util", "mem_used_bytes", "mem_total_bytes", "net_tx_bytes_s"):
        assert f"'{metric}'" in res.stdout, res.stdout


@pytest.mark.index
def test_analyze_without_the_extra_names_it(image_venv: Path, tmp_path: Path) -> None:
    res = _run(image_venv, "rankscope", "analyze", "-q", str(TRACES), cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "pip install 'rankscope[analysis]'" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert "faust" not in res.stderr and "processors" not in res.stderr, res.stderr


def test_analysis_extra_runs_analyze_and_trace_analysis(wheel: Path, tmp_path_factory: pytest.TempPathFactory,
                                                        tmp_path: Path) -> None:
    bin_dir = _new_venv(tmp_path_factory.mktemp("venvs") / "analysis")
    _pip_install(bin_dir, "--no-index", "--find-links", str(WHEELHOUSE), f"{wheel}[analysis]")
    dists = _distributions(bin_dir)
    assert {"pandas", "msgspec"} <= dists and not dists & SERVER_DISTS, sorted(dists)
    res = _run(bin_dir, "rankscope", "analyze", "-q", "--workers", "1", "--format", "json", str(TRACES),
               cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "diagnosis" in json.loads(res.stdout), res.stdout[:2000]
    script = textwrap.dedent(f"""
        from rankscope.analysis import TraceAnalysis
        a = TraceAnalysis(trace_dir={str(TRACES)!r})
        print(len(a.get_temporal_breakdown()), list(a.get_slow_workers().columns))
    """)
    res = _run(bin_dir, "python", "-c", script, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "'rank'" in res.stdout, res.stdout
