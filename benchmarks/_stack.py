"""A throw-away local stack (broker + processors) for benchmarks."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator

from rankscope.cli.stack.admin import ensure_topics
from rankscope.cli.stack.broker import LocalBroker
from rankscope.cli.stack.ports import free_port
from rankscope.config import Settings

# Produce requests that warm the co-located broker before timed runs (measured: its CPU per request
# falls from ~1.5 ms to 0.1-0.3 ms over the first ~15,000).
WARMUP_REQUESTS = 16000
WARMUP_WINDOW_TRAFFIC_S = 45.0


@contextlib.contextmanager
def local_stack(processors: bool = True, bootstrap: str = "") -> Iterator[Settings]:
    """A throw-away broker (or, with ``bootstrap``, that broker), fresh topics and optionally a
    processors worker; yields their settings."""
    data = tempfile.mkdtemp(prefix="rankscope-bench-")
    settings = Settings.from_env(data_dir=data, kafka_port=free_port(), kafka_controller_port=free_port(),
                                 topic_prefix=f"b{uuid.uuid4().hex[:6]}.", bootstrap_servers=bootstrap,
                                 clickhouse_dsn="")
    broker = None if bootstrap else LocalBroker(settings)
    if broker is not None:
        broker.start(timeout_s=120)
    ensure_topics(settings, timeout_s=60)
    proc = None
    if processors:
        proc = subprocess.Popen([sys.executable, "-m", "rankscope", "processors"], env=env_for(settings),
                                stdout=open(f"{data}/processors.log", "wb"), stderr=subprocess.STDOUT)
    try:
        yield settings
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        if broker is not None:
            broker.stop()


def warm_broker(settings: Settings, requests: int = WARMUP_REQUESTS, sample: int = 1000,
                window_traffic_s: float = WARMUP_WINDOW_TRAFFIC_S) -> dict[str, float]:
    """Send ``requests`` produce requests (one 20 KB zstd message each, flushed one at a time, over
    a scratch topic's partitions) so the co-located broker's JVM has compiled its produce path, as a
    long-running broker has: cold, the first ones cost it ~1.5 ms of CPU each, warm ~0.1-0.3 ms;
    then ``window_traffic_s`` of trace-window-shaped traffic. Returns the broker's CPU ms per request
    over the first and the last ``sample`` requests, and per window at the start and end of the
    window traffic."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import NewTopic

    from rankscope.cli.stack.admin import admin_client

    pid = LocalBroker(settings).pid()
    if pid is None:
        raise RuntimeError("warm_broker: no local broker is running")
    topic = f"{settings.topic_prefix}bench-warmup"
    partitions = 4
    admin = admin_client(settings.bootstrap)   # kept alive until its futures are done
    for fut in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        fut.result(30)
    producer = Producer({"bootstrap.servers": settings.bootstrap, "linger.ms": 0, "compression.type": "zstd"})
    payload = bytes(range(256)) * 8 + b"x" * 18000
    cost: list[float] = []
    c0 = cpu_s(pid)
    for i in range(requests):
        producer.produce(topic, payload, partition=i % partitions)
        producer.flush(30)
        if (i + 1) % sample == 0:
            c1 = cpu_s(pid)
            cost.append(1e3 * (c1 - c0) / sample)
            c0 = c1
    out = {"broker_cold_cpu_ms_per_request": cost[0], "broker_warm_cpu_ms_per_request": cost[-1],
           "broker_warmup_requests": requests}
    out.update(_window_shaped_traffic(settings, pid, topic, window_traffic_s))
    return out


def _window_shaped_traffic(settings: Settings, pid: int, topic: str, seconds: float) -> dict[str, float]:
    """Two ranks' trace-window messages (an ack, a ~200 KB chunk, a ~20 KB summary and an ack each,
    zstd), ten windows a second for ``seconds``: after the single-message requests above, the
    broker's CPU per window of this shape still fell from 10-18 ms to 3.5-4.5 ms over ~45 s (measured);
    a long-running broker is past that. Returns its CPU ms per window over the first and last 5 s."""
    import os
    import time

    from confluent_kafka import Producer

    producers = [Producer({"bootstrap.servers": settings.bootstrap, "linger.ms": 50, "compression.type": "zstd"})
                 for _ in range(2)]
    chunk = os.urandom(40_000) + b"abcd" * 40_000      # compresses ~3x, as a window's chunk does
    summary = os.urandom(7_000) + b"x" * 13_000
    ack = b"a" * 200

    def window() -> None:
        for rank, p in enumerate(producers):
            p.produce(topic, ack, partition=3)
            p.produce(topic, chunk, partition=rank)
            p.produce(topic, summary, partition=2)
            p.produce(topic, ack, partition=3)
        for p in producers:
            p.flush(30)

    def cost_over(span_s: float) -> float:
        c0, t0, n = cpu_s(pid), time.monotonic(), 0
        while time.monotonic() - t0 < span_s:
            window()
            n += 1
            time.sleep(0.1)
        return 1e3 * (cpu_s(pid) - c0) / max(n, 1)

    first = cost_over(5.0)
    cost_over(max(0.0, seconds - 10.0))
    last = cost_over(5.0)
    return {"broker_first_windows_cpu_ms": first, "broker_warm_windows_cpu_ms": last,
            "broker_window_traffic_s": seconds}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, from /proc."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def env_for(settings: Settings, **extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env.update(settings.to_env())
    env.update(extra)
    return env


def torchrun(settings: Settings, job: str, *args: str, nproc: int = 4, log: str = "/dev/null",
             module: str = "rankscope.demo.train") -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", module, *args]
    return subprocess.Popen(cmd, env=env_for(settings, RANKSCOPE_JOB_ID=job), stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
