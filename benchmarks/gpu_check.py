"""End-to-end check on a machine with an NVIDIA GPU: ``python -m benchmarks.gpu_check``.

Trains a small CUDA MLP (one pinned host->device copy per step, its gradients all-reduced in a
one-rank NCCL group with PyTorch's Flight Recorder on) under a :class:`Tracer` for ``--steps`` steps,
with a trace window in the middle, and asks for the rank's Flight Recorder dump as a hang would.
By default it runs a throw-away local stack (a real broker, no processors) and the sink into a chDB
store in a temp dir, and prints what arrived in ClickHouse: rows per table, ``hw_samples`` per
device and metric (n, min, median, max), the trace window as stored (``trace_events`` per category
with its top names, ``trace_windows``, ``function_summaries``) and the stored dump; and from the rank
side the sampler's cost per sample, the bytes sent per topic and the collective records the beats
carried (with NCCL's device durations). The same goes to ``benchmarks/results/gpu_check.json``.

A lent GPU machine has no Java and no ClickHouse: there ``--record DIR`` runs the rank side alone and
keeps every message the rank sent in ``DIR``; here ``--replay DIR`` sends them through a real broker,
sink and chDB store and prints and judges what was stored, as the one-machine run does.

Exit status: 0 when steps, GPU hardware samples and the window (host ops, Python frames, and on a
GPU kernels, memcpy and CUDA runtime calls) arrived, 1 when something is missing, 2 when
there is no CUDA device (``--cpu`` runs the same pipeline on the CPU, host metrics only, to test
this script without a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def _gpu_info() -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            info = {"name": pynvml.nvmlDeviceGetName(h), "driver": pynvml.nvmlSystemGetDriverVersion(),
                    "count": pynvml.nvmlDeviceGetCount()}
            try:
                info["architecture"] = pynvml.nvmlDeviceGetArchitecture(h)
                info["gpm_supported"] = bool(pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice)
            except Exception as e:
                info["gpm_supported"] = f"no ({type(e).__name__})"
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:
        info["nvml_error"] = f"{type(e).__name__}: {e}"
    return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in info.items()}


def _process_group(device: str) -> Any:
    """A one-rank process group (NCCL on a GPU, gloo on the CPU) with PyTorch's Flight Recorder on,
    as the tracer and ``rankscope run`` switch it on; its collectives are what ranks send."""
    import os
    import socket

    import torch.distributed as dist

    from rankscope.config import Settings
    from rankscope.producers.collective_log import enable_recorder

    enable_recorder(os.environ, Settings().coll_ring)
    with socket.socket() as s:     # not benchmarks._stack's: --record runs where confluent-kafka may be absent
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    return dist


def _collectives_sent(messages: list[bytes]) -> dict[str, Any]:
    """What the beats carried of the rank's collectives (their ``coll`` field)."""
    from rankscope.protocol.envelope import decode

    n = 0
    durations: list[int] = []
    ops: Counter[str] = Counter()
    states: dict[str, list[int]] = {}
    for raw in messages:
        env = decode(raw)
        for g in env.body.get("coll") or [] if env.kind == "beat" else []:
            n += len(g["seq"])
            durations += [d for d in g["dur_ns"] if d >= 0]
            ops.update(g["ops"][i] for i in g["op"])
            states[g["pg"]] = g["last"]
    return {"collectives": n, "timed": len(durations), "ops": dict(ops.most_common(5)), "last_state": states,
            "median_dur_us": round(statistics.median(durations) / 1e3, 1) if durations else None}


def _recorder_entries() -> dict[str, Any]:
    """How many entries each of PyTorch's recorders holds now, by group (what the ring size and the
    backend give), or why it could not be read."""
    import pickle

    from torch._C import _distributed_c10d as c10d

    from rankscope.producers.collective_log import RECORDERS

    out: dict[str, Any] = {}
    for name in RECORDERS:
        fn = getattr(c10d, name, None)
        if fn is None:
            out[name] = "absent in this torch"
            continue
        try:
            dump = pickle.loads(fn(includeCollectives=True, includeStackTraces=False, onlyActive=False))
            out[name] = dict(Counter(str((e.get("process_group") or ["?"])[0]) for e in dump.get("entries") or []))
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _read_cost(reads: int = 20) -> dict[str, Any]:
    """CPU per read of the recorders as the tracer reads them (a fresh reader, so each read builds
    every entry the rings hold)."""
    from rankscope.producers.collective_log import CollectiveLog

    cpu = []
    records = 0
    for _ in range(reads):
        log = CollectiveLog(1, ready=lambda: True)
        t0 = time.thread_time_ns()
        groups = log.read() or []
        cpu.append(time.thread_time_ns() - t0)
        records = sum(len(g["seq"]) for g in groups)
    return {"reads": reads, "records_per_read": records, "median_us_per_read": round(statistics.median(cpu) / 1e3, 1)}


