"""A training script shaped like a GPU job, on CPU (gloo), with no rankscope in it.

    torchrun --nproc-per-node 4 modelled_gpu.py --steps 2000 --slow-device-rank 2 --slow-factor 4

Each rank has a *device*: a stream thread that runs its queued work in order, compute and
collectives alike. Collectives are real gloo all-reduces issued from the stream thread with
``async_op=True`` and polled until complete, as a GPU's stream reaches a NCCL kernel only after
the work queued before it. The training thread never blocks in torch.distributed: it loads a batch,
queues the step's device work, waits at one sync per step (``loss.item()``) and steps its
optimizer. A device error (a peer gone) is raised at the next sync, as CUDA raises it.

Faults (one each): ``--slow-device-rank`` runs that rank's device compute ``--slow-factor`` times
(from step ``--slow-from-step``); ``--slow-data-rank`` loads that rank's batches ``--slow-data-s``
slower on the host; ``--crash-rank``/``--crash-at-step`` raises on that rank's training thread;
``--stop-device-rank``/``--stop-at-step`` stops that device before its collective of that step;
``--hang-rank``/``--hang-at-step`` blocks that rank's training thread in data loading;
``--mismatch-rank``/``--mismatch-at-step`` issues the all-reduces of that step and the next
``--mismatch-steps`` - 1 with another shape (same bytes, so gloo goes on), as a rank on another code
path would; ``--kill-rank``/``--kill-at-step`` SIGKILLs that rank. ``--min-seconds``
goes on past ``--steps`` until that many seconds have passed (the ranks agree through the step's
all-reduce).
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

SIZE = 160         # the model's width
COMPUTE_REPS = 8   # matmuls per step on a healthy device


class Stream:
    """A device stream: queued work runs in order on its own thread."""

    def __init__(self) -> None:
        self.work: queue.Queue[Callable[[], None]] = queue.Queue()
        self.error: BaseException | None = None
        threading.Thread(target=self._run, name="device-stream", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn = self.work.get()
            if self.error is None:
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001 (raised at the next sync, as CUDA does)
                    self.error = e
            self.work.task_done()

    def launch(self, fn: Callable[[], None]) -> None:
        self.work.put(fn)

    def synchronize(self) -> None:
        done = threading.Event()
        self.launch(done.set)
        while not done.wait(0.05):
            if self.error is not None:
                break
        if self.error is not None:
            raise RuntimeError(f"device error: {self.error}") from self.error


def all_reduce_on_stream(t: torch.Tensor) -> None:
    work = dist.all_reduce(t, async_op=True)
    while not work.is_completed():
        time.sleep(0.0002)
    work.wait()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--min-seconds", type=float, default=0.0)
    p.add_argument("--slow-device-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=int, default=4)
    p.add_argument("--slow-from-step", type=int, default=0)
    p.add_argument("--slow-data-rank", type=int, default=-1)
    p.add_argument("--slow-data-s", type=float, default=0.02)
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--stop-device-rank", type=int, default=-1)
    p.add_argument("--stop-at-step", type=int, default=-1)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-at-step", type=int, default=-1)
    p.add_argument("--mismatch-rank", type=int, default=-1)
    p.add_argument("--mismatch-at-step", type=int, default=-1)
    p.add_argument("--mismatch-steps", type=int, default=1_000_000)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-at-step", type=int, default=-1)
    args = p.parse_args()
    if args.steps < 1 or args.min_seconds < 0 or args.slow_factor < 1:
        p.error("--steps and --slow-factor must be >= 1 and --min-seconds >= 0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    weight = torch.nn.Parameter(torch.randn(SIZE, SIZE) / SIZE)
    opt = torch.optim.SGD([weight], lr=1e-4)
    stream = Stream()
    slow_reps = COMPUTE_REPS * (args.slow_factor if rank == args.slow_device_rank else 1)
    grad = torch.zeros(SIZE * SIZE + 1)       # the gradient bucket, plus a "done" flag
    t_first = time.monotonic()
    step = 0
    while True:
        if rank == args.kill_rank and step == args.kill_at_step:
            print(f"rank {rank}: SIGKILL at step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == args.hang_rank and step == args.hang_at_step:
            print(f"rank {rank}: data loading blocked at step {step}", file=sys.stderr, flush=True)
            while True:        # a read from a dead file system
                time.sleep(0.2)
        if rank == args.crash_rank and step == args.crash_at_step:
            raise RuntimeError(f"rank {rank}: planted failure at step {step}")
        if rank == args.slow_data_rank:
            time.sleep(args.slow_data_s)      # a slow file system or decoder
        x = torch.randn(SIZE, SIZE)           # the batch, loaded on the host
        reps = slow_reps if step >= args.slow_from_step else COMPUTE_REPS
        done = float(step + 1 >= args.steps and time.monotonic() - t_first >= args.min_seconds)
        stop_here = rank == args.stop_device_rank and step == args.stop_at_step
        odd_shape = rank == args.mismatch_rank and 0 <= step - args.mismatch_at_step < args.mismatch_steps

        def device_step(x: torch.Tensor = x, done: float = done, stop_here: bool = stop_here,
                        odd_shape: bool = odd_shape, at: int = step, reps: int = reps) -> None:
            y = x
            for _ in range(reps):
                y = torch.tanh(y @ weight.detach())
            if stop_here:
                print(f"rank {rank}: device stopped at step {at}", file=sys.stderr, flush=True)
                while True:    # a kernel that never finishes
                    time.sleep(0.2)
            grad[:-1] = y.reshape(-1)
            grad[-1] = done
            bucket = grad.view(1, -1) if odd_shape else grad
            all_reduce_on_stream(bucket)

        stream.launch(device_step)
        stream.synchronize()                  # loss.item(): the host waits for its device
        weight.grad = grad[:-1].reshape(SIZE, SIZE) * 1e-3
        opt.step()
        step += 1
        if grad[-1].item() >= dist.get_world_size():
            break
    if rank == 0:
        print(f"rank 0: done after {step} steps in {time.monotonic() - t_first:.1f}s", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
