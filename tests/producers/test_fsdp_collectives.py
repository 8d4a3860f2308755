"""FSDP2 (``fully_shard``) on CPU with gloo: its collectives are timed as waits.

Two spawned ranks train a small model sharded with ``fully_shard``. Rank 1 sleeps before each step,
so rank 0 waits for it in FSDP's all-gather; the timer installed by the tracer must count that wait.
"""

from __future__ import annotations

import os
import queue
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rankscope.cli.stack.ports import free_port
from rankscope.producers.collectives import WRAPPER_MARK, CommTimer, install

STEPS = 3
DELAY_S = 0.5     # rank 1's sleep before each step


def _rank(rank: int, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.fsdp import fully_shard

        timer = CommTimer()
        install(timer)
        called: set[str] = set()
        marked: dict[str, bool] = {}
        for name in ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor"):
            timed = getattr(dist, name)
            marked[name] = bool(getattr(timed, WRAPPER_MARK, False))

            def spy(*a: Any, _fn: Any = timed, _name: str = name, **k: Any) -> Any:
                called.add(_name)
                return _fn(*a, **k)

            setattr(dist, name, spy)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        timer.take()
        for _ in range(STEPS):
            if rank == 1:
                time.sleep(DELAY_S)
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
        out.put((rank, timer.take(), {n: marked[n] for n in sorted(called)}))
    finally:
        dist.destroy_process_group()


def test_fsdp2_collective_waits_are_timed_on_cpu_gloo() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got: dict[int, tuple[int, dict[str, bool]]] = {}
        deadline = time.monotonic() + 240
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                rank, waited_ns, wrapped = out.get(timeout=1.0)
            except queue.Empty:
                assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
                continue
            got[rank] = (waited_ns, wrapped)
        assert sorted(got) == [0, 1], got
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    for _waited, wrapped in got.values():
        # FSDP2 gathers parameters and reduce-scatters gradients through these, each one wrapped.
        assert set(wrapped) >= {"all_gather_single", "reduce_scatter_single"} and all(wrapped.values()), wrapped
    # Rank 0 waits in the all-gather for rank 1, which slept STEPS x DELAY_S before its steps.
    # Rank 1's own waits are not compared: they are rank 0's compute time, which a loaded machine
    # stretches past rank 0's waits.
    assert got[0][0] >= STEPS * DELAY_S * 1e9 / 3, got