def _train(tracer: Any, device: str, steps: int, batch: int, width: int, window_at: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())],
                                torch.nn.Linear(width, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    host_x = torch.randn(batch, width)
    host_y = torch.randint(0, 10, (batch,))
    if device == "cuda":
        host_x, host_y = host_x.pin_memory(), host_y.pin_memory()
    window: dict[str, Any] = {"requested": False}
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        x = host_x.to(device, non_blocking=True)      # H2D copy every step
        y = host_y.to(device, non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():
            if p.grad is not None and p.dim() == 2:
                dist.all_reduce(p.grad)           # a data-parallel rank's gradient all-reduce
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        tracer.step()
        times.append(time.perf_counter() - t0)
        if step == window_at:
            window = _request_window(tracer)
    return {"median_step_ms": round(statistics.median(times) * 1e3, 3), "steps": steps, "window": window}


def _request_window(tracer: Any) -> dict[str, Any]:
    try:
        import rankscope.producers.trace_window  # noqa: F401
    except ImportError:
        print("trace windows: not available in this build")
        return {"requested": False, "reason": "not available in this build"}
    windows = getattr(tracer, "windows", None)
    if windows is None:
        print("trace windows: not available in this build")
        return {"requested": False, "reason": "tracer has no windows"}
    rid = f"gpucheck-{uuid.uuid4().hex[:6]}"
    try:
        windows.handle("trace", rid, {"steps": 10, "lead_ns": 0}, None, time.time_ns())
        print(f"trace windows: requested {rid} (10 steps; hardware sampling goes to 0.1 s inside it)")
        return {"requested": True, "request_id": rid}
    except Exception as e:
        print(f"trace windows: request failed: {type(e).__name__}: {e}")
        return {"requested": False, "reason": f"{type(e).__name__}: {e}"}


def _wait_for_rows(store: Any, db: str, job: str, steps: int, timeout_s: float, window: bool = False) -> None:
    """Until the steps, the exit record, the window (when one was sent) and a stable count of
    hardware samples and trace events are in ClickHouse, or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last, stable = (-1, -1), 0

    def count(sql: str) -> int:
        return int(store.query_rows(sql.format(db=db), {"j": job})[0][0])

    while time.monotonic() < deadline:
        try:
            n_steps = count("SELECT count() FROM {db}.steps WHERE job = {{j:String}}")
            n_exit = count("SELECT count() FROM {db}.ranks FINAL WHERE job = {{j:String}} AND exit_reason != ''")
            n_windows = count("SELECT count() FROM {db}.trace_windows FINAL WHERE job = {{j:String}} "
                              "AND status != 'open'")
            now = (count("SELECT count() FROM {db}.hw_samples WHERE job = {{j:String}}"),
                   count("SELECT count() FROM {db}.trace_events WHERE job = {{j:String}}"))
        except Exception:
            n_steps = n_exit = n_windows = 0
            now = (-1, -1)
        stable = stable + 1 if now == last else 0
        last = now
        if n_steps >= steps and n_exit and (n_windows or not window) and stable >= 3:
            return
        time.sleep(0.5)


def _trace_report(store: Any, db: str, job: str) -> dict[str, Any]:
    """The trace window as stored: per category the events, distinct names, total time, bytes and the
    three functions with the most exclusive time; the windows and the per-function summary rows."""
    cats: dict[str, Any] = {}
    for cat, n, names, total, nbytes in store.query_rows(
            f"SELECT category, count(), uniqExact(name), sum(dur_ns), sum(bytes) FROM {db}.trace_events "
            f"WHERE job = {{j:String}} GROUP BY category ORDER BY category", {"j": job}):
        # Top functions by exclusive time (the summaries'): for Python call paths inclusive time would
        # name the script's outermost frames; the path's last frame is shown.
        top = store.query_rows(f"SELECT name, sum(exclusive_ns) AS t FROM {db}.function_summaries FINAL "
                               f"WHERE job = {{j:String}} AND category = {{c:String}} GROUP BY name "
                               f"ORDER BY t DESC LIMIT 3", {"j": job, "c": cat})
        cats[str(cat)] = {"events": int(n), "names": int(names), "total_ms": round(total / 1e6, 3),
                          "bytes": int(nbytes),
                          "top_exclusive": [[str(nm).rsplit(";", 1)[-1], round(t / 1e6, 3)] for nm, t in top]}
    windows = [{"window_id": w, "status": st, "steps": [int(a), int(b)], "events": int(e), "truncated": bool(tr)}
               for w, st, a, b, e, tr in store.query_rows(
                   f"SELECT window_id, status, first_step, last_step, events, truncated FROM {db}.trace_windows "
                   f"FINAL WHERE job = {{j:String}} ORDER BY window_id", {"j": job})]
    n_summaries = int(store.query_rows(f"SELECT count() FROM {db}.function_summaries FINAL WHERE job = {{j:String}}",
                                       {"j": job})[0][0])
    return {"categories": cats, "windows": windows, "function_summary_rows": n_summaries}


def _report(store: Any, db: str, job: str) -> tuple[dict[str, int], list[dict[str, Any]]]:
    tables = {}
    for (name,) in store.query_rows("SELECT name FROM system.tables WHERE database = {d:String} "
                                    "AND engine NOT LIKE '%View%' ORDER BY name", {"d": db}):
        tables[name] = int(store.query_rows(f"SELECT count() FROM {db}.`{name}`")[0][0])
    hw = [{"device": int(d), "metric": m, "n": int(n), "min": float(lo), "median": float(med), "max": float(hi)}
          for d, m, n, lo, med, hi in store.query_rows(
              f"SELECT device, metric, count(), min(value), quantile(0.5)(value), max(value) "
              f"FROM {db}.hw_samples WHERE job = {{j:String}} GROUP BY device, metric ORDER BY device, metric",
              {"j": job})]
    return tables, hw


class RecordingTransport:
    """A rank's transport that keeps every message (topic without the prefix, key, value) instead of
    sending it: the GPU machine has no broker, so ``--record`` keeps what the rank sent there and
    ``--replay`` sends it through a real broker, sink and store here."""

    dropped = 0

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.messages: list[tuple[str, bytes, bytes]] = []
        self._lock = threading.Lock()

    def send(self, topic: str, key: bytes, value: bytes) -> bool:
        with self._lock:
            self.messages.append((topic[len(self.prefix):], bytes(key), bytes(value)))
        return True

    def close(self, timeout_s: float = 0.0) -> None:
        pass


def _run_rank(settings: Any, device: str, args: argparse.Namespace, job: str,
              transport: Any = None) -> tuple[dict[str, Any], list[bytes]]:
    """Train under a Tracer (its own Kafka transport, or ``transport``); what the rank did and sent,
    and its beats."""
    from rankscope.producers.tracer import Tracer

    result: dict[str, Any] = {}
    dist = _process_group(device)
    tracer = Tracer(settings.with_overrides(job_id=job, rank=0, world_size=1, local_rank=0), transport=transport,
                    install_collective_timing=False, handle_signals=False)
    sent: Counter[str] = Counter()
    sent_bytes: Counter[str] = Counter()
    beats: list[bytes] = []
    tracer_transport = getattr(tracer, "transport", None)
    if tracer_transport is not None:
        orig_send = tracer_transport.send

        def counting_send(topic: str, key: bytes, value: bytes) -> bool:
            short = topic[len(settings.topic_prefix):]
            sent[short] += 1
            sent_bytes[short] += len(value)
            if short == "steps":
                beats.append(value)
            return orig_send(topic, key, value)

        tracer_transport.send = counting_send
    run_t0 = time.monotonic()
    result["train"] = _train(tracer, device, args.steps, args.batch, args.width, window_at=min(args.steps // 4, 50))
    if result["train"]["window"].get("requested"):
        time.sleep(3.0)   # let the window's background conversion and sending finish
    tracer.send_collective_dump("gpu-check", "gpu_check")   # as a hang asks
    result["recorders"] = _recorder_entries()
    result["read_cost"] = _read_cost()
    sampler = getattr(tracer, "hw_sampler", None)
    run_s = time.monotonic() - run_t0
    result["collective_reader_off"] = getattr(getattr(tracer, "_collectives", None), "off_reason", None)
    tracer.close()
    dist.destroy_process_group()
    result["sampler"] = sampler.stats() if sampler is not None else None
    windows = getattr(tracer, "windows", None)
    result["windows_done"] = getattr(windows, "windows_done", None)
    result["window_reader"] = "C++" if getattr(windows, "native_reader", False) else "Python"
    result["window_sender_cpu_ms"] = {k: round(v * 1e3, 2) for k, v in
                                      getattr(windows, "last_ship_cpu_stages", {}).items()}
    result["sent"] = {t: {"messages": sent[t], "bytes": sent_bytes[t],
                          "bytes_per_message": round(sent_bytes[t] / sent[t], 1)} for t in sorted(sent)}
    if sent["hw"]:
        result["hw_bytes_per_s"] = round(sent_bytes["hw"] / run_s, 1)
    return result, beats


def _stored(store: Any, job: str) -> dict[str, Any]:
    tables, hw = _report(store, store.database, job)
    dumps = store.query_rows(f"SELECT rank, length(dump), truncated FROM {store.database}.fr_dumps "
                             "WHERE job = {job:String}", parameters={"job": job})
    return {"tables": tables, "hw_samples": hw, "fr_dumps": [list(r) for r in dumps],
            "trace": _trace_report(store, store.database, job)}


def _with_store(settings: Any, job: str, steps: int, window: bool, feed: Any) -> dict[str, Any]:
    """Run the sink into a fresh chDB store on ``settings``' broker while ``feed()`` produces the
    job's messages; the feed's result plus what was stored."""
    from rankscope.storage.sink import Sink
    from rankscope.storage.store import close_store, open_store

    store = open_store(settings.store_dsn)
    sink = Sink(settings, store)
    stop = threading.Event()
    sink_thread = threading.Thread(target=sink.run, args=(stop,), name="gpu-check-sink", daemon=True)
    sink_thread.start()
    try:
        fed = feed()
        _wait_for_rows(store, store.database, job, steps, timeout_s=90,
                       window=window or bool(fed.get("train", {}).get("window", {}).get("requested")))
    finally:
        stop.set()
        sink_thread.join(30)
    out = {**fed, **_stored(store, job), "sink": sink.stats()}
    close_store(settings.store_dsn)
    return out


def _replay(settings: Any, messages: list[tuple[str, bytes, bytes]]) -> dict[str, Any]:
    """Produce recorded messages to their topics on the real broker, in order."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": settings.bootstrap, "compression.type": "zstd",
                         "partitioner": "murmur2_random", "linger.ms": 20})
    for short, key, value in messages:
        while True:
            try:
                producer.produce(settings.topic_prefix + short, value=value, key=key)
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
    left = producer.flush(60)
    if left:
        raise RuntimeError(f"replay: {left} messages not delivered")
    return {"replayed": len(messages)}


