"""Load generator: one simulated training job of N ranks on the real wire format and real producers.

``python -m benchmarks.loadgen --ranks 10000 --duration 60 --procs 2 --job big [--wire v1|v2] [faults]``

A few processes (``--procs``), each simulating a contiguous block of ranks with ONE confluent-kafka
producer (linger ``--linger-ms``, lz4 or zstd), send what a job of that size sends:

- wire v2 (default): one ``beat`` per rank per heartbeat period on the steps topic, keyed
  :func:`rankscope.protocol.envelope.rank_key`: the step records since the last beat (columnar) plus the
  heartbeat fields; v1: a ``steps`` message (when there are new steps) and a ``heartbeat`` message,
  envelope ``v=1``, keyed by job (what ranks sent before schema version 2);
- one ``hw`` sample per rank per second on the hw topic (keyed by rank) with the metrics a rank of a
  Hopper node sends: 21 GPU metrics (13 with ``--no-gpm``) and, on local rank 0 of each 8-rank
  host, 9 host metrics; sent as the ranks send them: every ``hw_send_s`` (default 5 s) in one
  message, ranks staggered;
- optionally (``--profile-s S``) one ``profile`` per rank every S seconds on the profiles topic
  (keyed by rank), ranks staggered: the sampled call paths of a training rank at 20 Hz (24 call
  paths, 20-30 frames deep, about 4 KB: a GPU rank sent 3.4 KB; :func:`_profile_body`);
- optionally (``--summary-ranks K``) one trace-window ``summary`` from ranks 0..K-1 on the summaries
  topic (keyed by job), and (``--exit``) an ``exit`` record per live rank at the end.

SIGTERM ends the run early as if ``--duration`` had passed: the exit records are sent and the
summary printed, so a test can end a job once it has seen what it waits for.

Training model (synchronous): every rank steps together; a step lasts the longest busy time over
the ranks plus a fixed all-reduce cost; each rank's ``comm_ns`` is the step minus its own busy time
(the slowest rank waits least). Busy time: ``--busy-frac`` of the nominal step (1/``--steps-per-s``)
with Gaussian noise (``--noise``, relative). The whole timeline is computed up front from ``--seed``,
so every process agrees on it without talking to the others.

Faults (seconds from the start):

- ``--hang-at T --hang-rank R``: R completes no step ending after T (its beats go on: ``hb_step``
  frozen, ``since_step_s`` growing, and past ``stall_stack_min_s`` a stack whose innermost frame is
  ``train.py:20 hang_forever``); every other rank completes one more step (about a second later)
  and then waits in all_reduce (stacks ending in ``torch/distributed/distributed_c10d.py:2501 all_reduce``);
- ``--slow-at T --slow-rank R --slow-factor F``: R's busy time is F x from the first step starting
  at or after T (the whole job slows with it; R's comm wait shrinks);
- ``--dead-at T --dead-rank R``: R sends nothing from T on (no exit record); the others go on.

Beats are scheduled by the wall clock: rank r's beats are due at ``t0 + p * heartbeat_s + phase_r``
(phases spread over the period), and each process sends whatever is due every few milliseconds, so
a process that falls behind catches up and its lateness is measured (``lateness_p99_s``).

Prints one JSON line: messages sent per kind, send rates, lateness, CPU per process and the faults
planted (wall ns). :func:`run` is the same from Python.
"""

from __future__ import annotations

import argparse
import bisect
import json
import multiprocessing as mp
import os
import queue
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from msgpack import Packer
from msgpack import packb as _packb

from rankscope.config import Settings
from rankscope.kafka_client import client_conf
from rankscope.protocol.envelope import Envelope, encode, rank_key
from rankscope.topics import Topic

NEVER = 2**62
HANG_FRAMES = ["train.py:88 <module>", "train.py:64 main", "train.py:20 hang_forever"]
WAIT_FRAMES = ["train.py:88 <module>", "train.py:64 main", "train.py:41 train_step",
               "torch/distributed/c10d_logger.py:83 wrapper", "torch/distributed/distributed_c10d.py:2501 all_reduce"]
COMM_FLOOR_FRAC = 0.05   # the all-reduce after the last rank arrives, as a share of the nominal step
PID_BASE = 100_000


