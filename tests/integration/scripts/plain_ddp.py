"""A plain DDP training script (gloo on CPU) with no rankscope in it, for ``rankscope run`` tests.

    torchrun --nproc-per-node 4 plain_ddp.py --steps 200 --slow-rank 1 --slow-factor 4

Options plant one fault: ``--slow-rank`` runs the forward pass ``--slow-factor`` times on that rank
(from step ``--slow-from-step``); ``--slow-data-rank`` makes that rank's loader take ``--slow-data-s``
longer per batch;
``--hang-rank``/``--hang-at-index`` make the Dataset's ``__getitem__`` block on that rank at that index;
``--crash-rank``/``--crash-at-step`` raise at that step; ``--kill-rank``/``--kill-at-step`` SIGKILL
that rank's own process at that step, as the OOM killer would. ``--min-seconds`` goes on past
``--steps`` until that many seconds have passed; the ranks agree on the last step through an
all_reduce. ``--extra-rank`` spends ``--extra-ms`` per step in a function no other rank calls;
``--workers`` loads batches in that many DataLoader worker processes (persistent). ``--wait-ms``
sleeps that long each step after the forward pass, on every rank: a device's share of the step, in
which the host's cores are free. Two optimizers (one per half of the model) each step once per
iteration.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset


class Samples(Dataset):
    def __init__(self, n: int, size: int, hang_at: int, batch: int = 1, slow_s: float = 0.0) -> None:
        self.n, self.size, self.hang_at = n, size, hang_at
        self.per_sample_s = slow_s / batch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.hang_at:
            print(f"rank {dist.get_rank()}: data loading blocked at index {i}", file=sys.stderr, flush=True)
            while True:        # a read from a dead file system
                time.sleep(0.2)
        if self.per_sample_s:
            time.sleep(self.per_sample_s)    # a slow file system or decoder
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.size, generator=g)


def tokenize_captions(ms: float) -> float:
    """Extra host work only one rank does (a function its peers never call)."""
    t0, acc = time.perf_counter(), 0.0
    while time.perf_counter() - t0 < ms / 1e3:
        acc += sum(i * i for i in range(200))
    return acc


class StepFailed(RuntimeError):
    pass


@record    # torchrun's error file; it re-raises, so the exception still reaches sys.excepthook
def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=int, default=4)
    p.add_argument("--slow-from-step", type=int, default=0)
    p.add_argument("--slow-data-rank", type=int, default=-1)
    p.add_argument("--slow-data-s", type=float, default=0.02)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-at-index", type=int, default=-1)
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-at-step", type=int, default=-1)
    p.add_argument("--min-seconds", type=float, default=0.0)
    p.add_argument("--extra-rank", type=int, default=-1)
    p.add_argument("--extra-ms", type=float, default=20.0)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--wait-ms", type=float, default=0.0)
    args = p.parse_args()
    if args.min_seconds < 0 or args.wait_ms < 0:
        p.error(f"--min-seconds and --wait-ms must be >= 0, got {args.min_seconds} and {args.wait_ms}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(args.size, args.size), torch.nn.ReLU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers))
    params = list(model.parameters())
    opts = [torch.optim.SGD(params[: len(params) // 2], lr=1e-3), torch.optim.SGD(params[len(params) // 2:], lr=1e-3)]
    hang_at = args.hang_at_index if rank == args.hang_rank else -1
    n = args.steps * args.batch
    slow_data_s = args.slow_data_s if rank == args.slow_data_rank else 0.0
    loader = DataLoader(Samples(n, args.size, hang_at, args.batch, slow_data_s), batch_size=args.batch,
                        num_workers=args.workers, persistent_workers=args.workers > 0)
    epochs = itertools.count() if args.min_seconds else range(1)
    batches = (x for _ in epochs for x in loader)
    reps = args.slow_factor if rank == args.slow_rank else 1
    t_first = time.monotonic()
    done = torch.zeros(1)
    iterations = 0
    for step, x in enumerate(batches):
        if rank == args.crash_rank and step == args.crash_at_step:
            raise StepFailed(f"rank {rank}: planted failure at step {step}")
        if rank == args.kill_rank and step == args.kill_at_step:
            print(f"rank {rank}: SIGKILL at step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == args.extra_rank:
            tokenize_captions(args.extra_ms)
        out = x
        for _ in range(reps if step >= args.slow_from_step else 1):
            out = model(out)
        if args.wait_ms:
            time.sleep(args.wait_ms / 1e3)
        loss = out.square().mean()
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
        iterations = step + 1
        if args.min_seconds:
            # How many ranks have done --steps and --min-seconds; the sum is the same on every rank,
            # so all of them stop after the same step.
            done[0] = float(step + 1 >= args.steps and time.monotonic() - t_first >= args.min_seconds)
            dist.all_reduce(done)
            if done.item() > 0:
                break
    if rank == 0:
        print(f"rank 0: done after {iterations} iterations in {time.monotonic() - t_first:.1f}s", file=sys.stderr, flush=True)
    # Free DDP (its reducer holds gloo work) while Python is fully alive, then leave the group.
    del model, opts
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
