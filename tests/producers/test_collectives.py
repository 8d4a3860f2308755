"""Collective timing on a real one-process gloo group (no broker needed)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from rankscope.cli.stack.ports import free_port
from rankscope.producers.collectives import CommTimer, install, register_ddp_hook, uninstall


@pytest.fixture
def gloo_group() -> Iterator[None]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_hook_marks_the_last_gradient_ready(gloo_group: None) -> None:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
    timer = CommTimer()
    handle = register_ddp_hook(model, timer)
    model(torch.randn(4, 8)).sum().backward()
    first = timer.ddp_ready_ns
    assert first > 0
    model(torch.randn(4, 8)).sum().backward()
    assert timer.ddp_ready_ns > first            # once per backward pass
    handle.remove()


def test_ddp_hook_leaves_the_comm_hook_to_the_user(gloo_group: None) -> None:
    """The mark is not a DDP comm hook: a comm hook's all-reduce future runs a Python callback on
    gloo's worker thread, a fresh Python thread state per bucket, and torch.profiler's with_stack stop
    crashed the rank on one that was half made. The user's own comm hook still installs."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    timer = CommTimer()
    register_ddp_hook(model, timer)
    assert not getattr(model, "_comm_hooks", [])
    model.register_comm_hook(None, default_hooks.allreduce_hook)   # raised before: one comm hook per model
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


def test_tracer_removes_its_ddp_hook_at_close(gloo_group: None) -> None:
    from rankscope.config import Settings
    from rankscope.producers.tracer import Tracer

    class Sink:
        dropped = 0

        def send(self, *_a: object) -> bool:
            return True

        def close(self, timeout_s: float) -> None:
            pass

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    tracer = Tracer(Settings(job_id="j", hw_sample_s=0, control_enabled=False), transport=Sink(),
                    install_collective_timing=False, handle_signals=False)
    tracer.watch_ddp(model)
    model(torch.randn(4, 8)).sum().backward()
    assert tracer._comm.ddp_ready_ns > 0
    tracer.close()
    tracer._comm.ddp_ready_ns = 0
    model(torch.randn(4, 8)).sum().backward()
    assert tracer._comm.ddp_ready_ns == 0       # the model outlives the tracer without its hook
