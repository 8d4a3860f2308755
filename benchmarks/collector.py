"""Rank-side collector costs, as ratios within one run (median of repeats):

- trace-window overhead on a 2-rank gloo DDP job (benchmarks/window_job.py): a window plus 20
  training steps with rankscope (its conversion and producing run on the tracer's sender thread
  and are included by waiting for them) against a bare torch.profiler with the same settings;
- where a window's conversion time goes: µs per event for each stage on a real window;
- encode-and-produce throughput: extracted events -> columns, summary, packed chunks, wire
  envelopes, produced to a real broker and flushed, events per CPU second;
- always-on bytes per step per rank (steps, heartbeats, hardware samples) at two step rates;
- memory the tracer adds to a process, with the broker down (bounded queue) and up.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from benchmarks._stack import local_stack, torchrun, warm_broker
from rankscope.config import Settings

WINDOW_STEPS = 5
TRAIL_STEPS = 20   # training goes on after a window while rankscope ships it in the background
DDP_REPEATS = 31
WINDOW_JOBS = 3    # jobs of the saturated set-up: its ratio moves 1.04-1.14 from job to job on 2 shared cores
WAIT_MS = 20.0     # the "_wait" set-up: a GIL-released wait per step, as on a GPU


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(192, 192), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers), torch.randn(192, 192)


def _train_step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


def _window_job(settings: Settings, size: int, repeats: int, wait_ms: float = 0.0, tries: int = 3) -> dict[str, Any]:
    """The job's result, after up to ``tries`` runs; every failure is kept in the result's
    ``failures`` (the job log's tail) and counted in the table, not hidden: a job whose rank crashed
    shows up here rather than as a missing row."""
    failures: list[str] = []
    for _ in range(tries):
        try:
            res = _window_job_once(settings, size, repeats, wait_ms)
        except RuntimeError as e:
            failures.append(str(e))
            continue
        res["failures"] = failures
        return res
    raise RuntimeError(f"window overhead job failed {tries} times; the last:\n{failures[-1]}")


def _window_jobs(settings: Settings, size: int, repeats: int, wait_ms: float, jobs: int) -> dict[str, Any]:
    """``jobs`` window jobs pooled: the median of all their per-repeat ratios (and of all their runs
    per mode), the medians over jobs of the phases and of the sender's CPU, the broker's mean, and
    each job's own ratio (``window_ratio_per_job``)."""
    results = [_window_job(settings, size, repeats, wait_ms) for _ in range(jobs)]
    if jobs == 1:
        return {**results[0], "window_ratio_per_job": [results[0]["window_ratio"]]}
    runs = {m: [v for r in results for v in r["runs_s"][m]] for m in ("none", "bare", "rankscope")}
    med = {m: statistics.median(v) for m, v in runs.items()}
    brokers = [r["broker_cpu_s_per_run"] for r in results if r.get("broker_cpu_s_per_run")]
    return {
        "runs_s": runs, "median_s": med,
        "window_ratio": statistics.median(a / b for a, b in zip(runs["rankscope"], runs["bare"], strict=True)),
        "window_ratio_of_medians": med["rankscope"] / med["bare"], "bare_vs_none": med["bare"] / med["none"],
        "median_phases_s": {m: [statistics.median(r["median_phases_s"][m][i] for r in results) for i in range(4)]
                            for m in ("bare", "rankscope")},
        "broker_cpu_s_per_run": {m: statistics.fmean(b[m] for b in brokers) for m in brokers[0]} if brokers else None,
        "median_ship_cpu_s": statistics.median(r["median_ship_cpu_s"] for r in results),
        "failures": [f for r in results for f in r["failures"]],
        "window_ratio_per_job": [round(r["window_ratio"], 3) for r in results]}


def _window_job_once(settings: Settings, size: int, repeats: int, wait_ms: float = 0.0) -> dict[str, Any]:
    from rankscope.cli.stack.broker import LocalBroker

    out = Path(tempfile.mkdtemp()) / "window.json"
    broker_pid = LocalBroker(settings).pid() if settings.local_broker else None
    proc = torchrun(settings, f"win-{uuid.uuid4().hex[:6]}", "--repeats", str(repeats), "--window",
                    str(WINDOW_STEPS), "--trail", str(TRAIL_STEPS), "--size", str(size), "--wait-ms", str(wait_ms),
                    "--broker-pid", str(broker_pid or 0), "--result-file", str(out), nproc=2,
                    module="benchmarks.window_job", log=str(out.with_suffix(".log")))
    if proc.wait(1200) != 0:
        tail = [ln for ln in out.with_suffix(".log").read_text(errors="replace").splitlines()
                if "USDT" not in ln and "gpuGetDeviceCount" not in ln][-30:]
        raise RuntimeError("window overhead job failed:\n" + "\n".join(tail))
    return json.loads(out.read_text())


def window_overhead(settings: Settings) -> dict[str, Any]:
    """Training time of a window plus ``TRAIL_STEPS`` steps with a rankscope window against a bare
    torch.profiler window, on a 2-rank gloo DDP job (benchmarks/window_job.py), median of
    ``DDP_REPEATS`` alternating runs, in each of ``WINDOW_JOBS`` jobs pooled for the first set-up (the
    median of the per-repeat ratios, and each job's own; the ratio of the medians too), with where the time goes and the co-located broker's CPU per window; in three set-ups: the small MLP of the other benchmarks
    (~6 ms steps, the worst case: ~850 profiler events per ms of training, and both cores busy
    training, so any CPU the window costs anywhere shows); a 512-wide one (same ops, so the same
    events per step, in longer steps); and the small MLP with a 20 ms wait per step with the GIL
    released (``_wait``: like a GPU job whose CPU thread waits on its stream, cores not saturated)."""
    metrics: dict[str, Any] = {"trail_steps": TRAIL_STEPS, "ddp_ranks": 2}
    # One short job first, not counted: the broker's first windows (new producers, first chunks and
    # summaries) still cost it several times what later ones do. Its ratio is reported.
    metrics["window_ratio_warmup_job"] = _window_job(settings, 192, 7)["window_ratio"]
    for size, suffix, repeats, wait_ms, jobs in ((192, "", DDP_REPEATS, 0.0, WINDOW_JOBS), (512, "_512", 9, 0.0, 1),
                                                 (192, "_wait", 7, WAIT_MS, 1)):
        res = _window_jobs(settings, size, repeats, wait_ms, jobs)
        med = res["median_s"]
        ph = {m: [round(1e3 * v, 2) for v in p[:3]] for m, p in res["median_phases_s"].items()}
        broker = res.get("broker_cpu_s_per_run") or {}
        metrics.update({
            f"window_ratio{suffix}": res["window_ratio"],
            f"window_ratio_of_medians{suffix}": res["window_ratio_of_medians"],
            f"window_ratio_per_job{suffix}": res["window_ratio_per_job"],
            **{f"{phase}_ms_{m}{suffix}": ph[m][i] for i, phase in enumerate(("window", "first_trail_step",
                                                                                "rest_of_trail"))
               for m in ("bare", "rankscope")},
            f"broker_cpu_ms_per_window{suffix}": (round(1e3 * (broker["rankscope"] - broker["bare"]), 1)
                                                  if broker else None),
            f"window_plus_trail_bare_s{suffix}": med["bare"],
            f"window_plus_trail_rankscope_s{suffix}": med["rankscope"], f"bare_profiler_vs_none{suffix}": res["bare_vs_none"],
            f"step_ms{suffix}": 1e3 * med["none"] / (WINDOW_STEPS + TRAIL_STEPS),
            f"sender_cpu_ms_per_window{suffix}": 1e3 * res["median_ship_cpu_s"],
            f"window_job_failures{suffix}": len(res["failures"])})
        for failure in res["failures"]:
            print(f"collector: a window job{suffix} failed and was run again:\n{failure}", file=sys.stderr)
    return metrics


def _record_window() -> Any:
    """A real 5-step CPU window (with_stack) of the bench model, stopped."""
    from torch.profiler import ProfilerAction, ProfilerActivity, profile

    model, x = _model()
    for _ in range(3):
        _train_step(model, x)
    prof = profile(activities=[ProfilerActivity.CPU], with_stack=True, schedule=lambda s: ProfilerAction.RECORD)
    prof.start()
    for i in range(WINDOW_STEPS):
        _train_step(model, x)
        if i < WINDOW_STEPS - 1:
            prof.step()
    prof.stop()
    return prof


def conversion_costs(settings: Settings) -> dict[str, Any]:
    """Per-event cost of each stage on the sender thread, for a real window, median of 5: torch's
    ``events()`` list (what the Python reader starts from), the Python reader on top of it, the C++
    reader (``native_extract``, none when not built), columns, summary, chunks; and columns plus
    summary with the C++ kernels (``native_columnar_summarize``)."""
    from rankscope.producers.native_extract import load_native
    from rankscope.producers.trace_events import chunk, extract_raw, summarize, to_columnar

    native = load_native(settings.cache_dir)
    stages: dict[str, list[float]] = {"events": [], "extract": [], "native_extract": [], "columnar": [],
                                      "summarize": [], "chunk": [], "native_columnar_summarize": []}
    n = 0
    for _ in range(5):
        prof = _record_window()
        t0 = time.perf_counter()
        prof.profiler.kineto_results.events()
        t1 = time.perf_counter()
        raw = extract_raw(prof)
        t2 = time.perf_counter()
        if native is not None:
            raw = extract_raw(prof, native=native)
        tn = time.perf_counter()
        col = to_columnar(raw, "w", 0)
        t3 = time.perf_counter()
        summarize(col)
        t4 = time.perf_counter()
        chunk(col, 1 << 31)
        t5 = time.perf_counter()
        if native is not None:
            summarize(to_columnar(raw, "w", 0, native=native), native=native, compact_paths=True)
        t6 = time.perf_counter()
        n = len(raw)
        for k, dt in zip(stages, (t1 - t0, t2 - t1 - (t1 - t0), tn - t2, t3 - tn, t4 - t3, t5 - t4, t6 - t5),
                         strict=True):
            stages[k].append(dt)
    if native is None:
        del stages["native_extract"], stages["native_columnar_summarize"]
    out: dict[str, Any] = {"window_events": n}
    for k, v in stages.items():
        out[f"{k}_us_per_event"] = statistics.median(v) / n * 1e6
    return out


def _tile(raw: Any, copies: int) -> Any:
    """``copies`` back-to-back copies of a window's RawEvents (python ids and rows re-numbered)."""
    from rankscope.producers.trace_extract import RawEvents

    starts = raw.py["start_ns"] + raw.host["start_ns"]
    span = max(starts) - min(starts) + 1000
    id_step = max(raw.py["py_id"] + [0]) + 1
    out = RawEvents(raw.offset_ns)
    out.names, out.name_index = raw.names, raw.name_index
    n_host, n_dev = len(raw.host["name"]), len(raw.dev["name"])
    for k in range(copies):
        for group, dst in ((raw.py, out.py), (raw.host, out.host), (raw.dev, out.dev)):
            for c, values in group.items():
                if c == "start_ns":
                    dst[c].extend(v + k * span for v in values)
                elif c in ("py_id", "py_parent"):
                    dst[c].extend(v + k * id_step if v >= 0 else v for v in values)
                else:
                    dst[c].extend(values)
        out.host_attrs.update((r + k * n_host, a) for r, a in raw.host_attrs.items())
        out.dev_attrs.update((r + k * n_dev, a) for r, a in raw.dev_attrs.items())
    return out


def encode_and_produce(settings: Settings) -> dict[str, Any]:
    """Events per CPU second (all threads of the process, librdkafka's included) from extracted
    events (a real window's RawEvents, tiled to ~200k events, as int64 column arrays like the C++
    reader's) to acknowledged Kafka messages:
    columns, summary, chunks, wire envelopes, produce, flush. Median of 3 runs."""
    from confluent_kafka import Producer

    from rankscope.producers.trace_events import chunk, extract_raw, summarize, summary_body, to_columnar
    from rankscope.protocol.envelope import Envelope, encode

    one = extract_raw(_record_window())
    raw = _tile(one, max(1, 200_000 // len(one)))
    for group in (raw.py, raw.host, raw.dev):     # int64 arrays, as the C++ reader hands them over
        for c in group:
            group[c] = np.asarray(group[c], dtype=np.int64)
    n = len(raw)
    producer = Producer({"bootstrap.servers": settings.bootstrap, "linger.ms": 20, "compression.type": "lz4",
                         "queue.buffering.max.kbytes": 1048576})
    topic = f"{settings.topic_prefix}traces"
    def once() -> tuple[float, float, list[dict[str, Any]]]:
        gc.collect()
        t0 = time.process_time()
        w0 = time.perf_counter()
        col = to_columnar(raw, "bench", 0)
        functions = summarize(col)
        bodies, _, sent = chunk(col, 1 << 31)
        messages = [("trace", b) for b in bodies] + [("summary", summary_body(col, functions, events_sent=sent,
                                                                              truncated=False))]
        for seq, (kind, body) in enumerate(messages):
            value = encode(Envelope(kind=kind, job="bench", rank=0, host="h", pid=1, seq=seq,
                                    sent_ns=time.time_ns(), body=body))
            producer.produce(topic, key=b"bench/0", value=value)
            producer.poll(0)
        if producer.flush(60):
            raise RuntimeError("trace chunks not delivered")
        return time.process_time() - t0, time.perf_counter() - w0, bodies

    runs = [once() for _ in range(3)]
    cpu = statistics.median(r[0] for r in runs)
    bodies = runs[-1][2]
    wire_bytes = sum(len(encode(Envelope(kind="trace", job="bench", rank=0, host="h", pid=1, seq=0, sent_ns=0,
                                         body=b))) for b in bodies)
    return {"events": n, "encode_produce_events_per_cpu_s": n / cpu,
            "encode_produce_wall_s": statistics.median(r[1] for r in runs), "trace_wire_bytes_per_event": wire_bytes / n}


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
    from rankscope.producers.tracer import Tracer

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
    from rankscope.producers.tracer import Tracer

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
    metrics["always_on_bytes_per_step_at_10ms"] = always_on_bytes(0.01)
    metrics["always_on_bytes_per_step_at_100ms"] = always_on_bytes(0.1)
    with local_stack(processors=False) as settings:
        metrics.update(conversion_costs(settings))
        metrics.update(warm_broker(settings))     # the broker is timed warm, as a long-running one is
        metrics.update(window_overhead(settings))
        metrics.update(encode_and_produce(settings))
        metrics.update(tracer_memory(settings))
    metrics = {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}
    return {"name": "collector", "metrics": metrics,
            "targets": {"window_ratio": "<= 1.1", "window_ratio_512": "<= 1.1", "window_ratio_wait": "<= 1.1", "encode_produce_events_per_cpu_s": ">= 1e6",
                        "always_on_bytes_per_step_at_100ms": "<= 2048",
                        "tracer_rss_added_mb_broker_down": "<= 50 (bounded)"}}
