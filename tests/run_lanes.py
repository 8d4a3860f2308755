"""Run the whole suite as three pytest processes side by side, so `make test` uses both cores.

    python tests/run_lanes.py              # the three lanes
    python tests/run_lanes.py ARGS...      # one plain pytest run with ARGS (a file, -k, -m ...)

The suite's time is mostly integration scenarios that wait (a hang to be named, a restart to
rebuild its state) while a job or a load generator runs. The lanes are:

- ``jobs``: the tests that run real torchrun jobs (marker ``torchrun``) and judge detection on the
  job's own timings (how soon a slow rank is named, that a healthy run raises nothing). Their ranks
  compute on every core, so this lane runs at normal priority.
- ``faults``: the other integration and deploy tests (processor kills and restarts, SASL, replays),
  which wait on processors and brokers far more than they compute, and the torchrun tests marked
  ``fault_lane`` (trace windows on request, a broker killed mid-job, the monitoring panels' queries
  on a job's store), whose jobs only feed what they check. At nice 10: their deadlines are generous
  and they mostly wait, while the jobs lane's detection times are bounded (a slow device named
  within 30 s of the job's start) and its healthy runs must raise nothing (a rank starved by the
  other lanes' jobs is a slow rank to the rule), so the jobs lane gets the cores first.
  ``fault_lane`` is for tests under tests/integration and tests/deploy only
  (tests/test_run_lanes.py checks it), the folders this lane runs.
- ``units``: everything else (unit, store, dashboard and browser tests). CPU-bound and with no
  timing of their own, at lower priority (nice 10, as the faults lane), so they take the cores the other lanes leave
  idle instead of slowing the jobs they judge. One lane, not two: split in two (measured 2026-12-07)
  the lanes ended together, but the machine did 8% more work (a fourth broker and pytest session;
  the jobs, which run until their alert, took the rest) and the suite took longer.

Each lane is its own pytest session with its own broker (tests/conftest.py) and its own topics
and stores, so no lane sees another's messages. Each lane's output is printed whole when it ends;
while they run a line a minute says where each stands. The exit status is non-zero if any lane
fails (or collects no test).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=15", "--cpu-durations=15"]


FAULT_DIRS = ("tests/integration", "tests/deploy")


@dataclass(frozen=True)
class Lane:
    name: str
    args: tuple[str, ...]
    nice: int = 0


LANES = (
    Lane("jobs", ("-m", "torchrun and not fault_lane", "tests")),
    Lane("faults", ("-m", "not torchrun or fault_lane", *FAULT_DIRS), nice=10),
    Lane("units", ("-m", "not torchrun", "tests", *(f"--ignore={d}" for d in FAULT_DIRS)), nice=10),
)


def last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 400))
            lines = [s for s in f.read().decode(errors="replace").splitlines() if s.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[-100:] if lines else ""


def failures(path: Path) -> list[str]:
    """The ``FAILED`` and ``ERROR`` lines of a lane's short test summary: repeated at the end of the
    run, so that a log cut to its tail (as CI keeps it) still says which tests failed and why."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    _, found, summary = text.rpartition("short test summary info")
    return [s[:600] for s in summary.splitlines() if s.startswith(("FAILED ", "ERROR "))] if found else []


def reap(proc: subprocess.Popen[bytes]) -> tuple[int, float] | None:
    """``(exit code, CPU seconds)`` once the lane's pytest has ended, else None. The CPU is that of the
    lane's whole process tree as far as it was reaped (pytest, its brokers, jobs, servers, browsers)."""
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    if pid == 0:
        return None
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def machine_cpu(stat: Path = Path("/proc/stat")) -> tuple[float, float]:
    """``(busy, idle)`` CPU seconds of the whole machine since boot, all cores (``/proc/stat``'s ``cpu``
    line; idle includes iowait). Unlike a lane's reaped tree it also counts processes that outlived
    their parent (daemonised services) and everything else running beside the suite."""
    fields = [int(v) for v in stat.read_text().splitlines()[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    # guest time is already counted in user time
    busy = sum(fields[:8]) - idle
    return busy / tick, idle / tick


def run_lanes(lanes: tuple[Lane, ...] = LANES, report_every_s: float = 60.0) -> int:
    logs = Path(tempfile.mkdtemp(prefix="rankscope-lanes-"))
    t0 = time.monotonic()
    busy0, idle0 = machine_cpu()
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    for lane in lanes:
        log = logs / f"{lane.name}.log"
        def lower(n: int = lane.nice) -> None:
            os.nice(n)
        procs[lane.name] = (subprocess.Popen([*PYTEST, *lane.args], cwd=REPO, stdout=open(log, "wb"),
                                             stderr=subprocess.STDOUT, preexec_fn=lower if lane.nice else None),
                            log)
    print(f"lanes {', '.join(procs)} started; their logs: {logs}", flush=True)
    results: dict[str, tuple[int, float, float]] = {}
    next_report = t0 + report_every_s
    while len(results) < len(procs):
        for name, (proc, log) in procs.items():
            ended = reap(proc) if name not in results else None
            if ended is not None:
                results[name] = (ended[0], time.monotonic() - t0, ended[1])
                print(f"\n===== lane {name}: exit {ended[0]} after {results[name][1]:.0f} s =====", flush=True)
                sys.stdout.write(log.read_text(errors="replace"))
                sys.stdout.flush()
        if time.monotonic() >= next_report and len(results) < len(procs):
            running = [f"{n}: {last_line(log)}" for n, (_, log) in procs.items() if n not in results]
            print(f"[{time.monotonic() - t0:.0f} s] " + " | ".join(running), flush=True)
            next_report += report_every_s
        time.sleep(1.0)
    wall = time.monotonic() - t0
    print("\n===== lanes =====")
    for name, (rc, at, cpu) in results.items():
        print(f"{name:8s} exit {rc}  ended at {at:.0f} s  {cpu:.0f} CPU-s  {last_line(procs[name][1])}")
    for name, (_, log) in procs.items():
        for line in failures(log):
            print(f"{name}: {line}")
    cpu = sum(c for _, _, c in results.values())
    busy1, idle1 = machine_cpu()
    busy, idle = busy1 - busy0, idle1 - idle0
    print(f"whole suite: {wall:.0f} s ({wall / 60:.1f} min) of test time, {cpu:.0f} CPU-s in the lanes' "
          f"reaped processes ({cpu / wall:.2f} cores busy on average); the machine: {busy:.0f} CPU-s busy, "
          f"{idle:.0f} idle ({idle / max(busy + idle, 1e-9):.0%})", flush=True)
    return 0 if all(rc == 0 for rc, _, _ in results.values()) else 1


def main(argv: list[str]) -> int:
    if argv:
        return subprocess.call([*PYTEST, *argv], cwd=REPO)
    return run_lanes()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
