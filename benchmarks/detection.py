"""Detection latency and precision on real 4-rank torchrun jobs (gloo, CPU), one broker and processors worker.

- slow + hang (REPEATS times): rank 1 does 4x the compute from step 0 and rank 3 hangs at step
  HANG_AT: hang alert after the hanging rank's last step, slow-rank alert after rank 1's first step;
- onset: rank 2 does 1.5x the compute from step ONSET_STEP: slow-rank alert after that step began;
- crash: rank 2 raises at step FAIL_AT while its peers wait in all_reduce: rank_failed alert after
  its exit record was sent;
- DDP straggler under ``rankscope run``: the unmodified DDP script of the tests
  (tests/integration/scripts/plain_ddp.py, no Tracer, no ``watch_ddp``), rank 1 running its forward
  pass 4 times: slow-rank alert after rank 1's first step;
- healthy: at least HEALTHY_STEPS steps and HEALTHY_MIN_S seconds of identical work to completion:
  every alert of the job is false.
Times are the alert's ``opened_ns`` against the ranks' own step times (from the steps topic).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
from confluent_kafka import Consumer

from benchmarks._stack import env_for, free_port, local_stack, torchrun
from rankscope.alerts import Alert
from rankscope.topics import Topic

HANG_AT = 800           # after the slow-rank rule's horizon (straggler_min_s) has passed
REPEATS = 2
ONSET_STEP = 500
FAIL_AT = 300
HEALTHY_STEPS = 1500    # the job goes on past these until HEALTHY_MIN_S have passed
HEALTHY_MIN_S = 30
PLAIN_DDP = Path(__file__).resolve().parents[1] / "tests" / "integration" / "scripts" / "plain_ddp.py"


class Watch:
    """The alerts and step records of one job, read as they come."""

    def __init__(self, job: str, alerts: Any, steps: Any) -> None:
        self.job, self.alerts_c, self.steps_c = job, alerts, steps
        self.alerts: list[Alert] = []
        self.start_ns: dict[tuple[int, int], int] = {}
        self.last_end_ns: dict[int, int] = {}
        self.exit_ns: dict[int, int] = {}
        self.step_ns: list[int] = []

    def poll(self) -> None:
        for msg in self.alerts_c.consume(100, 0.2):
            if not msg.error():
                a = Alert.from_json(msg.value())
                if a.job == self.job:
                    self.alerts.append(a)
        for msg in self.steps_c.consume(500, 0.05):
            if msg.error():
                continue
            m = msgpack.unpackb(msg.value())
            if m["job"] == self.job and m["kind"] == "exit":
                self.exit_ns.setdefault(m["rank"], m["sent_ns"])
            if m["job"] != self.job or m["kind"] not in ("steps", "beat") or not m["body"]["step"]:
                continue
            b = m["body"]
            for s, a, e in zip(b["step"], b["start_ns"], b["end_ns"], strict=True):
                self.start_ns.setdefault((m["rank"], s), a)
                self.step_ns.append(e - a)
            self.last_end_ns[m["rank"]] = max(self.last_end_ns.get(m["rank"], 0), max(b["end_ns"]))

    def first(self, kind: str, min_step: int = -1) -> Alert | None:
        return next((a for a in self.alerts if a.kind == kind and a.status == "open" and a.step >= min_step), None)

    def until(self, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not done():
            self.poll()


def _stop(proc: Any) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)


def _slow_and_hang(settings: Any, alerts: Any, steps: Any) -> dict[str, float]:
    job = f"bench-{uuid.uuid4().hex[:6]}"
    w = Watch(job, alerts, steps)
    proc = torchrun(settings, job, "--steps", "100000", "--slow-rank", "1", "--hang-rank", "3",
                    "--hang-at-step", str(HANG_AT))
    try:
        w.until(lambda: w.first("slow_rank") is not None and w.first("hang", HANG_AT - 1) is not None
                and (1, 0) in w.start_ns and (3, HANG_AT - 1) in w.start_ns, 300)
    finally:
        _stop(proc)
    slow, hang = w.first("slow_rank"), w.first("hang", HANG_AT - 1)
    if slow is None or hang is None or (1, 0) not in w.start_ns:
        raise RuntimeError(f"alerts or steps missing for {job}: slow={slow} hang={hang}")
    return {"hang_alert_after_last_step_s": (hang.opened_ns - w.last_end_ns[3]) / 1e9,
            "slow_alert_after_first_step_s": (slow.opened_ns - w.start_ns[(1, 0)]) / 1e9,
            "slow_alert_at_step": float(slow.step),
            "median_step_ms": statistics.median(w.step_ns) / 1e6,
            # hang alerts before the planted one (e.g. every rank stalled while the slow-rank alert's
            # trace window started its profiler)
            "other_hang_alerts": float(sum(1 for a in w.alerts if a.kind == "hang" and a.status == "open"
                                           and a.alert_id != hang.alert_id)),
            "hang_threshold_s": float(hang.details["threshold_s"])}


def _onset(settings: Any, alerts: Any, steps: Any) -> dict[str, float]:
    job = f"bench-onset-{uuid.uuid4().hex[:6]}"
    w = Watch(job, alerts, steps)
    proc = torchrun(settings, job, "--steps", "100000", "--slow-rank", "2", "--slow-factor", "1.5",
                    "--slow-from-step", str(ONSET_STEP))
    try:
        w.until(lambda: w.first("slow_rank") is not None and (2, ONSET_STEP) in w.start_ns, 300)
    finally:
        _stop(proc)
    slow = w.first("slow_rank")
    if slow is None or (2, ONSET_STEP) not in w.start_ns:
        raise RuntimeError(f"no slow-rank alert or onset step for {job}")
    return {"onset_slow_alert_after_onset_s": (slow.opened_ns - w.start_ns[(2, ONSET_STEP)]) / 1e9,
            "onset_slow_alert_rank_ok": float(slow.ranks == [2]),
            "onset_alerts_before_onset": float(sum(1 for a in w.alerts if a.status == "open"
                                                   and a.opened_ns < w.start_ns[(2, ONSET_STEP)]))}


def _crash(settings: Any, alerts: Any, steps: Any) -> dict[str, float]:
    job = f"bench-crash-{uuid.uuid4().hex[:6]}"
    w = Watch(job, alerts, steps)
    proc = torchrun(settings, job, "--steps", "100000", "--fail-rank", "2", "--fail-at-step", str(FAIL_AT))
    try:
        w.until(lambda: w.first("rank_failed") is not None and 2 in w.exit_ns, 300)
    finally:
        _stop(proc)
    failed = w.first("rank_failed")
    if failed is None or 2 not in w.exit_ns:
        raise RuntimeError(f"no rank_failed alert or exit record of rank 2 for {job}")
    return {"crash_alert_after_exception_s": (failed.opened_ns - w.exit_ns[2]) / 1e9,
            "crash_alert_rank_and_step_ok": float(failed.ranks == [2] and failed.step == FAIL_AT),
            "crash_alerts_naming_a_follower": float(sum(1 for a in w.alerts if a.kind == "rank_failed"
                                                        and a.ranks != [2]))}


def _ddp_attach(settings: Any, alerts: Any, steps: Any) -> dict[str, float]:
    job = f"bench-attach-{uuid.uuid4().hex[:6]}"
    w = Watch(job, alerts, steps)
    cmd = [sys.executable, "-m", "rankscope", "run", "--job-id", job, "--", sys.executable, "-m",
           "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), str(PLAIN_DDP), "--steps", "100000", "--slow-rank", "1", "--slow-factor", "4"]
    proc = subprocess.Popen(cmd, env=env_for(settings), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)

    def first_step(rank: int) -> int | None:
        return min((a for (r, _), a in w.start_ns.items() if r == rank), default=None)

    try:
        w.until(lambda: w.first("slow_rank") is not None and first_step(1) is not None, 300)
    finally:
        _stop(proc)
    slow, start = w.first("slow_rank"), first_step(1)
    if slow is None or start is None:
        raise RuntimeError(f"no slow-rank alert or steps of rank 1 for {job}")
    return {"ddp_attach_slow_alert_after_first_step_s": (slow.opened_ns - start) / 1e9,
            "ddp_attach_slow_alert_rank_ok": float(slow.ranks == [1]),
            "ddp_attach_slow_alert_at_step": float(slow.step)}


def _healthy(settings: Any, alerts: Any, steps: Any, scan_s: float) -> dict[str, float]:
    job = f"bench-healthy-{uuid.uuid4().hex[:6]}"
    w = Watch(job, alerts, steps)
    proc = torchrun(settings, job, "--steps", str(HEALTHY_STEPS), "--min-seconds", str(HEALTHY_MIN_S))
    try:
        w.until(lambda: proc.poll() is not None, 900)
    finally:
        _stop(proc)
    end = time.monotonic() + 10 * scan_s + 5     # the processors' scans after the last exit record
    w.until(lambda: time.monotonic() > end, 60)
    first = min((a for (r, s), a in w.start_ns.items() if s == 0), default=0)
    last = max(w.last_end_ns.values(), default=0)
    return {"healthy_false_alerts": float(sum(1 for a in w.alerts if a.status == "open")),
            "healthy_steps": float(max((s for _, s in w.start_ns), default=-1) + 1),
            "healthy_job_s": (last - first) / 1e9, "healthy_exit_code": float(proc.returncode)}


def run() -> dict[str, Any]:
    with local_stack() as settings:
        def consumer(topic: Topic) -> Consumer:
            c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
                          "auto.offset.reset": "earliest"})
            c.subscribe([topic.name_for(settings)])
            return c

        alerts, steps = consumer(Topic.ALERTS), consumer(Topic.STEPS)
        runs = [_slow_and_hang(settings, alerts, steps) for _ in range(REPEATS)]
        onset = _onset(settings, alerts, steps)
        crash = _crash(settings, alerts, steps)
        ddp_attach = _ddp_attach(settings, alerts, steps)
        healthy = _healthy(settings, alerts, steps, settings.scan_interval_s)
        alerts.close()
        steps.close()
    metrics: dict[str, float] = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
    metrics.update({k: round(v, 3) for k, v in {**onset, **crash, **ddp_attach, **healthy}.items()})
    return {"name": "detection", "runs": runs, "onset": onset, "crash": crash, "ddp_attach": ddp_attach,
            "healthy": healthy, "metrics": metrics,
            "settings": {"hang_min_s": settings.hang_min_s, "hang_factor": settings.hang_factor,
                         "straggler_persist": settings.straggler_persist, "straggler_min_s": settings.straggler_min_s,
                         "straggler_min_slow_steps": settings.straggler_min_slow_steps,
                         "straggler_cost_gate": settings.straggler_cost_gate, "scan_interval_s": settings.scan_interval_s},
            "targets": {"hang_alert_after_last_step_s": "hang_min_s + scan (~11 s at defaults)",
                        "slow_alert_after_first_step_s": "<= 30 s",
                        "onset_slow_alert_after_onset_s": "<= 30 s",
                        "onset_alerts_before_onset": "0",
                        "crash_alert_after_exception_s": "grace (3 s) + one scan",
                        "crash_alerts_naming_a_follower": "0",
                        "ddp_attach_slow_alert_after_first_step_s": "<= 30 s",
                        "other_hang_alerts": "0",
                        "healthy_false_alerts": "0",
                        "healthy_steps": ">= 1,500", "healthy_job_s": ">= 30 s"}}
