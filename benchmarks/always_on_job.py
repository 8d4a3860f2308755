"""Always-on tracer overhead inside one CPU DDP job (run under torchrun; rank 0 writes the result JSON).

Every rank trains the DDP MLP of ``rankscope.demo.train --ddp`` and times blocks of ``--steps``
steps, alternating (on, off / off, on, ...) within the same processes, so that the job-to-job noise
of a shared host (placement, memory layout: ±10% between jobs on 2 cores) cancels:

- ``on``: a fresh :class:`rankscope.Tracer` (heartbeats, step records, hardware sampling, the control
  listener, collective timing and ``watch_ddp``'s gradient hook), created and warmed up untimed, then
  ``--steps`` timed steps each ending in ``tracer.step()``; closed untimed after the block;
- ``off``: ``--steps`` timed steps with no tracer in the process (closed tracers leave no threads:
  checked and reported as ``threads_after_close``).

Reported (rank 0): the median over repeats of the per-repeat ratio of mean step times on/off, the
ratio of the medians, the CPU per step of the threads the tracer started (its own and librdkafka's,
each read from its per-thread CPU clock in ns, so scheduling noise does not inflate it), the
process's CPU per step in each mode, and with ``--broker-pid`` the co-located broker's CPU per step
in each mode (in production the broker is on other machines; here it shares the ranks' cores).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.window_job import _cpu_s
from rankscope import Tracer
from rankscope.config import Settings
from rankscope.demo.train import ddp_mlp
from rankscope.producers.collective_log import enable_recorder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--steps", type=int, default=600, help="timed steps per block")
    p.add_argument("--warmup-steps", type=int, default=100, help="untimed steps after a tracer is created")
    p.add_argument("--size", type=int, default=192)
    p.add_argument("--broker-pid", type=int, default=0, help="measure this process's CPU per step (the local broker)")
    p.add_argument("--result-file", required=True)
    return p.parse_args(argv)


def _thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _threads_cpu_s(tids: set[int]) -> float:
    """CPU seconds of these threads of this process, from their per-thread CPU clocks (ns; Linux
    encodes a thread's clock id from its tid). A thread that has ended counts 0."""
    total = 0
    for tid in tids:
        try:
            total += time.clock_gettime_ns(((~tid) << 3) | 6)   # MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)
        except OSError:
            pass
    return total / 1e9


def _last_seq() -> int:
    """The default group's last enqueued collective, from the recorder (0 without one)."""
    import pickle

    from torch._C._distributed_c10d import _dump_fr_trace

    try:
        status = pickle.loads(_dump_fr_trace(includeCollectives=False, includeStackTraces=False,
                                             onlyActive=True)).get("pg_status", {})
        return int(status.get("0", {}).get("last_enqueued_collective", 0))
    except Exception:
        return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # The tracers come after the process group, so the recorder is switched on here, as a tracer made
    # first (or `rankscope run`) does: the "on" blocks then read it, as ranks do.
    enable_recorder(os.environ, Settings.from_env().coll_ring)
    dist.init_process_group("gloo")
    out = measure(args)
    if dist.get_rank() == 0:
        with open(args.result_file, "w") as f:
            json.dump(out, f)
    gc.collect()     # the model's DDP (and its gloo work) was freed on return, while Python is alive
    dist.barrier()
    dist.destroy_process_group()
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(dist.get_rank())
    model, opt = ddp_mlp(args.size)
    x = torch.randn(args.size, args.size)

    def train_step(tracer: Tracer | None) -> None:
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if tracer is not None:
            tracer.step()

    for _ in range(50):
        train_step(None)
    threads_before = len(_thread_ids())
    wall: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    broker: dict[str, list[float]] = {"on": [], "off": []}
    threads_after_close = 0
    own_last: set[int] = set()
    tracer_threads_cpu: list[float] = []     # per "on" block: CPU s per step of the tracer's threads
    reader_cpu: list[float] = []             # ... of which its Flight Recorder reader thread
    sampler_cpu: list[float] = []            # ... and its stack sampler thread
    collectives: list[float] = []            # collectives recorded per step
    for k in range(args.repeats):
        for mode in (("on", "off") if k % 2 == 0 else ("off", "on")):
            gc.collect()
            tracer = None
            own: set[int] = set()
            if mode == "on":
                before = _thread_ids()
                tracer = Tracer(handle_signals=False)
                tracer.watch_ddp(model)
                for _ in range(args.warmup_steps):
                    train_step(tracer)
                own = _thread_ids() - before
            reader = {t.native_id for t in threading.enumerate() if t.name == "rankscope-collectives" and t.native_id}
            sampler = {t.native_id for t in threading.enumerate() if t.name == "rankscope-profile" and t.native_id}
            own0, reader0, sampler0 = _threads_cpu_s(own), _threads_cpu_s(reader), _threads_cpu_s(sampler)
            seq0 = _last_seq()
            b0, c0, t0 = _cpu_s(args.broker_pid), time.process_time(), time.perf_counter()
            for _ in range(args.steps):
                train_step(tracer)
            t1, c1, b1 = time.perf_counter(), time.process_time(), _cpu_s(args.broker_pid)
            if own:
                own_last = own
                tracer_threads_cpu.append((_threads_cpu_s(own) - own0) / args.steps)
                reader_cpu.append((_threads_cpu_s(reader) - reader0) / args.steps)
                sampler_cpu.append((_threads_cpu_s(sampler) - sampler0) / args.steps)
                collectives.append((_last_seq() - seq0) / args.steps)
            wall[mode].append((t1 - t0) / args.steps)
            cpu[mode].append((c1 - c0) / args.steps)
            broker[mode].append((b1 - b0) / args.steps)
            if tracer is not None:
                tracer.close()
                del tracer
                gc.collect()
                time.sleep(0.2)     # librdkafka's threads end after the handle is destroyed
                threads_after_close = max(threads_after_close, len(_thread_ids()))
    med = {m: statistics.median(v) for m, v in wall.items()}
    return {
        "step_s": wall, "median_step_s": med, "steps_per_block": args.steps, "repeats": args.repeats,
        "overhead_ratio": statistics.median(a / b for a, b in zip(wall["on"], wall["off"], strict=True)),
        "overhead_ratio_of_medians": med["on"] / med["off"],
        "cpu_per_step_s": {m: statistics.median(v) for m, v in cpu.items()},
        "tracer_threads": len(own_last), "tracer_threads_cpu_per_step_s": statistics.fmean(tracer_threads_cpu),
        "fr_reader_cpu_per_step_s": statistics.fmean(reader_cpu),
        "profile_sampler_cpu_per_step_s": statistics.fmean(sampler_cpu), "collectives_per_step": statistics.fmean(collectives),
        "broker_cpu_per_step_s": {m: statistics.fmean(v) for m, v in broker.items()} if args.broker_pid else None,
        "threads_before": threads_before, "threads_after_close": threads_after_close}

if __name__ == "__main__":
    sys.exit(main())
