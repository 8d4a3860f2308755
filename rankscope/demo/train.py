"""A small multi-rank training job for demos and tests (torchrun, gloo on CPU).

    torchrun --nproc-per-node 4 -m rankscope.demo.train --steps 300 --slow-rank 1 --hang-rank 3 --hang-at-step 120

One rank can be made slow (``--slow-factor`` x the compute of the others, inside
``slow_extra_compute``) and one can hang at a given step (inside ``hang_forever``), the
way a deadlocked data loader or a stuck kernel would. One can raise at a given step (inside
``load_batch``), the way a CUDA error or a corrupt sample ends a job. One can be starved of CPU
(``--starved-rank``): it is bound to one core and lowered to nice ``--starved-nice``, and
``--neighbours`` busy processes at the usual priority share the core, as a busier neighbour on a
rank's cores would (data-loader workers, another service) take most of it.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import itertools
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from rankscope import Tracer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--min-seconds", type=float, default=0.0,
                   help="go on past --steps until this many seconds have passed (the ranks agree on the last step)")
    p.add_argument("--size", type=int, default=192, help="matrix size of the per-step compute")
    p.add_argument("--matmuls", type=int, default=20, help="matmuls per step on a normal rank")
    p.add_argument("--wait-ms", type=float, default=0.0,
                   help="each step also waits this long after its compute, as a step waits on its device")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=float, default=4.0)
    p.add_argument("--slow-from-step", type=int, default=0)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-at-step", type=int, default=-1)
    p.add_argument("--hang-after-s", type=float, default=0.0,
                   help="the hang rank hangs at its first step this many seconds after its first (0 = off)")
    p.add_argument("--hang-when-file", default="",
                   help="the hang rank hangs at its first step after this file exists (a test plants the hang)")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--starved-rank", type=int, default=-1,
                   help="bind this rank to one core at nice --starved-nice, with --neighbours busy processes on it")
    p.add_argument("--neighbours", type=int, default=1)
    p.add_argument("--starved-nice", type=int, default=10)
    p.add_argument("--ddp", action="store_true", help="train a small MLP under DDP instead of explicit all_reduce")
    args = p.parse_args(argv)
    if args.steps <= 0:
        p.error(f"--steps must be > 0, got {args.steps}")
    if args.wait_ms < 0:
        p.error(f"--wait-ms must be >= 0, got {args.wait_ms}")
    if args.min_seconds < 0:
        p.error(f"--min-seconds must be >= 0, got {args.min_seconds}")
    if args.min_seconds and args.ddp:
        p.error("--min-seconds needs the explicit all_reduce, not --ddp")
    if args.slow_factor < 1:
        p.error(f"--slow-factor must be >= 1, got {args.slow_factor}")
    if args.neighbours < 1 or not 0 <= args.starved_nice <= 19:
        p.error(f"--neighbours must be >= 1 and --starved-nice 0..19, got {args.neighbours} and {args.starved_nice}")
    return args


# A busy process that ends when its parent does (a SIGKILLed rank leaves none behind).
BUSY = "import os\np = os.getppid()\nwhile os.getppid() == p:\n    sum(i * i for i in range(10000))\n"


def share_core_with_neighbours(n: int, nice: int) -> list[subprocess.Popen[bytes]]:
    """Bind this thread to its first allowed core at ``nice`` and start ``n`` busy processes bound to
    it at the usual priority."""
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]
    os.nice(nice)
    for proc in procs:
        os.sched_setaffinity(proc.pid, {core})
    for proc in procs:
        atexit.register(proc.kill)
    print(f"rank starved: bound to core {core} at nice {nice} with {n} busy processes", file=sys.stderr, flush=True)
    return procs


def compute(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = torch.tanh(x @ w)
    return x


def slow_extra_compute(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    return compute(x, w, n)


def hang_forever() -> None:
    while True:
        time.sleep(0.5)


def load_batch(step: int) -> None:
    raise RuntimeError(f"CUDA error: an illegal memory access was encountered (simulated at step {step})")


def ddp_mlp(size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Six ``size``-wide Linear+ReLU layers under DDP (the process group is up) and their SGD; the
    benchmarks' DDP jobs train the same model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(size, size), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*layers))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == args.starved_rank:
        share_core_with_neighbours(args.neighbours, args.starved_nice)
    tracer = Tracer()
    torch.manual_seed(rank)
    x0 = torch.randn(args.size, args.size)
    w = torch.randn(args.size, args.size) / args.size ** 0.5
    extra = int(round(args.matmuls * (args.slow_factor - 1)))
    model = opt = None
    if args.ddp:
        model, opt = ddp_mlp(args.size)
        tracer.watch_ddp(model)
    t_first = time.monotonic()
    done_steps = 0
    for step in itertools.count():
        if step >= args.steps and not args.min_seconds:
            break
        if rank == args.hang_rank and (step == args.hang_at_step
                                       or 0 < args.hang_after_s <= time.monotonic() - t_first
                                       or (args.hang_when_file and os.path.exists(args.hang_when_file))):
            print(f"rank {rank}: hanging at step {step}", file=sys.stderr, flush=True)
            hang_forever()
        if rank == args.fail_rank and step == args.fail_at_step:
            load_batch(step)
        if model is not None and opt is not None:   # --ddp
            reps = 1 + (extra // max(args.matmuls, 1) if rank == args.slow_rank else 0)
            out = x0
            for _ in range(reps):
                out = model(out)
            loss = out.square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if args.wait_ms:
                time.sleep(args.wait_ms / 1000)
        else:
            y = compute(x0, w, args.matmuls)
            if rank == args.slow_rank and step >= args.slow_from_step:
                y = slow_extra_compute(y, w, extra)
            if args.wait_ms:
                time.sleep(args.wait_ms / 1000)
            t = y.sum().reshape(1)
            if args.min_seconds:
                # [1]: how many ranks have done --steps and --min-seconds; the sum is the same on
                # every rank, so all of them stop after the same step.
                done = step + 1 >= args.steps and time.monotonic() - t_first >= args.min_seconds
                t = torch.cat([t, torch.tensor([float(done)])])
            dist.all_reduce(t)
        tracer.step()
        done_steps = step + 1
        if args.min_seconds and t[1].item() > 0:
            break
    if rank == 0:
        print(f"rank 0: done after {done_steps} steps", file=sys.stderr, flush=True)
    tracer.close()
    # Free DDP (its reducer holds gloo work) while Python is fully alive: left to the interpreter's
    # shutdown, gloo's thread freed that work as Python finalised and the process aborted
    # ("terminate called without an active exception") in about 1 job in 4.
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
