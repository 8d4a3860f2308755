"""The supervisor: the backoff policy, the restart schedule on a manual clock, and a real
``rankscope supervise`` process that restarts a child killed with SIGKILL and stops it on SIGTERM.

The supervised child is a stand-in (``--service NAME=COMMAND``, a sleeping Python) so the test needs
no broker; everything else (pid files, state file, ``rankscope status`` and ``down``) is the product's.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from rankscope.cli.stack import services
from rankscope.cli.stack.supervisor import BackoffPolicy, ServiceSpec, Supervisor, describe_exit, read_state
from rankscope.clock import ManualClock
from rankscope.config import Settings
from tests.integration.helpers import wait_until

T = TypeVar("T")
DEADLINE_S = 60.0
SLEEPER = f"{shlex.quote(sys.executable)} -c 'import time; time.sleep(3600)'"


def test_backoff_doubles_to_the_cap() -> None:
    p = BackoffPolicy()
    assert [p.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert p.delay(100_000) == 30  # no overflow however long the streak


def test_backoff_streak_resets_after_a_healthy_run() -> None:
    p = BackoffPolicy(initial_s=0.5, factor=3, max_s=10, reset_after_s=60)
    assert p.after_exit(0, ran_s=0.1) == (1, 0.5)
    assert p.after_exit(1, ran_s=59.9) == (2, 1.5)
    assert p.after_exit(3, ran_s=5) == (4, 10)
    assert p.after_exit(4, ran_s=60) == (1, 0.5)


@pytest.mark.parametrize("kwargs, field", [
    ({"initial_s": 0}, "initial_s"), ({"factor": 0.5}, "factor"), ({"max_s": 0.5}, "max_s"),
    ({"reset_after_s": -1}, "reset_after_s"), ({"initial_s": float("nan")}, "initial_s"),
])
def test_backoff_policy_validates(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        BackoffPolicy(**kwargs)
    with pytest.raises(ValueError, match="failures"):
        BackoffPolicy().delay(0)


def test_describe_exit() -> None:
    assert describe_exit(3) == "exit 3"
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"


def test_restart_schedule_on_a_manual_clock(tmp_path: Path) -> None:
    """A real child that exits at once is restarted after 1, 2, 4 s of the manual clock."""
    settings = Settings.from_env(data_dir=str(tmp_path))
    clock = ManualClock(start_s=1000.0)
    starts: list[float] = []

    def sleep(seconds: float) -> None:
        state = read_state(settings)
        svc = state["services"]["crasher"] if state else {}
        if svc.get("started") is not None and svc["started"] not in starts:
            starts.append(svc["started"])
        if len(starts) == 4:
            sup.request_stop()
        if svc.get("pid"):
            time.sleep(0.005)  # the child runs in real time; the manual clock stands still meanwhile
        else:
            clock.advance(seconds)

    crasher = ServiceSpec("crasher", (sys.executable, "-c", "raise SystemExit(3)"))
    sup = Supervisor(settings, [crasher], clock=clock, sleep=sleep)
    assert sup.run() == 0
    assert [b - a for a, b in zip(starts, starts[1:], strict=False)] == pytest.approx([1, 2, 4])
    log = services.log_path(settings, "crasher").read_text()
    assert "exited with exit 3" in log and "restart 3 in 4.0 s" in log


def _cli(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rankscope", *args], env=_env(data_dir), cwd=data_dir,
                          capture_output=True, text=True, timeout=DEADLINE_S)


def _env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    return {**env, "RANKSCOPE_DATA_DIR": str(data_dir)}


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Settings]]:
    """A real ``rankscope supervise`` process supervising one sleeper; both killed afterwards."""
    settings = Settings.from_env(data_dir=str(tmp_path))
    with open(tmp_path / "supervise.out", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rankscope", "supervise", "--service", f"sleeper={SLEEPER}"],
                                env=_env(tmp_path), cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc, settings
    finally:
        pid = services.pid_of(settings, "sleeper")
        proc.kill()
        proc.wait()
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _sleeper_line(data_dir: Path) -> str | None:
    res = _cli(data_dir, "status")
    assert res.returncode == 0, res.stderr
    return next((ln for ln in res.stdout.splitlines() if ln.startswith("sleeper")), None)


def test_killed_child_is_restarted_and_sigterm_stops_it(supervised, tmp_path: Path) -> None:
    proc, settings = supervised
    first = wait_until(lambda: services.pid_of(settings, "sleeper"), DEADLINE_S, "the first sleeper")
    os.kill(first, signal.SIGKILL)
    second = wait_until(lambda: (p := services.pid_of(settings, "sleeper")) != first and p, DEADLINE_S, "a new sleeper")
    assert services.alive(second) and not services.alive(first)

    line = wait_until(lambda: (ln := _sleeper_line(tmp_path)) and "restarts 1" in ln and ln, DEADLINE_S, "status: restarts 1")
    assert f"pid {second}" in line and "last exit signal SIGKILL" in line
    log = services.log_path(settings, "sleeper").read_text()
    assert f"sleeper (pid {first}) exited with signal SIGKILL" in log

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=DEADLINE_S) == 0
    assert not services.alive(second)
    assert not (services.run_dir(settings) / "sleeper.pid").exists()
    assert not (services.run_dir(settings) / "supervisor.pid").exists()
    state = json.loads((services.run_dir(settings) / "supervisor.json").read_text())
    assert state["stopped"] is not None and state["services"]["sleeper"]["pid"] is None
    assert "supervisor   stopped" in _cli(tmp_path, "status").stdout


def test_down_stops_the_supervisor_and_its_child(supervised, tmp_path: Path) -> None:
    proc, settings = supervised
    child = wait_until(lambda: services.pid_of(settings, "sleeper"), DEADLINE_S, "the sleeper")
    wait_until(lambda: services.pid_of(settings, "supervisor"), DEADLINE_S, "the supervisor's pid file")
    res = _cli(tmp_path, "down", "--keep-kafka")
    assert res.returncode == 0, res.stderr
    assert "stopped supervisor" in res.stdout
    assert proc.wait(timeout=DEADLINE_S) == 0
    assert not services.alive(child)


def test_a_second_supervisor_refuses_to_start(supervised, tmp_path: Path) -> None:
    proc, settings = supervised
    wait_until(lambda: services.pid_of(settings, "supervisor"), DEADLINE_S, "the supervisor's pid file")
    res = _cli(tmp_path, "supervise", "--service", f"other={SLEEPER}")
    assert res.returncode == 1 and "already runs" in res.stderr