def _verdict(result: dict[str, Any], device: str, steps: int, stored: bool) -> list[str]:
    """What is missing: of what the rank sent (always), and of what the store holds (``stored``)."""
    problems: list[str] = []
    coll = result["collectives_sent"]
    enqueued = max((last[0] for last in coll["last_state"].values()), default=-1)
    if not coll["collectives"] or enqueued < steps:
        problems.append(f"beats carried {coll['collectives']} collective records and a last enqueued collective "
                        f"{enqueued} for {steps} steps of all-reduces (reader: {result.get('collective_reader_off') or 'on'})")
    if device == "cuda" and not coll["timed"]:
        problems.append("no collective carried a device duration (TORCH_NCCL_ENABLE_TIMING)")
    if not stored:
        if not result.get("sent", {}).get("replies", {}).get("messages"):
            problems.append("no Flight Recorder dump was sent")
        if result["train"]["window"].get("requested") and not result.get("sent", {}).get("traces"):
            problems.append("the trace window was not sent")
        return problems
    tables, hw = result["tables"], result["hw_samples"]
    if tables.get("steps", 0) < steps:
        problems.append(f"steps: {tables.get('steps', 0)} rows, expected {steps}")
    devices = {r["device"] for r in hw}
    if device == "cuda" and not any(d >= 0 for d in devices):
        problems.append("no GPU rows in hw_samples")
    if -1 not in devices:
        problems.append("no host rows (device -1) in hw_samples")
    trace = result["trace"]
    if result["train"]["window"].get("requested"):
        # What the window must hold: host ops and Python frames always; on a GPU also the kernels,
        # the per-step host->device copies and the CUDA runtime calls that launched them.
        # A torch before 2.13 lists no Python frames outside its KinetoEvents' newer fields.
        need = ["cpu_op"] + ([] if result.get("legacy_profiler_events") else ["python"]) + (
            ["kernel", "memcpy", "runtime"] if device == "cuda" else [])
        missing = [c for c in need if not trace["categories"].get(c, {}).get("events")]
        if not trace["windows"]:
            problems.append("no trace window in trace_windows")
        if missing:
            problems.append(f"trace window without {missing} events")
        if not trace["function_summary_rows"]:
            problems.append("no function_summaries rows for the window")
    if not result["fr_dumps"]:
        problems.append("no Flight Recorder dump in fr_dumps")
    return problems


