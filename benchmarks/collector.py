"""Rank-side collector costs, as ratios within one run (median of repeats):

- trace-window overhead against a bare torch.profiler with the same settings (same steps, stop
  included; rankscope's conversion and sending run on its background thread and are included
  by waiting for them), with training going on after the window and without (see
  ``window_overhead``);
- encode-and-produce throughput: convert + summarise + chunk + produce to a real broker, events/s
  on one core;
- always-on bytes per step per rank (steps, heartbeats, hardware samples) at two step rates;
- memory the tracer adds to a process, with the broker down (bounded queue) and up.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import psutil
import torch

from benchmarks._stack import local_stack
from producers.trace_window import WindowController
from rankscope.config import Settings

REPEATS = 5
WINDOW_STEPS = 5
TRAIL_STEPS = 20   # training goes on after a window while rankscope ships it in the background


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers), torch.randn(64, 256)


def _train_step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


def bare_profiler_s(model: torch.nn.Module, x: torch.Tensor, trail: int = 0) -> float:
    from torch.profiler import ProfilerAction, ProfilerActivity, profile

    t0 = time.perf_counter()
    prof = profile(activities=[ProfilerActivity.CPU], with_stack=True, schedule=lambda s: ProfilerAction.RECORD)
    prof.start()
    for i in range(WINDOW_STEPS):
        _train_step(model, x)
        if i < WINDOW_STEPS - 1:
            prof.step()
    prof.stop()
    prof.profiler.kineto_results.events()  # what any consumer of the window must at least do
    for _ in range(trail):
        _train_step(model, x)
    return time.perf_counter() - t0


def rankscope_window_s(model: torch.nn.Module, x: torch.Tensor, trail: int = 0) -> tuple[float, int]:
    sent: list[int] = []
    wc = WindowController(send_trace=lambda k, b: sent.append(len(b["events"]["category"])),
                          send_summary=lambda k, b: None, ack=lambda *a, **k: None, byte_budget=50_000_000,
                          wall_ns=time.time_ns)
    wc.handle("trace", "bench", {"steps": WINDOW_STEPS, "lead_ns": 0}, None, time.time_ns())
    t0 = time.perf_counter()
    wc.on_step(-1)
    for i in range(WINDOW_STEPS + trail):
        _train_step(model, x)
        wc.on_step(i)
    wc.drain(60)                              # shipped: conversion and sending are included
    return time.perf_counter() - t0, sum(sent)


def window_overhead() -> dict[str, Any]:
    """Two ratios, median of REPEATS, same process, alternating:

    - ``window_ratio``: the window's steps plus ``TRAIL_STEPS`` more training steps, until the
      window is shipped, against a bare profiler's window (``events()`` taken) plus the same steps:
      what a training job pays for a window;
    - ``window_only_ratio``: the window alone until shipped, against the bare window: the
      conversion cost when nothing overlaps it.
    """
    model, x = _model()
    for _ in range(3):
        _train_step(model, x)
    bare, ours, bare_only, ours_only, events = [], [], [], [], 0
    for _ in range(REPEATS):
        bare.append(bare_profiler_s(model, x, TRAIL_STEPS))
        t, events = rankscope_window_s(model, x, TRAIL_STEPS)
        ours.append(t)
        bare_only.append(bare_profiler_s(model, x))
        ours_only.append(rankscope_window_s(model, x)[0])
    return {"bare_profiler_window_s": statistics.median(bare_only), "rankscope_window_s": statistics.median(ours_only),
            "window_only_ratio": statistics.median(ours_only) / statistics.median(bare_only),
            "window_plus_trail_bare_s": statistics.median(bare), "window_plus_trail_rankscope_s": statistics.median(ours),
            "window_ratio": statistics.median(ours) / statistics.median(bare), "window_events": events,
            "trail_steps": TRAIL_STEPS}


def encode_and_produce(settings: Settings) -> dict[str, Any]:
    import numpy as np
    from confluent_kafka import Producer

    from producers.trace_events import chunk, summarize, to_columnar

    n = 200_000
    rng = np.random.default_rng(0)
    names = [f"aten::op{i}" for i in range(200)]
    start = time.time_ns()
    starts = start + np.cumsum(rng.integers(500, 5000, n))
    events = [{"type": "cpu_op", "name": names[i % 200], "start_ns": int(s), "dur_ns": int(d), "tid": 1}
              for i, (s, d) in enumerate(zip(starts, rng.integers(100, 400, n), strict=True))]
    producer = Producer({"bootstrap.servers": settings.bootstrap, "linger.ms": 20, "compression.type": "lz4",
                         "queue.buffering.max.kbytes": 1048576})
    import msgpack

    topic = f"{settings.topic_prefix}traces"
    t0 = time.process_time()
    w0 = time.perf_counter()
    col = to_columnar(events, "bench", 0)
    summarize(col)
    bodies, _, sent = chunk(col, 1 << 31)
    for b in bodies:
        producer.produce(topic, key=b"bench/0", value=msgpack.packb({"body": b}, use_bin_type=True))
        producer.poll(0)
    producer.flush(60)
    cpu = time.process_time() - t0
    return {"events": n, "encode_produce_events_per_cpu_s": n / cpu, "encode_produce_wall_s": time.perf_counter() - w0}


class _CountingTransport:
    def __init__(self) -> None:
        self.bytes = 0
        self.dropped = 0

    def send(self, topic: str, key: bytes, value: bytes) -> bool:
        self.bytes += len(key) + len(value)
        return True

    def close(self, timeout_s: float) -> None:
        pass


def always_on_bytes(step_s: float, seconds: float = 6.0) -> float:
    from producers.tracer import Tracer

    t = _CountingTransport()
    tracer = Tracer(Settings(job_id="bench", rank=0, local_rank=0, world_size=8, control_enabled=False),
                    transport=t, install_collective_timing=False, handle_signals=False)
    steps = int(seconds / step_s)
    for _ in range(steps):
        time.sleep(step_s)
        tracer.step()
    tracer.close()
    return t.bytes / steps


def tracer_memory(settings: Settings) -> dict[str, Any]:
    from producers.tracer import Tracer

    proc = psutil.Process()
    out = {}
    for label, bootstrap in (("broker_down", "127.0.0.1:1"), ("broker_up", settings.bootstrap)):
        gc.collect()
        before = proc.memory_info().rss
        tracer = Tracer(Settings(job_id=f"mem-{label}", bootstrap_servers=bootstrap, topic_prefix=settings.topic_prefix,
                                 heartbeat_s=0.05, queue_max=20000, control_enabled=False, flush_timeout_s=1),
                        install_collective_timing=False, handle_signals=False)
        peak = before
        for i in range(200_000):
            tracer.step()
            if i % 20_000 == 0:
                time.sleep(0.2)
                peak = max(peak, proc.memory_info().rss)
        time.sleep(1.0)
        peak = max(peak, proc.memory_info().rss)
        tracer.close()
        out[f"tracer_rss_added_mb_{label}"] = (peak - before) / 2**20
    return out


def run() -> dict[str, Any]:
    torch.set_num_threads(1)
    metrics: dict[str, Any] = {}
    metrics.update(window_overhead())
    metrics["always_on_bytes_per_step_at_10ms"] = always_on_bytes(0.01)
    metrics["always_on_bytes_per_step_at_100ms"] = always_on_bytes(0.1)
    with local_stack(processors=False) as settings:
        metrics.update(encode_and_produce(settings))
        metrics.update(tracer_memory(settings))
    metrics = {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}
    return {"name": "collector", "metrics": metrics,
            "targets": {"window_ratio": "<= 1.1", "encode_produce_events_per_cpu_s": ">= 1e6",
                        "always_on_bytes_per_step_at_100ms": "<= 2048",
                        "tracer_rss_added_mb_broker_down": "<= 50 (bounded)"}}
