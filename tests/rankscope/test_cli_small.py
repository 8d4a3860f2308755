"""Small CLI things: ``rankscope --version`` and the warning for a misspelled RANKSCOPE_* variable."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import rankscope
from rankscope import cli
from rankscope.config import RESTARTS_ENV, unknown_env
from rankscope.version import package_version


@pytest.fixture(autouse=True)
def keep_root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logging.captureWarnings(False)


def test_version_flag_prints_the_installed_version() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    out = subprocess.run([sys.executable, "-m", "rankscope", "--version"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"rankscope {importlib.metadata.version('rankscope')}"


def test_version_falls_back_to_the_package_version(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert package_version() == rankscope.__version__


def test_unknown_env_names_the_closest_setting() -> None:
    env = {"RANKSCOPE_JOBID": "a", "RANKSCOPE_KAFKA_PROT": "1", "RANKSCOPE_ZZZ_NOTHING_LIKE_IT": "x",
           "RANKSCOPE_JOB_ID": "ok", RESTARTS_ENV: "2", "OTHER_JOBID": "x"}
    assert unknown_env(env) == [
        "RANKSCOPE_JOBID is not a rankscope setting and is ignored; did you mean RANKSCOPE_JOB_ID?",
        "RANKSCOPE_KAFKA_PROT is not a rankscope setting and is ignored; did you mean RANKSCOPE_KAFKA_PORT?",
        "RANKSCOPE_ZZZ_NOTHING_LIKE_IT is not a rankscope setting and is ignored",
    ]
    assert unknown_env({"RANKSCOPE_DATA_DIR": "/tmp", "PATH": "/bin"}) == []


def test_a_command_warns_at_start_up_about_a_misspelled_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for k in [k for k in os.environ if k.startswith("RANKSCOPE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("RANKSCOPE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("RANKSCOPE_DASHBOARD_PROT", "8600")
    assert cli.main(["status"]) == 0
    captured = capsys.readouterr()
    assert ("WARNING rankscope.cli: RANKSCOPE_DASHBOARD_PROT is not a rankscope setting and is ignored; "
            "did you mean RANKSCOPE_DASHBOARD_PORT?") in captured.err
    # status lists each service's /metrics URL
    assert "metrics http://127.0.0.1:9470/metrics" in captured.out


def test_status_lists_metrics_urls_and_omits_services_turned_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for k in [k for k in os.environ if k.startswith("RANKSCOPE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("RANKSCOPE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("RANKSCOPE_METRICS_HOST", "::1")
    monkeypatch.setenv("RANKSCOPE_METRICS_PORT_PROCESSORS", "9999")
    monkeypatch.setenv("RANKSCOPE_METRICS_PORT_SERVE", "0")
    assert cli.main(["status"]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()}
    assert lines["processors"].endswith("metrics http://[::1]:9999/metrics")
    assert "metrics" not in lines["serve"]
