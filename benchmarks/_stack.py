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
