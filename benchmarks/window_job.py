"""Trace-window overhead on a CPU DDP job (run under torchrun; rank 0 writes the result JSON).

Every rank trains the same DDP MLP as ``rankscope.demo.train --ddp`` with the always-on tracer,
and times, alternating (ABC, BCA, CAB, ...):

- ``none``: ``WINDOW + TRAIL`` steps, no profiler;
- ``bare``: a bare torch.profiler (same activities, ``with_stack``, a RECORD schedule, ``step()``
  per step) around ``WINDOW`` steps, ``stop()`` and ``events()`` taken, then ``TRAIL`` more steps;
- ``rankscope``: a rankscope window of ``WINDOW`` steps opened through the tracer's window
  controller (what a control message does), then ``TRAIL`` more steps while the window is converted,
  summarised, chunked and produced to the real broker on the tracer's sender thread, plus any wait
  until it is shipped.

Before every run a (untimed) ``gc.collect()`` clears the garbage of the run before; each mode frees
its own profiler results inside its timing (bare: dropped at once; rankscope: on its sender thread).

Reported (rank 0): the median over repeats of the per-repeat ratio rankscope/bare (runs of one
repeat are adjacent in time, so slow drifts of a shared host cancel), the ratio of the medians, and
where the time goes: per mode the median window phase (start to the stop of the profiler, with
``events()`` and the free for bare), the first step after the window (when rankscope's sender
converts it), the rest of the trail (when it is produced); and with ``--broker-pid`` the broker's
CPU per run (on this host it shares the cores with the ranks; in production it runs elsewhere).

DDP keeps the ranks in lockstep, so every rank profiles the same steps. ``--wait-ms`` adds a wait
with the GIL released to every step (a GPU job's CPU thread spends much of a step waiting on its
stream), so the machine's cores are not all busy training.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._stack import cpu_s
from rankscope import Tracer
from rankscope.demo.train import ddp_mlp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--window", type=int, default=5, help="steps in each window")
    p.add_argument("--trail", type=int, default=20, help="training steps timed after each window")
    p.add_argument("--size", type=int, default=192)
    p.add_argument("--wait-ms", type=float, default=0.0,
                   help="each step also waits this long with the GIL released, as a GPU job waits on its stream")
    p.add_argument("--broker-pid", type=int, default=0, help="measure this process's CPU per run (the local broker)")
    p.add_argument("--result-file", required=True)
    return p.parse_args(argv)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (0 or gone: 0)."""
    try:
        return cpu_s(pid) if pid else 0.0
    except OSError:
        return 0.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from torch.profiler import ProfilerAction, ProfilerActivity, profile

    torch.manual_seed(rank)
    model, opt = ddp_mlp(args.size)
    x = torch.randn(args.size, args.size)
    tracer = Tracer()
    wait_s = args.wait_ms / 1e3
    tracer.watch_ddp(model)

    def train_step() -> None:
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if wait_s:
            time.sleep(wait_s)
        tracer.step()

    phases: dict[str, list[list[float]]] = {"bare": [], "rankscope": []}   # [window, 1st trail step, rest, wait]

    def run_none() -> float:
        t0 = time.perf_counter()
        for _ in range(args.window + args.trail):
            train_step()
        return time.perf_counter() - t0

    def run_bare() -> float:
        t0 = time.perf_counter()
        prof = profile(activities=[ProfilerActivity.CPU], with_stack=True, schedule=lambda s: ProfilerAction.RECORD)
        prof.start()
        for i in range(args.window):
            train_step()
            if i < args.window - 1:
                prof.step()
        prof.stop()
        prof.profiler.kineto_results.events()  # what any consumer of the window must at least do
        prof.profiler.kineto_results = None    # done with the window: its results are freed here, timed
        del prof                               # (rankscope frees them on its sender thread)
        t1 = time.perf_counter()
        train_step()
        t1b = time.perf_counter()
        for _ in range(args.trail - 1):
            train_step()
        t2 = time.perf_counter()
        phases["bare"].append([t1 - t0, t1b - t1, t2 - t1b, 0.0])
        return t2 - t0

    windows = tracer.windows
    ship: list[tuple[float, float]] = []
    stages: list[dict[str, float]] = []

    def run_rankscope(k: int) -> float:
        done = windows.windows_done
        t0 = time.perf_counter()
        windows.handle("trace", f"bench{k}", {"steps": args.window, "lead_ns": 0}, None, time.time_ns())
        tracer.step()               # the step boundary at which the window opens
        for _ in range(args.window):
            train_step()
        t1 = time.perf_counter()
        train_step()
        t1b = time.perf_counter()
        for _ in range(args.trail - 1):
            train_step()
        t2 = time.perf_counter()
        windows.drain(60)           # shipped: conversion and producing are included
        elapsed = time.perf_counter() - t0
        phases["rankscope"].append([t1 - t0, t1b - t1, t2 - t1b, t0 + elapsed - t2])
        ship.append(windows.last_ship_s)
        stages.append(windows.last_ship_cpu_stages)
        if windows.windows_done != done + 1:
            raise RuntimeError(f"window bench{k} was not shipped")
        return elapsed

    for _ in range(10):
        train_step()
    runs: dict[str, list[float]] = {"none": [], "bare": [], "rankscope": []}
    broker_s: dict[str, list[float]] = {"none": [], "bare": [], "rankscope": []}
    modes = ["none", "bare", "rankscope"]
    for k in range(args.repeats):
        for m in modes[k % 3:] + modes[:k % 3]:
            gc.collect()            # untimed: no run pays for the garbage of the one before
            b0 = _cpu_s(args.broker_pid)
            runs[m].append(run_none() if m == "none" else run_bare() if m == "bare" else run_rankscope(k))
            time.sleep(0.05)        # untimed: what the broker does with this run's messages counts for it
            broker_s[m].append(_cpu_s(args.broker_pid) - b0)
    tracer.close()
    if rank == 0:
        med = {m: statistics.median(v) for m, v in runs.items()}
        out: dict[str, Any] = {"runs_s": runs, "median_s": med, "window_steps": args.window,
                               "trail_steps": args.trail,
                               "window_ratio": statistics.median(r / b for r, b in zip(runs["rankscope"], runs["bare"],
                                                                                       strict=True)),
                               "window_ratio_of_medians": med["rankscope"] / med["bare"],
                               "bare_vs_none": med["bare"] / med["none"],
                               "median_phases_s": {m: [statistics.median(p[i] for p in v) for i in range(4)]
                                                   for m, v in phases.items()},
                               "broker_cpu_s_per_run": {m: statistics.fmean(v) for m, v in broker_s.items()}
                               if args.broker_pid else None,
                               "median_ship_wall_s": statistics.median(w for w, _ in ship),
                               "median_ship_cpu_s": statistics.median(c for _, c in ship),
                               "median_ship_cpu_stages_s": {k: statistics.median(d[k] for d in stages)
                                                            for k in stages[0]},
                               "native_reader": windows.native_reader}
        with open(args.result_file, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
