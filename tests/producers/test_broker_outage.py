"""The broker goes away in the middle of a run: training neither crashes nor stalls, telemetry resumes."""

from __future__ import annotations

import statistics
import subprocess
import sys
import uuid
from pathlib import Path

import msgpack
import pytest

from rankscope.cli.stack.admin import ensure_topics
from rankscope.cli.stack.broker import LocalBroker
from rankscope.config import Settings
from rankscope.topics import Topic
from tests.integration.helpers import TopicReader, child_env, free_port, wait_until

pytestmark = [pytest.mark.kafka]

TRAIN = r"""
import sys, time, pathlib
from rankscope import Tracer
stop = pathlib.Path(sys.argv[1])
tracer = Tracer()
i = 0
while not stop.exists():
    x = sum(j * j for j in range(20000))   # ~1-2 ms of work
    tracer.step()
    print(i, time.monotonic(), flush=True)
    i += 1
tracer.close()
print("done", tracer.dropped, flush=True)
"""


def read_steps(path: Path) -> list[tuple[int, float]]:
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            out.append((int(parts[0]), float(parts[1])))
    return out


def test_broker_outage_does_not_stall_training(tmp_path: Path) -> None:
    settings = Settings.from_env(data_dir=str(tmp_path / "data"), kafka_port=free_port(),
                                 kafka_controller_port=free_port(), topic_prefix=f"o{uuid.uuid4().hex[:6]}.",
                                 bootstrap_servers="")
    broker = LocalBroker(settings)
    broker.start(timeout_s=120)
    ensure_topics(settings, timeout_s=60)
    out, stop = tmp_path / "train.out", tmp_path / "stop"
    job = f"outage-{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen([sys.executable, "-c", TRAIN, str(stop)], stdout=open(out, "w"),
                            stderr=open(tmp_path / "train.err", "w"),
                            env=child_env(settings, RANKSCOPE_JOB_ID=job, RANKSCOPE_FLUSH_TIMEOUT_S="10"))
    try:
        wait_until(lambda: len(read_steps(out)) > 300, 120, "300 steps before the outage")
        broker.stop()
        down_at = read_steps(out)[-1][0]
        wait_until(lambda: read_steps(out)[-1][0] > down_at + 1000, 120, "1000 steps while the broker is down")
        assert proc.poll() is None, "training died while the broker was down"
        broker.start(timeout_s=120)
        up_at = read_steps(out)[-1][0]
        wait_until(lambda: read_steps(out)[-1][0] > up_at + 300, 120, "300 steps after the broker returned")
        stop.touch()
        assert proc.wait(60) == 0, (tmp_path / "train.err").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()

    # Training never stalled: the longest gap between steps during the outage stays within the same
    # order as the ordinary gaps (generous bound, relative to this run's own median).
    steps = read_steps(out)
    gaps = [b[1] - a[1] for a, b in zip(steps, steps[1:], strict=False)]
    outage_gaps = [g for (s, _), g in zip(steps[1:], gaps, strict=False) if down_at <= s <= up_at]
    assert max(outage_gaps) < max(0.5, 200 * statistics.median(gaps)), (max(outage_gaps), statistics.median(gaps))

    # Telemetry resumed: step records sent after the broker came back arrive, up to the exit record.
    reader = TopicReader(settings, Topic.STEPS)

    def seen() -> tuple[int, bool]:
        reader.poll(1.0)
        last, exited = -1, False
        for v in reader.values:
            m = msgpack.unpackb(v)
            if m["job"] != job:
                continue
            if m["kind"] in ("steps", "beat") and m["body"]["step"]:
                last = max(last, max(m["body"]["step"]))
            exited |= m["kind"] == "exit"
        return last, exited

    last, exited = wait_until(lambda: (lambda r: r if r[0] > up_at + 200 and r[1] else None)(seen()), 120,
                              "step records from after the outage and the exit record")
    assert exited and last > up_at + 200
    reader.close()
    broker.stop()