def _print_rank(result: dict[str, Any]) -> None:
    coll = result["collectives_sent"]
    if result.get("sampler"):
        s = result["sampler"]
        print(f"\nsampler: {s['samples']} samples, {s['messages']} messages, GPU {s['gpu_us_per_sample']} us/sample "
              f"({s.get('gpu_cpu_us_per_sample')} us of CPU), "
              f"host {s['host_us_per_sample']} us/sample, GPU index {s['gpu_index']}")
    for t, v in result.get("sent", {}).items():
        print(f"sent {t:<10} {v['messages']:>6} messages {v['bytes']:>10} bytes ({v['bytes_per_message']} B/message)")
    if "hw_bytes_per_s" in result:
        print(f"hw bytes per second (this rank): {result['hw_bytes_per_s']}")
    print(f"collective records in beats: {coll['collectives']} ({coll['timed']} with device durations, "
          f"median {coll.get('median_dur_us')} us), ops {coll['ops']}, last enqueued/started/completed "
          f"{coll['last_state']}")
    print(f"entries per recorder and group at the end: {result.get('recorders')}; a read: {result.get('read_cost')}")
    print(f"trace windows done: {result.get('windows_done')} (reader: {result.get('window_reader')}, "
          f"sender CPU ms: {result.get('window_sender_cpu_ms')})")