@dataclass(frozen=True)
class LoadConfig:
    ranks: int = 64
    duration_s: float = 30.0
    procs: int = 2
    job: str = "loadgen"
    wire: str = "v2"
    steps_per_s: float = 1.0
    busy_frac: float = 0.8
    noise: float = 0.03
    hang_at: float | None = None
    hang_rank: int = -1
    slow_at: float | None = None
    slow_rank: int = -1
    slow_factor: float = 1.5
    dead_at: float | None = None
    dead_rank: int = -1
    exit: bool = False
    hw: bool = True
    gpm: bool = True
    summary_ranks: int = 0
    summary_at: float | None = None
    profile_s: float = 0.0
    compression: str = "lz4"
    linger_ms: int = 30
    seed: int = 0
    tick_s: float = 0.005

    def validate(self) -> None:
        if self.ranks < 1 or self.procs < 1 or self.duration_s <= 0 or self.steps_per_s <= 0:
            raise ValueError("ranks, procs, duration and steps/s must be positive")
        if self.wire not in ("v1", "v2"):
            raise ValueError(f"--wire must be v1 or v2, got {self.wire!r}")
        for name in ("hang", "slow", "dead"):
            at, rank = getattr(self, f"{name}_at"), getattr(self, f"{name}_rank")
            if at is not None and not 0 <= rank < self.ranks:
                raise ValueError(f"--{name}-rank must be in [0, {self.ranks}) when --{name}-at is given")


class Plan:
    """The job's whole timeline, relative to t0 (ns): step start/end, each rank's comm wait per step,
    and when each rank stops stepping. Deterministic in the config (every process builds the same)."""

    def __init__(self, cfg: LoadConfig) -> None:
        n = cfg.ranks
        period = 1.0 / cfg.steps_per_s
        busy_base, comm_floor = cfg.busy_frac * period, COMM_FLOOR_FRAC * period
        horizon_ns = int((cfg.duration_s + 2) * 1e9)
        max_steps = int((cfg.duration_s + 2) * cfg.steps_per_s / (cfg.busy_frac + COMM_FLOOR_FRAC) * 1.1) + 8
        rng = np.random.default_rng(cfg.seed)
        noise = np.clip(rng.normal(0.0, cfg.noise, (max_steps, n)), -4 * cfg.noise, 4 * cfg.noise)
        slow_ns = NEVER if cfg.slow_at is None else int(cfg.slow_at * 1e9)
        dead_ns = NEVER if cfg.dead_at is None else int(cfg.dead_at * 1e9)
        starts, ends, comms = [], [], []
        self.first_slow_step = -1
        t = 0
        for k in range(max_steps):
            if t > horizon_ns:
                break
            busy = busy_base * (1.0 + noise[k])
            if t >= slow_ns:
                busy[cfg.slow_rank] *= cfg.slow_factor
                if self.first_slow_step < 0:
                    self.first_slow_step = k
            live = busy
            if t >= dead_ns:   # the dead rank no longer takes part; the others go on without it
                live = np.delete(busy, cfg.dead_rank)
            dur = float(live.max()) + comm_floor
            starts.append(t)
            t += int(dur * 1e9)
            ends.append(t)
            comms.append(np.maximum(0, ((dur - busy) * 1e9)).astype(np.int64))
        self.start_ns: list[int] = starts
        self.end_ns: list[int] = ends
        self.comm_ns = np.vstack(comms)                        # [step, rank]
        freeze = np.full(n, NEVER, dtype=np.int64)             # last wall time (rel ns) a rank may end a step
        self.hang_last_step = -1
        if cfg.hang_at is not None:
            h = bisect.bisect_right(ends, int(cfg.hang_at * 1e9)) - 1   # the culprit's last completed step
            self.hang_last_step = h
            freeze[:] = ends[h + 1] if h + 1 < len(ends) else NEVER      # the others: one more step
            freeze[cfg.hang_rank] = ends[h] if h >= 0 else -1
        if cfg.dead_at is not None:
            freeze[cfg.dead_rank] = min(int(freeze[cfg.dead_rank]), dead_ns)
        self.freeze_ns = freeze
        self.dead_ns = dead_ns

    def last_step(self, rank: int, rel_ns: int) -> int:
        """The last step ``rank`` has completed at ``rel_ns`` (-1: none yet)."""
        return bisect.bisect_right(self.end_ns, min(rel_ns, int(self.freeze_ns[rank]))) - 1


