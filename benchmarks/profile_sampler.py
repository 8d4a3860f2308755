"""What always-on stack sampling costs a rank: the sampler thread's CPU at 20 Hz and 100 Hz, and
the bytes per second of its ``profile`` messages.

One process trains a small MLP on one CPU thread (forward, backward, optimizer step: torch's
Python frames ~20-30 deep) with a DataLoader pin-memory-like helper thread idle in a queue, while a
StackSampler (producers/stack_sampler.py) samples every thread and folds each interval, as on a
rank. CPU comes from the sampler thread's own CPU clock; bytes are each message body as msgpack
(before Kafka's compression). No Kafka: the messages are counted, not sent. A thread that only
wakes at the same rate, beside the same training, gives what waking costs on this machine
(``wake_only``), so the sampling work itself is the difference; the training's steps per second
with the sampler against without are reported too. Each rate runs with the C walker (as ranks
sample) and with a Python walk (``*_python_walk`` keys: what the C walker saves).

``python -m benchmarks.profile_sampler [--seconds 20] [--rates 20,100]``
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from typing import Any

import msgpack

SECONDS = 20.0
RATES = (20.0, 100.0)
INTERVAL_S = 5.0


def _train(stop: threading.Event) -> int:
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    steps = 0
    while not stop.is_set():
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    return steps


def _cpu_ns(native_id: int) -> int:
    return time.clock_gettime_ns(((~native_id) << 3) | 6)   # the thread's CPU clock (Linux)


def wake_cost(hz: float, seconds: float) -> dict[str, Any]:
    """A thread that only wakes ``hz`` times a second while the model trains: what waking (and
    taking the GIL back from the training thread) costs on this machine, whatever the work."""
    stop = threading.Event()
    out: list[float] = []

    def tick() -> None:
        tid, n = threading.get_native_id(), 0
        c0 = _cpu_ns(tid)
        while not stop.wait(1.0 / hz):
            n += 1
        out.append((_cpu_ns(tid) - c0) / 1e3 / max(n, 1))

    t = threading.Thread(target=tick, name="wake-only")
    t0 = time.monotonic()
    t.start()
    threading.Timer(seconds, stop.set).start()
    steps = _train(stop)
    wall = time.monotonic() - t0
    t.join()
    return {"hz": hz, "wake_cpu_us_per_tick": round(out[0], 2), "steps_per_s": round(steps / wall, 1)}


def baseline(seconds: float) -> float:
    stop = threading.Event()
    t0 = time.monotonic()
    threading.Timer(seconds, stop.set).start()
    steps = _train(stop)
    return steps / (time.monotonic() - t0)


def measure(hz: float, seconds: float, walker: str = "c") -> dict[str, Any]:
    """The sampler beside the training loop, walking stacks with the C walker (``walker="c"``, as ranks
    do) or in Python (``"python"``: what the C walker saves; ranks never walk in Python)."""
    from rankscope.config import Settings
    from rankscope.producers import stack_sampler, stack_walk
    from rankscope.producers.stack_sampler import StackSampler

    sent: list[int] = []
    c_walker = None
    if walker == "c":
        cache = Settings.from_env().cache_dir
        stack_walk.build(cache)
        c_walker = stack_walk.load(cache)
        if c_walker is None:
            raise RuntimeError("the C stack walker did not load")
    else:
        stack_sampler.PYTHON_WALK = True     # measure the Python walk, which ranks do not use
    sampler = StackSampler(hz, INTERVAL_S, lambda kind, body, pid: sent.append(len(msgpack.packb(body))),
                           lambda: threading.main_thread().ident, time.time_ns, walker=c_walker)
    idle: queue.Queue[int] = queue.Queue()
    helper = threading.Thread(target=idle.get, name="Thread-1 (_pin_memory_loop)", daemon=True)
    helper.start()
    stop = threading.Event()
    sampler.start()
    tid = sampler._thread.native_id if sampler._thread is not None else 0
    cpu0 = _cpu_ns(tid)
    t0 = time.monotonic()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    steps = _train(stop)
    wall = time.monotonic() - t0
    cpu = _cpu_ns(tid) - cpu0
    sampler.stop()
    idle.put(0)
    ticks = int(hz * wall)
    return {"hz": hz, "walker": walker, "seconds": round(wall, 2), "steps_per_s": round(steps / wall, 1),
            "sampler_cpu_share": round(cpu / 1e9 / wall, 6),
            "sampler_cpu_us_per_sample": round(cpu / 1e3 / max(ticks, 1), 2), "messages": len(sent),
            "bytes_per_s": round(sum(sent) / wall, 1), "max_message_bytes": max(sent) if sent else 0}


def run(seconds: float = SECONDS, rates: tuple[float, ...] = RATES) -> dict[str, Any]:
    base = baseline(seconds)
    rows = []
    for walker in ("c", "python"):
        for hz in rates:
            r = measure(hz, seconds, walker)
            r.update(wake_cost(hz, seconds))
            r["sampling_work_us_per_sample"] = round(r["sampler_cpu_us_per_sample"] - r["wake_cpu_us_per_tick"], 2)
            r["training_steps_ratio"] = round(r["steps_per_s"] / base, 4)
            rows.append(r)
    metrics: dict[str, Any] = {"training_steps_per_s_without": round(base, 1)}
    for r in rows:
        k = f"{int(r['hz'])}hz" + ("" if r["walker"] == "c" else "_python_walk")
        metrics[f"sampler_cpu_share_{k}"] = r["sampler_cpu_share"]
        metrics[f"sampler_cpu_us_per_sample_{k}"] = r["sampler_cpu_us_per_sample"]
        metrics[f"wake_only_cpu_us_per_tick_{k}"] = r["wake_cpu_us_per_tick"]
        metrics[f"sampling_work_us_per_sample_{k}"] = r["sampling_work_us_per_sample"]
        metrics[f"profile_bytes_per_s_{k}"] = r["bytes_per_s"]
    return {"name": "profile_sampler", "runs": rows, "metrics": metrics,
            "targets": {"sampler_cpu_share_20hz": "<= 0.001", "profile_bytes_per_s_20hz": "<= 2048",
                        "profile_bytes_per_s_100hz": "<= 2048"}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_sampler", description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=SECONDS)
    p.add_argument("--rates", default=",".join(str(int(r)) for r in RATES))
    args = p.parse_args(argv)
    if args.seconds <= 0:
        p.error("--seconds must be > 0")
    try:
        rates = tuple(float(r) for r in args.rates.split(","))
    except ValueError:
        p.error(f"--rates must be comma-separated numbers, got {args.rates!r}")
    print(json.dumps(run(args.seconds, rates), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