def _print_stored(result: dict[str, Any]) -> None:
    tables, hw, trace = result["tables"], result["hw_samples"], result["trace"]
    print("\nrows per table:")
    for name, n in tables.items():
        print(f"  {name:<24}{n:>10}")
    print(f"\nhw_samples per device (-1 = host):\n  {'device':>6}  {'metric':<28}{'n':>5}{'min':>16}{'median':>16}{'max':>16}")
    for r in hw:
        print(f"  {r['device']:>6}  {r['metric']:<28}{r['n']:>5}{r['min']:>16.6g}{r['median']:>16.6g}{r['max']:>16.6g}")
    print(f"Flight Recorder dumps stored (rank, chars, truncated): {result['fr_dumps']}")
    for w in trace["windows"]:
        print(f"window {w['window_id']}: {w['status']}, steps {w['steps'][0]}-{w['steps'][1]}, {w['events']} events"
              + (", TRUNCATED" if w["truncated"] else ""))
    print(f"\ntrace_events per category ({trace['function_summary_rows']} function_summaries rows):")
    for cat, v in trace["categories"].items():
        top = ", ".join(f"{n[:48]} {ms} ms" for n, ms in v["top_exclusive"])
        print(f"  {cat:<11}{v['events']:>8} events {v['names']:>5} names {v['total_ms']:>10} ms "
              f"{v['bytes']:>12} B   top (exclusive): {top}")


