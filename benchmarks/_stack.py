"""A throw-away local stack (broker + processors) for benchmarks."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator

from rankscope.admin import ensure_topics
from rankscope.broker import LocalBroker
from rankscope.config import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

# Produce requests that warm the co-located broker before timed runs (measured: its CPU per request
# falls from ~1.5 ms to 0.1-0.3 ms over the first ~15,000).
WARMUP_REQUESTS = 16000


@contextlib.contextmanager
def local_stack(processors: bool = True) -> Iterator[Settings]:
    data = tempfile.mkdtemp(prefix="rankscope-bench-")
    settings = Settings.from_env(data_dir=data, kafka_port=free_port(), kafka_controller_port=free_port(),
                                 topic_prefix=f"b{uuid.uuid4().hex[:6]}.", bootstrap_servers="", clickhouse_dsn="")
    broker = LocalBroker(settings)
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
        broker.stop()


def warm_broker(settings: Settings, requests: int = WARMUP_REQUESTS, sample: int = 1000) -> dict[str, float]:
    """Send ``requests`` produce requests (one 20 KB zstd message each, flushed one at a time, over
    a scratch topic's partitions) so the co-located broker's JVM has compiled its produce path, as a
    long-running broker has: cold, the first ones cost it ~1.5 ms of CPU each, warm ~0.1-0.3 ms.
    Returns the broker's CPU ms per request over the first and the last ``sample`` requests."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import NewTopic

    from rankscope.admin import admin_client

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
    return {"broker_cold_cpu_ms_per_request": cost[0], "broker_warm_cpu_ms_per_request": cost[-1],
            "broker_warmup_requests": requests}


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
