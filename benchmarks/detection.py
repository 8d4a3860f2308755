"""Detection latency: hang alert after the hanging rank's last step (s), slow-rank alert (steps).

A real 4-rank torchrun job (gloo, CPU): rank 1 does 4x the compute from step 0, rank 3 hangs at
step HANG_AT. Repeated REPEATS times on one broker and processors worker; medians reported.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
import uuid
from typing import Any

import msgpack
from confluent_kafka import Consumer

from benchmarks._stack import local_stack, torchrun
from rankscope.alerts import Alert
from rankscope.topics import Topic

HANG_AT = 250
REPEATS = 2


def _one(settings: Any, consumer: Any, steps_consumer: Any) -> dict[str, float]:
    job = f"bench-{uuid.uuid4().hex[:6]}"
    proc = torchrun(settings, job, "--steps", "100000", "--slow-rank", "1", "--hang-rank", "3",
                    "--hang-at-step", str(HANG_AT))
    slow = hang = None
    last_end_ns = 0
    step_ns: list[int] = []
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and (slow is None or hang is None):
            for msg in consumer.consume(100, 0.2):
                if msg.error():
                    continue
                a = Alert.from_json(msg.value())
                if a.job != job or a.status != "open":
                    continue
                if a.kind == "slow_rank" and slow is None:
                    slow = a
                if a.kind == "hang" and hang is None:
                    hang = a
            for msg in steps_consumer.consume(500, 0.05):
                if msg.error():
                    continue
                m = msgpack.unpackb(msg.value())
                if m["job"] == job and m["kind"] in ("steps", "beat") and m["body"]["step"]:
                    step_ns += [e - s for s, e in zip(m["body"]["start_ns"], m["body"]["end_ns"], strict=True)]
                    if m["rank"] == 3:
                        last_end_ns = max(last_end_ns, max(m["body"]["end_ns"]))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    if slow is None or hang is None:
        raise RuntimeError(f"alerts missing for {job}: slow={slow} hang={hang}")
    return {"hang_alert_after_last_step_s": (hang.opened_ns - last_end_ns) / 1e9,
            "slow_alert_at_step": float(slow.step),
            "slow_alert_after_job_start_s": float(slow.step) * statistics.median(step_ns) / 1e9,
            "median_step_ms": statistics.median(step_ns) / 1e6,
            "hang_threshold_s": float(hang.details["threshold_s"])}


def run() -> dict[str, Any]:
    with local_stack() as settings:
        consumer = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
                             "auto.offset.reset": "earliest"})
        consumer.subscribe([Topic.ALERTS.name_for(settings)])
        steps_consumer = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
                                   "auto.offset.reset": "earliest"})
        steps_consumer.subscribe([Topic.STEPS.name_for(settings)])
        runs = [_one(settings, consumer, steps_consumer) for _ in range(REPEATS)]
        consumer.close()
        steps_consumer.close()
    metrics = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
    return {"name": "detection", "runs": runs, "metrics": metrics,
            "settings": {"hang_min_s": settings.hang_min_s, "hang_factor": settings.hang_factor,
                         "straggler_persist": settings.straggler_persist, "scan_interval_s": settings.scan_interval_s},
            "targets": {"hang_alert_after_last_step_s": "hang_min_s + scan (~11 s at defaults)"}}
