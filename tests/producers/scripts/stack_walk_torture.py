"""Torture a stack sampler: threads that start and end all the time, deep recursion through torch
ops and generators, torch.profiler windows with Python stacks opening and closing, and the sampler
at 500 Hz.

``python stack_walk_torture.py c|python SECONDS CACHE_DIR [MIN_WINDOWS MIN_SAMPLES]``: ``c`` samples
with the C walker (built into CACHE_DIR), ``python`` walks the stacks in Python (which crashed
CPython 3.11 here within seconds). With MIN_WINDOWS and MIN_SAMPLES it goes on past SECONDS (up to
240 s more, on a starved machine) until it has opened more windows and taken more samples than
those. Prints ``survived ... samples=N windows=M`` and exits 0 when it lasted.
"""

import random
import sys
import threading
import time

import torch
from torch.profiler import ProfilerActivity, profile

from rankscope.producers import stack_sampler, stack_walk
from rankscope.producers.stack_sampler import StackSampler


def gen(n):
    for i in range(n):
        yield torch.ones(4) * i


def deep(n, x):
    if n == 0:
        return sum(t.sum() for t in gen(3)) + x.sum()
    return deep(n - 1, torch.relu(x))


def main() -> None:
    kind, seconds, cache = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    min_windows, min_samples = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (0, 0)
    walker = None
    if kind == "c":
        stack_walk.build(cache)
        walker = stack_walk.load(cache)
    else:
        stack_sampler.PYTHON_WALK = True
    stop = threading.Event()

    def worker() -> None:
        x = torch.randn(8)
        end = time.monotonic() + random.uniform(0.05, 0.5)
        while time.monotonic() < end and not stop.is_set():
            deep(random.randint(1, 60), x)

    def churn() -> None:
        while not stop.is_set():
            ts = [threading.Thread(target=worker) for _ in range(3)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

    bodies: list = []
    sampler = StackSampler(500.0, 1.0, lambda k, b, p: bodies.append(b), lambda: threading.main_thread().ident,
                           time.time_ns, walker=walker).start()
    threads = [threading.Thread(target=churn) for _ in range(2)]
    for t in threads:
        t.start()
    windows = 0
    model = torch.nn.Linear(16, 16)
    end = time.monotonic() + seconds
    give_up = end + 240.0

    def short() -> bool:   # a starved machine: go on until the run has seen what it should
        return windows <= min_windows or sum(b["ticks"] for b in list(bodies)) <= min_samples

    while time.monotonic() < end or (short() and time.monotonic() < give_up):
        with profile(activities=[ProfilerActivity.CPU], with_stack=True):
            for _ in range(5):
                model(torch.randn(4, 16)).sum().backward()
                deep(20, torch.randn(8))
        windows += 1
    stop.set()
    for t in threads:
        t.join()
    sampler.stop()
    print(f"survived {seconds}s walker={kind} windows={windows} samples={sum(b['ticks'] for b in bodies)}",
          flush=True)


if __name__ == "__main__":
    main()
