"""Keep the local stack's services running: start each as a child, restart it when it exits.

``rankscope up`` starts one detached ``rankscope supervise`` process, which runs :class:`Supervisor`:

1. start every service as a child in its own session (stdout and stderr appended to
   ``<data_dir>/logs/<name>.log``) and write ``<data_dir>/run/<name>.pid``, which
   :func:`rankscope.cli.stack.services.pid_of` reads;
2. poll the children every ``tick_s``; when one exits without being asked to, write its exit status
   (code or signal) into that service's log, SIGKILL what is left of its process group, and start it
   again after the :class:`BackoffPolicy` delay; each child gets ``RANKSCOPE_RESTARTS``, how many
   times its service was restarted before it (the service's ``rankscope_service_restarts`` metric);
3. after every change, replace ``<data_dir>/run/supervisor.json`` atomically (see :func:`read_state`);
4. once :meth:`Supervisor.request_stop` was called (the command calls it on SIGTERM and SIGINT),
   send SIGTERM to each child's process group, SIGKILL after ``stop_timeout_s``, remove the
   children's pid files and return.

Delays and timeouts are read from an injected clock and waited with an injected ``sleep``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankscope.cli.stack import services
from rankscope.clock import SYSTEM_CLOCK, Clock
from rankscope.config import RESTARTS_ENV, Settings

log = logging.getLogger(__name__)

STATE_FILE = "supervisor.json"
STOP_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class BackoffPolicy:
    """When to restart a service that exited, in seconds.

    The first exit of a streak waits ``initial_s``, each further one ``factor`` times longer, at most
    ``max_s``. A child that ran at least ``reset_after_s`` was healthy: its exit starts a new streak.
    """

    initial_s: float = 1.0
    factor: float = 2.0
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.initial_s > 0:
            raise ValueError(f"initial_s must be > 0 seconds, got {self.initial_s!r}")
        if not self.factor >= 1:
            raise ValueError(f"factor must be >= 1, got {self.factor!r}")
        if not self.max_s >= self.initial_s:
            raise ValueError(f"max_s must be >= initial_s ({self.initial_s!r}), got {self.max_s!r}")
        if not self.reset_after_s > 0:
            raise ValueError(f"reset_after_s must be > 0 seconds, got {self.reset_after_s!r}")

    def delay(self, failures: int) -> float:
        """The wait after the ``failures``-th exit of a streak (1 = the first). Raises ValueError below 1."""
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures!r}")
        try:
            return min(self.max_s, self.initial_s * self.factor ** (failures - 1))
        except OverflowError:
            return self.max_s

    def after_exit(self, failures: int, ran_s: float) -> tuple[int, float]:
        """A child that ran ``ran_s`` exited after ``failures`` exits in a row: the new streak and the wait."""
        streak = 1 if ran_s >= self.reset_after_s else failures + 1
        return streak, self.delay(streak)


@dataclass(frozen=True)
class ServiceSpec:
    """One supervised service: its name (pid and log file names) and the argv that runs it."""

    name: str
    argv: tuple[str, ...]


def rankscope_services(names: Sequence[str]) -> list[ServiceSpec]:
    """The production services: ``python -m rankscope <name>`` for each name."""
    return [ServiceSpec(n, (sys.executable, "-m", "rankscope", n)) for n in names]


def describe_exit(returncode: int) -> str:
    """``exit N`` or ``signal NAME`` from a Popen return code."""
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


def read_state(settings: Settings) -> dict[str, Any] | None:
    """The last state the supervisor wrote, or None if there is none (never raises for a bad file).

    Shape: ``{"pid": int, "updated": unix_s, "stopped": unix_s | None, "services": {name: {"pid":
    int | None, "restarts": int, "last_exit": "exit 1" | "signal SIGKILL" | None, "started": unix_s
    | None}}}``; ``started`` is when the running child started.
    """
    try:
        state = json.loads((services.run_dir(settings) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


class _Child:
    def __init__(self, spec: ServiceSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_mono = 0.0
        self.started_wall: float | None = None
        self.due: float | None = 0.0
        self.starts = 0
        self.failures = 0
        self.last_exit: str | None = None


class Supervisor:
    """Runs ``specs`` as children and restarts them (steps in the module docstring).

    :meth:`run` blocks until :meth:`request_stop` and returns 0 once every child is gone.
    ``sleep`` and ``clock.monotonic`` decide every wait; ``clock.wall_ns`` only stamps the state file.
    """

    def __init__(self, settings: Settings, specs: Sequence[ServiceSpec], *,
                 policy: BackoffPolicy = BackoffPolicy(), clock: Clock = SYSTEM_CLOCK,
                 sleep: Callable[[float], None] = time.sleep, tick_s: float = 0.2,
                 stop_timeout_s: float = STOP_TIMEOUT_S, env: Mapping[str, str] | None = None) -> None:
        if not specs or len({s.name for s in specs}) != len(specs):
            raise ValueError(f"need at least one service and unique names, got {[s.name for s in specs]}")
        self.settings = settings
        self.policy = policy
        self._clock = clock
        self._sleep = sleep
        self._tick_s = tick_s
        self._stop_timeout_s = stop_timeout_s
        self._env = dict(env) if env is not None else {**os.environ, **settings.to_env()}
        self._children = [_Child(s) for s in specs]
        self._run_dir = services.run_dir(settings)
        self._stopping = False

    def request_stop(self) -> None:
        """Ask :meth:`run` to stop the children and return. Safe to call from a signal handler."""
        self._stopping = True

    def run(self) -> int:
        self._write_state(stopped=False)
        try:
            while not self._stopping:
                now = self._clock.monotonic()
                changed = False
                for c in self._children:
                    if c.proc is not None and (rc := c.proc.poll()) is not None:
                        self._exited(c, rc, now)
                        changed = True
                    if c.proc is None and c.due is not None and c.due <= now and not self._stopping:
                        self._start(c, now)
                        changed = True
                if changed:
                    self._write_state(stopped=False)
                self._sleep(self._wait_s(self._clock.monotonic()))
        finally:
            self._stop_children()
            self._write_state(stopped=True)
        return 0

    def _wait_s(self, now: float) -> float:
        dues = [c.due - now for c in self._children if c.proc is None and c.due is not None]
        return max(0.0, min([self._tick_s, *dues]))

    def _start(self, c: _Child, now: float) -> None:
        name = c.spec.name
        try:
            with open(services.log_path(self.settings, name), "ab") as out:
                c.proc = subprocess.Popen(list(c.spec.argv), stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env={**self._env, RESTARTS_ENV: str(c.starts)},
                                          start_new_session=True)
        except OSError as e:
            c.failures, delay = self.policy.after_exit(c.failures, 0.0)
            c.last_exit = f"start failed: {e}"
            c.due = now + delay
            self._note(name, f"could not start {name}: {e}; next try in {delay:.1f} s")
            return
        if c.starts:
            self._note(name, f"restarted {name} (restart {c.starts}), pid {c.proc.pid}")
        c.starts += 1
        c.started_mono, c.started_wall, c.due = now, self._clock.wall_ns() / 1e9, None
        _write_atomic(self._pid_path(name), str(c.proc.pid))

    def _exited(self, c: _Child, rc: int, now: float) -> None:
        assert c.proc is not None
        pid, ran_s = c.proc.pid, now - c.started_mono
        _sweep_group(pid)
        c.proc, c.started_wall = None, None
        self._pid_path(c.spec.name).unlink(missing_ok=True)
        c.failures, delay = self.policy.after_exit(c.failures, ran_s)
        c.last_exit = describe_exit(rc)
        c.due = now + delay
        self._note(c.spec.name, f"{c.spec.name} (pid {pid}) exited with {c.last_exit} after {ran_s:.1f} s; "
                                f"restart {c.starts} in {delay:.1f} s")

    def _stop_children(self) -> None:
        running = [(c, c.proc) for c in self._children if c.proc is not None]
        for _, proc in running:
            _signal_group(proc, signal.SIGTERM)
        deadline = self._clock.monotonic() + self._stop_timeout_s
        while any(p.poll() is None for _, p in running) and self._clock.monotonic() < deadline:
            self._sleep(self._tick_s)
        for c, proc in running:
            if proc.poll() is None:
                self._note(c.spec.name, f"{c.spec.name} (pid {proc.pid}) ignored SIGTERM for "
                                        f"{self._stop_timeout_s:.0f} s; SIGKILL")
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            c.last_exit = describe_exit(proc.returncode)
            c.proc, c.started_wall = None, None
            self._pid_path(c.spec.name).unlink(missing_ok=True)

    def _note(self, name: str, message: str) -> None:
        log.warning("%s", message)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        try:
            with open(services.log_path(self.settings, name), "a") as f:
                f.write(f"{stamp} rankscope supervisor: {message}\n")
        except OSError as e:
            log.error("cannot write %s's log: %s", name, e)

    def _pid_path(self, name: str) -> Path:
        return self._run_dir / f"{name}.pid"

    def _write_state(self, stopped: bool) -> None:
        now = self._clock.wall_ns() / 1e9
        state = {
            "pid": os.getpid(), "updated": now, "stopped": now if stopped else None,
            "services": {c.spec.name: {"pid": c.proc.pid if c.proc is not None else None,
                                       "restarts": max(0, c.starts - 1), "last_exit": c.last_exit,
                                       "started": c.started_wall} for c in self._children},
        }
        _write_atomic(self._run_dir / STATE_FILE, json.dumps(state, indent=1))


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except OSError:  # no group left: signal the child itself unless it was already reaped
        try:
            proc.send_signal(sig)
        except OSError:
            pass


def _sweep_group(pgid: int) -> None:
    # A group id stays reserved while any member lives, so this reaches only what the child left.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