def fault_summary(cfg: LoadConfig, plan: Plan, t0_ns: int) -> dict[str, Any]:
    """The faults planted, in wall ns (what a benchmark compares alerts with)."""
    out: dict[str, Any] = {}
    if cfg.hang_at is not None:
        h = plan.hang_last_step
        out["hang"] = {"rank": cfg.hang_rank, "at_ns": t0_ns + int(cfg.hang_at * 1e9), "last_step": h,
                       "last_step_end_ns": t0_ns + (plan.end_ns[h] if h >= 0 else 0),
                       "others_last_step": h + 1,
                       "others_last_step_end_ns": t0_ns + plan.end_ns[min(h + 1, len(plan.end_ns) - 1)]}
    if cfg.slow_at is not None:
        k = plan.first_slow_step
        out["slow"] = {"rank": cfg.slow_rank, "at_ns": t0_ns + int(cfg.slow_at * 1e9), "factor": cfg.slow_factor,
                       "first_slow_step": k, "first_slow_step_start_ns": t0_ns + plan.start_ns[k] if k >= 0 else 0}
    if cfg.dead_at is not None:
        out["dead"] = {"rank": cfg.dead_rank, "at_ns": t0_ns + plan.dead_ns,
                       "last_step": plan.last_step(cfg.dead_rank, plan.dead_ns)}
    return out


# ------------------------------------------------------------------------------------------------
# One sending process
# ------------------------------------------------------------------------------------------------

