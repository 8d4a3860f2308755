"""Background services of the local stack: start as detached processes with pid and log files, stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rankscope.config import Settings


class ServiceError(RuntimeError):
    pass


def run_dir(settings: Settings) -> Path:
    d = Path(settings.data_dir) / "run"
    d.mkdir(parents=True, exist_ok=True)
    return d


def log_path(settings: Settings, name: str) -> Path:
    d = Path(settings.data_dir) / "logs"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{name}.log"


def pid_of(settings: Settings, name: str) -> int | None:
    p = run_dir(settings) / f"{name}.pid"
    try:
        pid = int(p.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if alive(pid) else None


def alive(pid: int) -> bool:
    """True if ``pid`` is a process of ours that runs; a zombie (exited, not yet reaped) does not."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust the signal check
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


def start(settings: Settings, name: str, args: list[str]) -> int:
    """Start ``python -m rankscope <args>`` detached, unless already running. Returns the pid."""
    pid = pid_of(settings, name)
    if pid:
        return pid
    env = {**os.environ, **settings.to_env()}
    log = open(log_path(settings, name), "ab")
    proc = subprocess.Popen([sys.executable, "-m", "rankscope", *args], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    (run_dir(settings) / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def stop(settings: Settings, name: str, timeout_s: float = 20.0) -> bool:
    """SIGTERM, then SIGKILL after ``timeout_s``. Returns True if something was stopped."""
    pid = pid_of(settings, name)
    if not pid:
        return False
    try:
        os.killpg(pid, signal.SIGTERM)
    except OSError:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(pid)
        if not alive(pid):
            break
        time.sleep(0.2)
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    (run_dir(settings) / f"{name}.pid").unlink(missing_ok=True)
    return True


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def wait_port(host: str, port: int, timeout_s: float, name: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    tail = ""
    if log and log.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    raise ServiceError(f"{name} did not open {host}:{port} within {timeout_s:.0f}s\n{tail}")
