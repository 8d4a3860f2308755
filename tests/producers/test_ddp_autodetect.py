"""The tracer finds DDP models by itself (made before or after it) on a real one-process gloo group."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rankscope.cli.stack.ports import free_port
from rankscope.config import Settings
from rankscope.producers.collectives import CommTimer
from rankscope.producers.ddp import DdpWatcher
from rankscope.producers.tracer import Tracer
from rankscope.protocol.envelope import decode


class Recording:
    dropped = 0

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, _topic: str, _key: bytes, value: bytes) -> bool:
        self.sent.append(value)
        return True

    def close(self, timeout_s: float) -> None:
        pass


@pytest.fixture
def gloo_group() -> Iterator[None]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def ddp_model() -> torch.nn.Module:
    return torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))


def tracer(**kw: Any) -> tuple[Tracer, Recording]:
    t = Recording()
    return Tracer(Settings(job_id="j", hw_sample_s=0, control_enabled=False, heartbeat_s=60, **kw), transport=t,
                  install_collective_timing=False, handle_signals=False), t


def backward(model: torch.nn.Module) -> None:
    model(torch.randn(4, 8)).sum().backward()


def grad_hooks(model: torch.nn.Module) -> int:
    first = next(p for p in model.parameters() if p.requires_grad)
    return len(getattr(first, "_post_accumulate_grad_hooks", None) or {})


def test_a_model_made_before_the_tracer_is_found(gloo_group: None) -> None:
    model = ddp_model()
    tr, _ = tracer()
    assert tr._ddp.watched == 1
    backward(model)
    assert tr._comm.ddp_ready_ns > 0
    tr.close()


def test_a_model_made_after_the_tracer_is_found(gloo_group: None) -> None:
    tr, _ = tracer()
    assert tr._ddp.watched == 0
    model = ddp_model()
    assert tr._ddp.watched == 1
    backward(model)
    assert tr._comm.ddp_ready_ns > 0
    tr.close()


def test_watch_ddp_on_a_found_model_adds_no_second_hook(gloo_group: None) -> None:
    before = ddp_model()
    tr, _ = tracer()
    after = ddp_model()
    assert grad_hooks(before) == grad_hooks(after) == 1
    tr.watch_ddp(before)
    tr.watch_ddp(after)
    tr.watch_ddp(after)
    assert grad_hooks(before) == grad_hooks(after) == 1
    assert tr._ddp.watched == 2
    tr.close()
    assert grad_hooks(before) == grad_hooks(after) == 0     # the models outlive the tracer without its hooks
    tr._comm.ddp_ready_ns = 0
    backward(after)
    assert tr._comm.ddp_ready_ns == 0


def test_two_tracers_mark_each_model_once_each_and_a_closed_one_stops(gloo_group: None) -> None:
    a, _ = tracer()
    b, _ = tracer()
    model = ddp_model()
    assert grad_hooks(model) == 2
    a.close()
    assert grad_hooks(model) == 1
    backward(model)
    assert b._comm.ddp_ready_ns > 0 and a._comm.ddp_ready_ns == 0
    b.close()


def test_autodetect_off_leaves_models_to_watch_ddp(gloo_group: None) -> None:
    tr, _ = tracer(ddp_autodetect=False)
    model = ddp_model()
    assert grad_hooks(model) == 0
    tr.watch_ddp(model)
    assert grad_hooks(model) == 1
    tr.close()


def test_busy_time_ends_at_the_last_gradient(gloo_group: None) -> None:
    """The time after this rank's backward (waiting for peers, the optimizer) is not busy time."""
    model = ddp_model()
    tr, t = tracer()
    tr.step()
    backward(model)
    time.sleep(0.05)   # stands for the wait in DDP's all-reduce
    tr.step()
    tr.close()
    beats = [m for m in map(decode, t.sent) if m.kind == "beat"]
    comm = [c for m in beats for c in m.body["comm_ns"]]
    dur = [e - s for m in beats for s, e in zip(m.body["start_ns"], m.body["end_ns"], strict=True)]
    assert len(comm) == 2
    assert comm[1] >= 50_000_000 and comm[1] <= dur[1]


def test_watcher_ignores_a_model_without_trainable_parameters(gloo_group: None) -> None:
    w = DdpWatcher(CommTimer())
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    assert w.watch(frozen) is False
    w.close()


def test_a_stack_stopped_in_backward_after_the_last_gradient_shows_the_reducer_wait() -> None:
    from rankscope.producers.ddp import REDUCER_WAIT_FRAME, mark_reducer_wait
    from rankscope.stream_processors.stacks import waiting_in_collective

    in_backward = [f"train.py:{i} main" for i in range(47)] + ["torch/autograd/graph.py:829 _engine_run_backward"]
    elsewhere = ["train.py:10 main", "train.py:20 __getitem__"]
    stacks = [{"thread": "MainThread", "frames": list(in_backward)}, {"thread": "loader", "frames": list(elsewhere)}]
    assert not waiting_in_collective(in_backward)
    mark_reducer_wait(stacks, 48)
    assert stacks[0]["frames"][-2:] == [in_backward[-1], REDUCER_WAIT_FRAME] and len(stacks[0]["frames"]) == 48
    assert waiting_in_collective(stacks[0]["frames"])
    assert stacks[1]["frames"] == elsewhere