def _profile_body(t1_ns: int, interval_s: float, hz: float = 20.0, paths: int = 24) -> dict[str, Any]:
    """One interval of a training rank's sampled stacks (rankscope/protocol/profile.py): ``paths``
    call paths 20-30 frames deep under one training loop, the samples spread over them."""
    names = [f"torch/nn/modules/m{i}.py:{10 + i} Module{i}.forward" for i in range(40)]
    names[:3] = ["train.py:1 <module>", "train.py:80 main", "train.py:40 train_step"]
    table: list[list[int]] = [[-1, 0], [0, 1], [1, 2]]
    leaves = []
    for p in range(paths):
        parent = 2
        for depth in range(17 + p % 11):
            table.append([parent, 3 + (p * 7 + depth * 3) % 37])
            parent = len(table) - 1
        leaves.append(parent)
    ticks = int(hz * interval_s)
    counts = [max(1, ticks // (2 + i)) for i in range(paths)]
    return {"t0_ns": t1_ns - int(interval_s * 1e9), "t1_ns": t1_ns, "hz": hz, "ticks": ticks,
            "roles": ["training", "other"], "names": names, "paths": table, "path": leaves, "role": [0] * paths,
            "count": counts, "other": [0, ticks]}


def _hw_body(now_ns: int, local_rank: int, running: bool, samples: int = 1, period_ns: int = 10**9,
             gpm: bool = True) -> dict[str, Any]:
    """``samples`` samples ``period_ns`` apart, the last one at ``now_ns``, with the metrics a rank of
    an NVIDIA Hopper node sends (producers/hw_gpu.py: 13 NVML metrics, 8 GPM ones with ``gpm``) and,
    on local rank 0, the host's (producers/hw_host.py: 9 metrics) as one more entry per sample
    (device -1)."""
    u = [90.0 + 8.0 * random.random() if running else 0.0 for _ in range(samples)]
    ts = [now_ns - (samples - 1 - i) * period_ns for i in range(samples)]
    gpu: dict[str, list[Any]] = {
        "gpu_util": u, "mem_util": [x * 0.6 for x in u], "mem_used_bytes": [61_000_000_000] * samples,
        "mem_total_bytes": [85_520_809_984] * samples, "power_w": [150.0 + 5.5 * x for x in u],
        "temp_c": [40.0 + 0.3 * x for x in u], "sm_clock_mhz": [1980.0] * samples,
        "throttle_reasons": [0.0] * samples, "ecc_uncorrected_volatile": [0] * samples,
        "pcie_tx_kbps": [2_000.0 + 10.0 * x for x in u], "pcie_rx_kbps": [3_000.0 + 10.0 * x for x in u],
        "nvlink_tx_kbps": [4.0e6 * x / 100 for x in u], "nvlink_rx_kbps": [4.1e6 * x / 100 for x in u]}
    if gpm:
        gpu |= {"gpm_sm_active_pct": [0.9 * x for x in u], "gpm_sm_occupancy_pct": [0.5 * x for x in u],
                "gpm_tensor_active_pct": [0.6 * x for x in u], "gpm_dram_bw_pct": [0.4 * x for x in u],
                "gpm_pcie_tx_mibps": [2.0 * x for x in u], "gpm_pcie_rx_mibps": [3.0 * x for x in u],
                "gpm_nvlink_tx_mibps": [40.0 * x for x in u], "gpm_nvlink_rx_mibps": [41.0 * x for x in u]}
    if local_rank != 0:
        return {"ts_ns": ts, "device": [local_rank] * samples, "metrics": gpu}
    # Local rank 0: each sample is a GPU entry then a host entry; a metric absent from an entry is None.
    none = [None] * samples
    host: dict[str, list[Any]] = {
        "cpu_util": [30.0 + 0.1 * x for x in u], "mem_used_bytes": [900_000_000_000] * samples,
        "mem_total_bytes": [2_000_000_000_000] * samples, "net_tx_bytes_s": [5.0e7] * samples,
        "net_rx_bytes_s": [6.0e7] * samples, "disk_read_bytes_s": [1.0e8] * samples,
        "disk_write_bytes_s": [1.0e6] * samples, "cpu_util_core_max": [100.0] * samples,
        "cpu_cores_busy": [9.0] * samples}
    metrics: dict[str, list[Any]] = {}
    for name in gpu.keys() | host.keys():
        g, h = gpu.get(name, none), host.get(name, none)
        metrics[name] = [v for pair in zip(g, h, strict=True) for v in pair]
    return {"ts_ns": [t for t in ts for _ in (0, 1)], "device": [local_rank, -1] * samples, "metrics": metrics}


def _summary_body(cfg: LoadConfig, plan: Plan, t0_ns: int, step: int) -> dict[str, Any]:
    step = max(step, 2)
    start, end = t0_ns + plan.start_ns[step - 2], t0_ns + plan.end_ns[step]
    w = end - start
    cats = ["kernel", "kernel", "collective", "memcpy", "runtime", "python"]
    names = ["sm90_xmma_gemm_bf16", "vectorized_elementwise_kernel", "ncclDevKernel_AllReduce_Sum_bf16",
             "Memcpy HtoD", "cudaLaunchKernel", "train.py:41 train_step"]
    share = [0.55, 0.12, 0.10, 0.02, 0.03, 0.05]
    tot = [int(s * w) for s in share]
    cnt = [300, 900, 24, 6, 1500, 3]
    return {"window_id": f"{cfg.job}-lg-w1", "first_step": step - 2, "last_step": step, "start_ns": start,
            "end_ns": end, "events_total": sum(cnt), "events_sent": sum(cnt), "truncated": False, "status": "complete",
            "request_id": "", "request_ranks": list(range(min(cfg.summary_ranks, cfg.ranks))), "own_events_dropped": 0,
            "arrivals": {"name": [], "seq": [], "start_ns": []},
            "functions": {"category": cats, "name": names, "count": cnt, "total_ns": tot,
                          "median_ns": [t // c for t, c in zip(tot, cnt, strict=True)],
                          "p95_ns": [2 * t // c for t, c in zip(tot, cnt, strict=True)],
                          "max_ns": [3 * t // c for t, c in zip(tot, cnt, strict=True)],
                          "exclusive_ns": [int(t * 0.9) for t in tot], "window_ns": w}}


def _worker(cfg: LoadConfig, settings_env: dict[str, str], lo: int, hi: int, index: int,
            ready: Any, start: Any, results: Any, stop: Any) -> None:
    from confluent_kafka import Producer

    settings = Settings.from_env(settings_env)
    plan = Plan(cfg)
    v = 2 if cfg.wire == "v2" else 1
    steps_topic, hw_topic = Topic.STEPS.name_for(settings), Topic.HW.name_for(settings)
    summaries_topic = Topic.SUMMARIES.name_for(settings)
    job_key = cfg.job.encode()
    errors = Counter()

    def on_error(err: Any) -> None:
        errors[f"client:{err.name() if hasattr(err, 'name') else err}"] += 1

    def on_delivery(err: Any, msg: Any) -> None:
        if err is not None:
            errors["delivery"] += 1

    producer = Producer({**client_conf(settings), "linger.ms": cfg.linger_ms,
                         "compression.type": cfg.compression, "queue.buffering.max.messages": 2_000_000,
                         "queue.buffering.max.kbytes": 1_048_576, "batch.size": 1_000_000,
                         "client.id": f"loadgen-{index}", "error_cb": on_error})
    producer.list_topics(timeout=30)   # connected before the clock starts
    ranks = list(range(lo, hi))
    phase_rng = random.Random(cfg.seed * 7919 + 1)
    phases = [phase_rng.random() for _ in range(cfg.ranks)][lo:hi]   # same phase for a rank in any split
    hb_s = settings.heartbeat_s
    hb_ns = int(hb_s * 1e9)
    hw_every = max(1, round(settings.hw_send_s / hb_s))
    hw_beats = dict.fromkeys(ranks, 0)
    profiles_topic = Topic.PROFILES.name_for(settings)
    profile_every = max(1, round(cfg.profile_s / hb_s)) if cfg.profile_s > 0 else 0
    profile_beats = dict.fromkeys(ranks, 0)
    profile_template = _profile_body(0, cfg.profile_s) if profile_every else {}
    order = sorted(range(len(ranks)), key=lambda i: phases[i])
    sched_rel = [phases[i] * hb_s for i in order]
    order_rank = [ranks[i] for i in order]
    seq = dict.fromkeys(ranks, 0)
    reported = dict.fromkeys(ranks, -1)
    keys = {r: rank_key(cfg.job, r) for r in ranks}
    hosts = {r: f"node{r // 8}" for r in ranks}
    comm = plan.comm_ns
    start_list, end_list = plan.start_ns, plan.end_ns
    stall_s = settings.stall_stack_min_s
    hang_rank = cfg.hang_rank if cfg.hang_at is not None else -2
    dead_rank = cfg.dead_rank if cfg.dead_at is not None else -2
    sent = Counter()
    nbytes = 0
    max_bytes = 0
    queue_full = 0
    lateness: list[float] = []
    dead_last_sent_ns = 0

    def produce(topic: str, key: bytes, env: Envelope | dict[str, Any]) -> None:
        # The high-rate messages (beats, heartbeats, steps, hw samples) are built here as envelope
        # dicts or bytes and packed as wire.encode packs them, without its schema check: the simulated
        # ranks send millions of them, and their CPU shares the machine with the stack being measured.
        # The tests decode what the generator sends (tests/benchmarks_loadgen).
        if isinstance(env, Envelope):
            send(topic, key, env.kind, encode(env))
        else:
            send(topic, key, env["kind"], _packb(env, use_bin_type=True))

    def send(topic: str, key: bytes, kind: str, data: bytes) -> None:
        nonlocal nbytes, max_bytes, queue_full
        while True:
            try:
                producer.produce(topic, data, key, on_delivery=on_delivery)
                break
            except BufferError:
                queue_full += 1
                producer.poll(0.05)
        sent[kind] += 1
        n = len(data)
        nbytes += n
        if n > max_bytes:
            max_bytes = n

    def envelope(kind: str, r: int, now_ns: int, body: dict[str, Any]) -> Envelope:
        seq[r] += 1
        return Envelope(kind=kind, job=cfg.job, rank=r, host=hosts[r], pid=PID_BASE + r, seq=seq[r],
                        sent_ns=now_ns, body=body, v=v)

    def packed_envelope(kind: str, r: int, now_ns: int, body: dict[str, Any]) -> dict[str, Any]:
        """The same envelope as :func:`envelope`, as the dict that wire.encode packs."""
        seq[r] += 1
        return {"v": v, "kind": kind, "job": cfg.job, "rank": r, "host": hosts[r], "pid": PID_BASE + r,
                "seq": seq[r], "sent_ns": now_ns, "body": body}

    # A v2 beat is packed from bytes fixed per rank (the envelope's first six fields, in the order
    # wire.encode packs them) and the packed seq, send time and body: the same message for less CPU.
    beat_prefix = {r: b"\x89" + _packb({"v": v, "kind": "beat", "job": cfg.job, "rank": r, "host": hosts[r],
                                          "pid": PID_BASE + r}, use_bin_type=True)[1:] for r in ranks}
    pack = Packer(use_bin_type=True).pack
    k_seq, k_sent, k_body = pack("seq"), pack("sent_ns"), pack("body")
    comm_of = dict(zip(ranks, comm[:, lo:hi].T.tolist(), strict=True))   # rank -> comm_ns per step
    freeze_of = dict(zip(ranks, plan.freeze_ns[lo:hi].tolist(), strict=True))
    bisect_right = bisect.bisect_right

    def beat(r: int, now_ns: int, t0_ns: int) -> None:
        rel = now_ns - t0_ns
        k = bisect_right(end_list, min(rel, freeze_of[r])) - 1   # plan.last_step(r, rel)
        a = reported[r] + 1
        if k >= a:
            reported[r] = k
            steps, starts = list(range(a, k + 1)), [t0_ns + x for x in start_list[a:k + 1]]
            ends, comms = [t0_ns + x for x in end_list[a:k + 1]], comm_of[r][a:k + 1]
        else:
            steps, starts, ends, comms = [], [], [], []
        since = (rel - end_list[k]) / 1e9 if k >= 0 else rel / 1e9
        if since < 0.0:
            since = 0.0
        stacks = None
        if since > stall_s and rel >= freeze_of[r] and cfg.hang_at is not None:
            stacks = [{"thread": "MainThread", "frames": list(HANG_FRAMES if r == hang_rank else WAIT_FRAMES)}]
        since = round(since, 3)
        if v == 2:
            seq[r] += 1
            body = {"step": steps, "start_ns": starts, "end_ns": ends, "comm_ns": comms, "hb_step": k,
                    "since_step_s": since, "dropped": 0, "world_size": cfg.ranks, "local_rank": r % 8,
                    "stacks": stacks, "cpu": [rel // 2, rel // 20]}   # its training thread: 50% on a CPU, 5% waiting
            send(steps_topic, keys[r], "beat",
                 beat_prefix[r] + k_seq + pack(seq[r]) + k_sent + pack(now_ns) + k_body + pack(body))
        else:
            hb = {"since_step_s": since, "dropped": 0, "world_size": cfg.ranks, "local_rank": r % 8,
                  "stacks": stacks}
            if steps:
                produce(steps_topic, job_key, packed_envelope(
                    "steps", r, now_ns, {"step": steps, "start_ns": starts, "end_ns": ends, "comm_ns": comms}))
            produce(steps_topic, job_key, packed_envelope("heartbeat", r, now_ns, {"step": k, **hb}))
        if cfg.hw:
            # A sample every beat, sent every hw_every beats (the rank's hw_send_s), ranks staggered.
            hw_beats[r] += 1
            if (hw_beats[r] + r) % hw_every == 0:
                body = _hw_body(now_ns, r % 8, since < stall_s, min(hw_every, hw_beats[r]), hb_ns,
                                cfg.gpm)
                produce(hw_topic, keys[r], packed_envelope("hw", r, now_ns, body))
        if profile_every:
            profile_beats[r] += 1
            if (profile_beats[r] + 3 * r) % profile_every == 0:
                body = {**profile_template, "t0_ns": now_ns - int(cfg.profile_s * 1e9), "t1_ns": now_ns}
                produce(profiles_topic, keys[r], packed_envelope("profile", r, now_ns, body))

    cpu0 = time.process_time()
    ready.put(index)
    t0_ns = start.get()
    end_rel_s = cfg.duration_s
    summary_at = cfg.summary_at if cfg.summary_at is not None else cfg.duration_s / 2
    summary_todo = [r for r in ranks if r < cfg.summary_ranks]
    period, ptr, n = 0, 0, len(order_rank)
    while n:
        now_ns = time.time_ns()
        rel_s = (now_ns - t0_ns) / 1e9
        if rel_s >= end_rel_s or stop.is_set():
            break
        worst = 0.0
        while True:
            due = period * hb_s + sched_rel[ptr]
            if due > rel_s:
                break
            r = order_rank[ptr]
            if r == dead_rank and now_ns - t0_ns >= plan.dead_ns:
                pass   # a dead rank sends nothing
            else:
                beat(r, now_ns, t0_ns)
                if r == dead_rank:
                    dead_last_sent_ns = now_ns
            worst = max(worst, rel_s - due)
            lateness.append(rel_s - due)
            ptr += 1
            if ptr == n:
                ptr, period = 0, period + 1
        if summary_todo and rel_s >= summary_at:
            for r in summary_todo:
                if r != dead_rank or rel_s * 1e9 < plan.dead_ns:
                    body = _summary_body(cfg, plan, t0_ns, plan.last_step(r, now_ns - t0_ns))
                    produce(summaries_topic, job_key, envelope("summary", r, now_ns, body))
            summary_todo = []
        producer.poll(0)
        next_due = period * hb_s + sched_rel[ptr]
        wait = min(cfg.tick_s, next_due - (time.time_ns() - t0_ns) / 1e9)
        if wait > 0:
            time.sleep(wait)
    loop_end_ns = time.time_ns()
    if cfg.exit:
        for r in ranks:
            if r == dead_rank:
                continue
            k = plan.last_step(r, loop_end_ns - t0_ns)
            key = keys[r] if v == 2 else job_key
            produce(steps_topic, key, envelope("exit", r, time.time_ns(), {"step": k, "reason": "completed",
                                                                           "detail": ""}))
    unflushed = producer.flush(60)
    lat = np.asarray(lateness, dtype=np.float64) if lateness else np.zeros(1)
    results.put({"proc": index, "ranks": [lo, hi], "messages": dict(sent), "bytes": nbytes,
                 "max_message_bytes": max_bytes, "loop_end_ns": loop_end_ns,
                 "lateness_p50_s": float(np.percentile(lat, 50)), "lateness_p99_s": float(np.percentile(lat, 99)),
                 "lateness_max_s": float(lat.max()), "cpu_s": time.process_time() - cpu0,
                 "queue_full_retries": queue_full, "unflushed": unflushed, "errors": dict(errors),
                 "dead_last_sent_ns": dead_last_sent_ns})


# ------------------------------------------------------------------------------------------------
# The coordinator
# ------------------------------------------------------------------------------------------------

def run(cfg: LoadConfig, settings: Settings | None = None, start_lead_s: float = 0.5) -> dict[str, Any]:
    """Run the load (blocks for about ``cfg.duration_s``) and return the summary printed by the CLI."""
    cfg.validate()
    settings = settings or Settings.from_env()
    ctx = mp.get_context("spawn")   # a fresh interpreter: no librdkafka state inherited from the caller
    ready, results = ctx.Queue(), ctx.Queue()
    procs_n = min(cfg.procs, cfg.ranks)
    bounds = [cfg.ranks * i // procs_n for i in range(procs_n + 1)]
    starts = [ctx.Queue() for _ in range(procs_n)]
    stop = ctx.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    env = settings.to_env()
    procs = [ctx.Process(target=_worker, args=(cfg, env, bounds[i], bounds[i + 1], i, ready, starts[i], results, stop),
                         name=f"loadgen-{i}", daemon=True) for i in range(procs_n)]
    for p in procs:
        p.start()
    plan = Plan(cfg)
    try:
        for _ in procs:
            while True:
                try:
                    ready.get(timeout=1.0)
                    break
                except queue.Empty:
                    if any(p.exitcode not in (None, 0) for p in procs):
                        raise RuntimeError("a loadgen process failed to start") from None
        t0_ns = time.time_ns() + int(start_lead_s * 1e9)
        for q in starts:
            q.put(t0_ns)
        per: list[dict[str, Any]] = []
        deadline = time.monotonic() + cfg.duration_s + start_lead_s + 120
        while len(per) < len(procs):
            try:
                per.append(results.get(timeout=1.0))
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"loadgen processes failed: exit codes {[p.exitcode for p in procs]}") from None
        for p in procs:
            p.join(30)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for p in procs:
            if p.is_alive():
                p.terminate()
    per.sort(key=lambda d: d["proc"])
    messages = Counter()
    for d in per:
        messages.update(d["messages"])
    wall_s = (max(d["loop_end_ns"] for d in per) - t0_ns) / 1e9
    steps_kinds = ("beat", "steps", "heartbeat")
    steps_msgs = sum(messages[k] for k in steps_kinds)
    looping = sum(messages[k] for k in (*steps_kinds, "hw", "summary"))
    faults = fault_summary(cfg, plan, t0_ns)
    if "dead" in faults:
        faults["dead"]["last_sent_ns"] = max(d["dead_last_sent_ns"] for d in per)
    return {"config": asdict(cfg), "t0_ns": t0_ns, "end_ns": t0_ns + int(wall_s * 1e9), "wall_s": round(wall_s, 3),
            "messages": dict(messages), "messages_total": sum(messages.values()),
            "bytes_total": sum(d["bytes"] for d in per),
            "max_message_bytes": max(d["max_message_bytes"] for d in per),
            "send_rate_msgs_s": round(looping / wall_s, 1), "steps_topic_rate_msgs_s": round(steps_msgs / wall_s, 1),
            "expected_steps_topic_rate_msgs_s": round(cfg.ranks / settings.heartbeat_s * (1 if cfg.wire == "v2" else 2), 1),
            "lateness_p99_s": max(d["lateness_p99_s"] for d in per),
            "lateness_max_s": max(d["lateness_max_s"] for d in per),
            "kept_up": all(d["lateness_p99_s"] < 0.25 for d in per) and not any(d["unflushed"] for d in per),
            "cpu_s": [round(d["cpu_s"], 2) for d in per], "unflushed": sum(d["unflushed"] for d in per),
            "queue_full_retries": sum(d["queue_full_retries"] for d in per),
            "errors": dict(sum((Counter(d["errors"]) for d in per), Counter())),
            "hw_rows_per_s": round(hw_rows_per_s(cfg, settings.heartbeat_s), 1),
            "steps_planned": len(plan.end_ns), "faults": faults}


def hw_rows_per_s(cfg: LoadConfig, heartbeat_s: float) -> float:
    """``hw_samples`` rows the job's hardware samples make per second (one sample per rank per beat)."""
    if not cfg.hw:
        return 0.0
    def rows(local_rank: int) -> int:   # of one sample
        body = _hw_body(0, local_rank, True, gpm=cfg.gpm)
        return sum(v is not None for values in body["metrics"].values() for v in values)

    hosts = len(range(0, cfg.ranks, 8))
    return ((cfg.ranks - hosts) * rows(1) + hosts * rows(0)) / heartbeat_s


def parse_args(argv: list[str] | None = None) -> LoadConfig:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    p.add_argument("--procs", type=int, default=2, help="sending processes (one producer each)")
    p.add_argument("--job", default=f"loadgen-{os.getpid()}")
    p.add_argument("--wire", choices=("v1", "v2"), default="v2")
    p.add_argument("--steps-per-s", type=float, default=1.0)
    p.add_argument("--busy-frac", type=float, default=0.8, help="healthy busy time / nominal step")
    p.add_argument("--noise", type=float, default=0.03, help="relative sd of busy time")
    for name in ("hang", "slow", "dead"):
        p.add_argument(f"--{name}-at", type=float, default=None, help="seconds from the start")
        p.add_argument(f"--{name}-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=float, default=1.5)
    p.add_argument("--exit", action="store_true", help="send exit records (completed) at the end")
    p.add_argument("--no-hw", dest="hw", action="store_false", help="no hardware samples")
    p.add_argument("--no-gpm", dest="gpm", action="store_false", help="GPU samples without GPM metrics (pre-Hopper)")
    p.add_argument("--summary-ranks", type=int, default=0, help="ranks 0..K-1 send one trace-window summary")
    p.add_argument("--profile-s", type=float, default=0.0, help="each rank sends a profile this often (0: none)")
    p.add_argument("--summary-at", type=float, default=None, help="when (default: half-way)")
    p.add_argument("--compression", choices=("lz4", "zstd", "none", "snappy", "gzip"), default="lz4")
    p.add_argument("--linger-ms", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    cfg = LoadConfig(ranks=a.ranks, duration_s=a.duration, procs=a.procs, job=a.job, wire=a.wire,
                     steps_per_s=a.steps_per_s, busy_frac=a.busy_frac, noise=a.noise, hang_at=a.hang_at,
                     hang_rank=a.hang_rank, slow_at=a.slow_at, slow_rank=a.slow_rank, slow_factor=a.slow_factor,
                     dead_at=a.dead_at, dead_rank=a.dead_rank, exit=a.exit, hw=a.hw, gpm=a.gpm,
                     summary_ranks=a.summary_ranks, profile_s=a.profile_s,
                     summary_at=a.summary_at, compression=a.compression, linger_ms=a.linger_ms, seed=a.seed)
    try:
        cfg.validate()
    except ValueError as e:
        p.error(str(e))
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    out = run(cfg)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
