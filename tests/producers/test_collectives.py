"""Collective timing on a real one-process gloo group (no broker needed)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from producers.collectives import CommTimer, install, register_ddp_hook, uninstall


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def gloo_group() -> Iterator[None]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_hook_installs_and_marks_bucket_ready(gloo_group: None) -> None:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    timer = CommTimer()
    register_ddp_hook(model, timer)             # raised before: DDP rejected the hook's annotations
    model(torch.randn(4, 8)).sum().backward()
    assert timer.ddp_ready_ns > 0


def test_all_reduce_time_is_counted(gloo_group: None) -> None:
    timer = CommTimer()
    install(timer)
    try:
        dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(4), async_op=True).wait()
    finally:
        uninstall(timer)
    assert timer.take() > 0
