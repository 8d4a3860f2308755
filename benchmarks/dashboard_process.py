"""The dashboard as a real Streamlit process, for the benchmarks and the browser tests: its command
line, started, waited for until its health endpoint answers, and stopped."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rankscope.storage.serve import FIXED_OPTIONS, option_flags

START_TIMEOUT_S = 120.0


def streamlit_cmd(port: int, script: str | Path = "dashboard/server.py") -> list[str]:
    """``script`` (the dashboard's web server alone, no sink) on loopback ``port``, with the options
    ``rankscope serve`` sets (``FIXED_OPTIONS``)."""
    return [sys.executable, "-m", "streamlit", "run", str(script),
            *option_flags({"server_port": port, "server_address": "127.0.0.1", **FIXED_OPTIONS})]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until ``url``'s health endpoint answers; RuntimeError when the process exits or time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the dashboard exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the dashboard not healthy after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


@contextmanager
def running(cmd: list[str], port: int, env: dict[str, str], log: Path, cwd: Path,
            stop_timeout_s: float = 15.0) -> Iterator[str]:
    """Run ``cmd`` (a dashboard listening on ``port``) with its output in ``log``; yield its URL once
    healthy, then stop it."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
