"""Fault injection: every planted fault, on CPU and on a modelled GPU, several times; recall,
precision and time to alert per fault.

Each run is a real 4-rank torchrun job under ``rankscope run`` (unmodified scripts, no Tracer),
against one local broker and processors worker:
- CPU: tests/integration/scripts/plain_ddp.py, gloo DDP; collectives block the training thread;
- modelled GPU: tests/integration/scripts/modelled_gpu.py; each rank's device work and its
  all-reduces run on a stream thread and the training thread syncs once per step, as with NCCL.

A run ends when an alert of an expected kind names exactly the planted ranks (a hit), or after
``DEADLINE_S``. An alert is *correct* when its kind is one the fault explains (a SIGKILLed rank may
be named by ``rank_failed``, ``dead_rank`` or the hang its peers are in) and it names exactly the
planted ranks; every other opened alert is *false*. Recall = hits / runs; precision = correct /
all opened alerts; time to alert = the hit's ``opened_ns`` minus the fault's start, from the ranks'
own records: the job's first step (a slow rank from the start), the slow rank's first slow step
(from mid-run), the culprit's last step end (hangs), its exit record (a raised exception), its last
message (SIGKILL), the start of the mismatched step. Healthy runs (>= 1,500 steps and 30 s) count
false alerts only.

``python -m benchmarks.detection [--repeats 3] [--platforms cpu,gpu] [--faults slow_compute,...]``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
from confluent_kafka import Consumer

from benchmarks._stack import env_for, free_port, local_stack
from rankscope.consuming import one_off_group, open_consumer
from rankscope.protocol.alerts import Alert
from rankscope.topics import Topic

SCRIPTS = Path(__file__).resolve().parents[1] / "tests" / "integration" / "scripts"
REPEATS = 3
DEADLINE_S = 240.0
ONSET = 400            # a slow rank from mid-run: its first slow step
AT = 300               # other faults: the step they happen at
KILL_AT = 50


@dataclass(frozen=True)
class Fault:
    name: str
    args: tuple[str, ...]
    ranks: tuple[int, ...]           # the ranks an alert must name
    kinds: frozenset[str]            # the alert kinds that explain the fault
    start: str                       # what the time to alert is measured from (Watch.start_ns)
    rank: int = -1                   # the rank whose records give the start


SLOW = frozenset({"slow_rank", "abnormal_worker"})
FAULTS: dict[str, dict[str, Fault]] = {
    "cpu": {f.name: f for f in [
        Fault("slow_compute", ("--slow-rank", "1", "--slow-factor", "4"), (1,), SLOW, "first_step"),
        Fault("slow_data", ("--slow-data-rank", "2", "--slow-data-s", "0.03"), (2,), SLOW, "first_step"),
        Fault("slow_from_mid_run", ("--slow-rank", "1", "--slow-factor", "3", "--slow-from-step", str(ONSET)), (1,),
              SLOW, "step", 1),
        Fault("host_hang", ("--hang-rank", "2", "--hang-at-index", str(32 * AT)), (2,), frozenset({"hang"}),
              "last_step", 2),
        Fault("exception", ("--crash-rank", "1", "--crash-at-step", str(AT)), (1,),
              frozenset({"rank_failed", "hang"}), "exit", 1),
        Fault("sigkill", ("--kill-rank", "3", "--kill-at-step", str(KILL_AT)), (3,),
              frozenset({"rank_failed", "dead_rank", "hang"}), "last_message", 3),
    ]},
    "gpu": {f.name: f for f in [
        Fault("slow_device", ("--slow-device-rank", "2", "--slow-factor", "4"), (2,), SLOW, "first_step"),
        Fault("slow_data", ("--slow-data-rank", "1", "--slow-data-s", "0.03"), (1,), SLOW, "first_step"),
        Fault("slow_from_mid_run", ("--slow-device-rank", "2", "--slow-factor", "3", "--slow-from-step", str(ONSET)),
              (2,), SLOW, "step", 2),
        Fault("device_hang", ("--stop-device-rank", "1", "--stop-at-step", str(AT)), (1,), frozenset({"hang"}),
              "last_step", 1),
        Fault("host_hang", ("--hang-rank", "3", "--hang-at-step", str(AT)), (3,), frozenset({"hang"}),
              "last_step", 3),
        Fault("mismatch", ("--mismatch-rank", "3", "--mismatch-at-step", str(AT)), (3,),
              frozenset({"collective_mismatch"}), "step", 3),
        Fault("exception", ("--crash-rank", "1", "--crash-at-step", str(AT)), (1,),
              frozenset({"rank_failed", "hang"}), "exit", 1),
        Fault("sigkill", ("--kill-rank", "3", "--kill-at-step", str(KILL_AT)), (3,),
              frozenset({"rank_failed", "dead_rank", "hang"}), "last_message", 3),
    ]},
}
HEALTHY = Fault("healthy", ("--steps", "1501", "--min-seconds", "31"), (), frozenset(), "")
SCRIPT = {"cpu": SCRIPTS / "plain_ddp.py", "gpu": SCRIPTS / "modelled_gpu.py"}


class Watch:
    """The alerts and the ranks' records of one job, read as they come."""

    def __init__(self, job: str, alerts: Any, steps: Any) -> None:
        self.job, self.alerts_c, self.steps_c = job, alerts, steps
        self.alerts: list[Alert] = []
        self.step_start_ns: dict[tuple[int, int], int] = {}
        self.last_end_ns: dict[int, int] = {}
        self.last_sent_ns: dict[int, int] = {}
        self.exit_ns: dict[int, int] = {}

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
            if m.get("job") != self.job:
                continue
            r = m["rank"]
            self.last_sent_ns[r] = max(self.last_sent_ns.get(r, 0), m["sent_ns"])
            if m["kind"] == "exit":
                self.exit_ns.setdefault(r, m["sent_ns"])
            if m["kind"] in ("steps", "beat") and m["body"]["step"]:
                b = m["body"]
                for s, a in zip(b["step"], b["start_ns"], strict=True):
                    self.step_start_ns.setdefault((r, s), a)
                self.last_end_ns[r] = max(self.last_end_ns.get(r, 0), max(b["end_ns"]))

    def opened(self) -> list[Alert]:
        first: dict[str, Alert] = {}
        for a in self.alerts:
            first.setdefault(a.alert_id, a)
        return [a for a in first.values() if a.status == "open"]

    def until(self, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not done():
            self.poll()

    def start_ns(self, fault: Fault) -> int | None:
        if fault.start == "first_step":
            return min(self.step_start_ns.values(), default=None)
        if fault.start == "step":
            step = ONSET if fault.name == "slow_from_mid_run" else AT
            return self.step_start_ns.get((fault.rank, step))
        if fault.start == "last_step":
            return self.last_end_ns.get(fault.rank)
        if fault.start == "exit":
            return self.exit_ns.get(fault.rank)
        if fault.start == "last_message":
            return self.last_sent_ns.get(fault.rank)
        return None


def correct(fault: Fault, a: Alert) -> bool:
    return a.kind in fault.kinds and tuple(sorted(a.ranks)) == fault.ranks


def _run_job(settings: Any, platform: str, fault: Fault, alerts: Any, steps: Any) -> dict[str, Any]:
    job = f"bench-{platform}-{fault.name}-{uuid.uuid4().hex[:6]}"
    w = Watch(job, alerts, steps)
    extra = () if fault is HEALTHY else ("--steps", "100000")
    cmd = [sys.executable, "-m", "rankscope", "run", "--job-id", job, "--", sys.executable, "-m",
           "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), str(SCRIPT[platform]), *extra, *fault.args]
    proc = subprocess.Popen(cmd, env=env_for(settings), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        if fault is HEALTHY:
            w.until(lambda: proc.poll() is not None, 900)
            end = time.monotonic() + 10 * settings.scan_interval_s + 5   # the scans after the last exit record
            w.until(lambda: time.monotonic() > end, 60)
        else:
            w.until(lambda: any(correct(fault, a) for a in w.opened()) and w.start_ns(fault) is not None, DEADLINE_S)
            w.until(lambda: False, 3 * settings.scan_interval_s)          # alerts opened right after the hit
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    opened = w.opened()
    hit = next((a for a in opened if correct(fault, a)), None)
    start = w.start_ns(fault)
    return {"job": job, "hit": hit is not None,
            "time_to_alert_s": round((hit.opened_ns - start) / 1e9, 2) if hit is not None and start else None,
            "correct_alerts": sum(1 for a in opened if correct(fault, a)),
            "false_alerts": [f"{a.kind} {a.ranks}: {a.summary[:160]}" for a in opened if not correct(fault, a)]}


def summarize(platform: str, fault: Fault, runs: list[dict[str, Any]]) -> dict[str, Any]:
    times = [r["time_to_alert_s"] for r in runs if r["time_to_alert_s"] is not None]
    n_correct = sum(r["correct_alerts"] for r in runs)
    n_false = sum(len(r["false_alerts"]) for r in runs)
    return {"platform": platform, "fault": fault.name, "runs": len(runs),
            "recall": None if fault is HEALTHY else round(sum(r["hit"] for r in runs) / len(runs), 3),
            "precision": round(n_correct / (n_correct + n_false), 3) if n_correct + n_false else None,
            "false_alerts": n_false,
            "time_to_alert_median_s": round(statistics.median(times), 2) if times else None,
            "time_to_alert_max_s": max(times) if times else None}


def run(repeats: int = REPEATS, platforms: tuple[str, ...] = ("cpu", "gpu"), faults: tuple[str, ...] = ()) -> dict[str, Any]:
    rows, detail = [], {}
    with local_stack() as settings:
        def consumer(topic: Topic) -> Consumer:
            c = open_consumer(settings, one_off_group("bench"), {"auto.offset.reset": "earliest"})
            c.subscribe([topic.name_for(settings)])
            return c

        alerts, steps = consumer(Topic.ALERTS), consumer(Topic.STEPS)
        for platform in platforms:
            planted = [f for name, f in FAULTS[platform].items() if not faults or name in faults]
            for fault in planted + ([HEALTHY] if not faults or "healthy" in faults else []):
                runs = [_run_job(settings, platform, fault, alerts, steps) for _ in range(repeats)]
                rows.append(summarize(platform, fault, runs))
                detail[f"{platform}/{fault.name}"] = runs
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        alerts.close()
        steps.close()
    metrics = {f"{r['platform']}_{r['fault']}_{k}": r[k] for r in rows
               for k in ("recall", "precision", "time_to_alert_median_s") if r[k] is not None}
    metrics["false_alerts_total"] = sum(r["false_alerts"] for r in rows)
    return {"name": "detection", "table": rows, "runs": detail, "metrics": metrics, "repeats": repeats,
            "settings": {"hang_min_s": settings.hang_min_s, "straggler_min_s": settings.straggler_min_s,
                         "straggler_cost_gate": settings.straggler_cost_gate, "dead_after_s": settings.dead_after_s},
            "targets": {"recall": "1.0 for every fault", "precision": "1.0", "healthy false alerts": "0",
                        "slow ranks": "<= 30 s", "hangs": "hang_min_s + a scan"}}


def markdown(result: dict[str, Any]) -> str:
    """The result as the table in docs/benchmarks.md."""
    lines = ["| platform | fault | runs | recall | precision | false alerts | time to alert median / max |",
             "|---|---|---|---|---|---|---|"]
    for r in result["table"]:
        t = (f"{r['time_to_alert_median_s']:.1f} / {r['time_to_alert_max_s']:.1f} s"
             if r["time_to_alert_median_s"] is not None else "-")
        lines.append(f"| {'CPU (gloo DDP)' if r['platform'] == 'cpu' else 'modelled GPU'} | {r['fault']} | {r['runs']} "
                     f"| {'-' if r['recall'] is None else r['recall']} | {'-' if r['precision'] is None else r['precision']} "
                     f"| {r['false_alerts']} | {t} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.detection", description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--platforms", default="cpu,gpu")
    p.add_argument("--faults", default="", help="comma-separated fault names (default: all, and healthy)")
    p.add_argument("--output", default="benchmarks/results/detection.json")
    args = p.parse_args(argv)
    platforms = tuple(x for x in args.platforms.split(",") if x)
    bad = [x for x in platforms if x not in FAULTS]
    if args.repeats < 1 or bad:
        p.error(f"--repeats must be >= 1 and --platforms a subset of cpu,gpu (got {args.repeats}, {bad})")
    result = run(args.repeats, platforms, tuple(x for x in args.faults.split(",") if x))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