def _finish(result: dict[str, Any], problems: list[str], out: Path) -> int:
    result["problems"] = problems
    result["ok"] = not problems
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"\n{'OK' if result['ok'] else 'PROBLEMS: ' + '; '.join(problems)}  (JSON: {out})")
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--cpu", action="store_true", help="run the pipeline on the CPU (no GPU needed; host metrics only)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--record", metavar="DIR", help="rank side only, no broker: keep what the rank sends in "
                      "DIR/messages.msgpack (for a GPU machine with no Kafka or ClickHouse)")
    mode.add_argument("--replay", metavar="DIR", help="send a --record run's messages through a real broker, "
                      "sink and chDB store here, and report what was stored")
    p.add_argument("--bootstrap", default="", metavar="HOST:PORT",
                   help="use this broker (fresh topics) instead of a throw-away local one")
    p.add_argument("--out", default=None, help="JSON result file (default benchmarks/results/gpu_check.json; "
                   "with --cpu a temp file)")
    args = p.parse_args(argv)
    import tempfile

    import msgpack

    out = Path(args.out or (Path(tempfile.gettempdir()) / "gpu_check_cpu.json" if args.cpu
                            else RESULTS / "gpu_check.json"))
    if args.replay:
        return _replay_main(Path(args.replay), out, args.bootstrap)

    import torch

    if args.cpu:
        device = "cpu"
        if args.batch == 8192 and args.width == 4096:
            args.batch, args.width = 256, 256
        print("gpu_check: --cpu: running on the CPU; no GPU metrics expected")
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False). This check needs a "
              "machine with an NVIDIA GPU and driver; `--cpu` runs the same pipeline without one.",
              file=sys.stderr)
        return 2
    else:
        device = "cuda"

    from rankscope.config import Settings

    gpu = _gpu_info() if device == "cuda" else {}
    if gpu:
        print(f"gpu_check: {gpu}")
    job = f"gpucheck-{uuid.uuid4().hex[:6]}"
    result: dict[str, Any] = {"name": "gpu_check", "device": device, "gpu": gpu, "job": job,
                              "torch": torch.__version__, "steps": args.steps,
                              "legacy_profiler_events": not hasattr(torch._C._autograd._KinetoEvent, "activity_type")}
    t_start = time.monotonic()
    if args.record:
        settings = Settings.from_env(topic_prefix="gpucheck.", bootstrap_servers="127.0.0.1:9", clickhouse_dsn="")
        recorder = RecordingTransport(settings.topic_prefix)
        rank, beats = _run_rank(settings, device, args, job, transport=recorder)
        result.update(rank, collectives_sent=_collectives_sent(beats), wall_s=round(time.monotonic() - t_start, 1))
        folder = Path(args.record)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "messages.msgpack").write_bytes(msgpack.packb([list(m) for m in recorder.messages]))
        (folder / "rank.json").write_text(json.dumps(result, indent=2, default=str))
        _print_rank(result)
        return _finish(result, _verdict(result, device, args.steps, stored=False), out)

    # Heavy imports in the main thread before any thread starts (FACTS: pandas import race).
    import clickhouse_connect  # noqa: F401
    import pandas  # noqa: F401
    import pyarrow  # noqa: F401

    from benchmarks._stack import local_stack

    with local_stack(processors=False, bootstrap=args.bootstrap) as settings:
        holder: dict[str, Any] = {}

        def feed() -> dict[str, Any]:
            rank, holder["beats"] = _run_rank(settings, device, args, job)
            return rank

        result.update(_with_store(settings, job, args.steps, False, feed))
    result["collectives_sent"] = _collectives_sent(holder["beats"])
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    print(f"\njob {job} on {device}: {result['train']['steps']} steps, median step "
          f"{result['train']['median_step_ms']} ms, wall {result['wall_s']} s")
    _print_stored(result)
    _print_rank(result)
    if device == "cuda" and not any(r["metric"].startswith("gpm_") for r in result["hw_samples"]):
        print("gpu_check: no GPM metrics (needs Hopper or newer and a recent driver)")
    return _finish(result, _verdict(result, device, args.steps, stored=True), out)


def _replay_main(folder: Path, out: Path, bootstrap: str = "") -> int:
    """``--replay``: a recorded run's messages through the broker, sink and store here."""
    import clickhouse_connect  # noqa: F401
    import msgpack
    import pandas  # noqa: F401
    import pyarrow  # noqa: F401

    from benchmarks._stack import local_stack

    rank = json.loads((folder / "rank.json").read_text())
    messages = [(str(t), bytes(k), bytes(v)) for t, k, v in msgpack.unpackb((folder / "messages.msgpack").read_bytes())]
    print(f"gpu_check --replay: {len(messages)} messages of job {rank['job']} recorded on {rank['device']} "
          f"({rank.get('gpu') or 'no GPU'}, torch {rank['torch']})")
    with local_stack(processors=False, bootstrap=bootstrap) as settings:
        stored = _with_store(settings, rank["job"], rank["steps"], bool(rank["train"]["window"].get("requested")),
                             lambda: _replay(settings, messages))
    result = {**rank, **stored, "recorded_on": rank["device"]}
    result.pop("problems", None)
    result.pop("ok", None)
    _print_stored(result)
    _print_rank(result)
    return _finish(result, _verdict(result, rank["device"], rank["steps"], stored=True), out)


if __name__ == "__main__":
    sys.exit(main())
