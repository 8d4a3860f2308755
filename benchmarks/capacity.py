"""Capacity of the processors' first stage: how many ranks one worker carries, and two.

``python -m benchmarks.capacity [--ranks 10000] [--seconds 40] [--workers 1,2]`` (``make bench``
runs it as ``capacity``; JSON in benchmarks/results/capacity.json).

A backlog is written first, with no processors running: the load generator (benchmarks/loadgen.py)
sends ``seconds`` of one job of ``ranks`` simulated ranks at 1 beat per rank per second (the real
v2 wire format through real producers). Then ``workers`` x ``rankscope processors`` start on it
(one consumer group, fresh per configuration), and the drain is timed from the first committed
offset of the folding group to the moment its committed offsets reach the end of every partition
of the steps topic; the rate is taken between 20% and 90% of the backlog (past start-up and the
group's rebalance). Measured, per worker count:

- drain rate in messages/s; at one beat per rank per second that is the number of ranks the
  workers carry with no lag (each beat carries a rank's steps and heartbeat);
- CPU of every worker during the drain (psutil), in µs per message;
- the speed-up of two workers over one.

The rebuild a worker makes of the partitions it takes (reading their last ``rebuild_horizon_s``)
is set to 1 s here, so the drain measures folding, not re-reading. All on this machine: the broker
and the workers share its cores, so the speed-up is bounded by what the broker leaves free.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from benchmarks._stack import env_for, local_stack
from rankscope.admin import admin_client, ensure_topics
from rankscope.config import Settings
from rankscope.stream_processors.app import app_id
from rankscope.topics import Topic

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RANKS = 10_000
DEFAULT_SECONDS = 40.0
DEFAULT_WORKERS = (1, 2)
DRAIN_TIMEOUT_S = 600.0
FROM_FRAC, TO_FRAC = 0.2, 0.9


def end_offsets(settings: Settings) -> dict[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    topic = Topic.STEPS.name_for(settings)
    c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"capacity-{uuid.uuid4().hex[:6]}"})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
    finally:
        c.close()


def committed(admin: Any, group: str, topic: str, parts: list[int]) -> dict[int, int]:
    from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition

    req = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, p) for p in parts])
    try:
        res = admin.list_consumer_group_offsets([req], request_timeout=5)[group].result(10)
    except Exception:
        return {}
    return {tp.partition: max(tp.offset, 0) for tp in res.topic_partitions}


def write_backlog(settings: Settings, job: str, ranks: int, seconds: float, work: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.loadgen", "--ranks", str(ranks), "--duration", str(seconds),
           "--procs", "2", "--job", job, "--no-hw"]
    out = subprocess.run(cmd, env=env_for(settings), cwd=ROOT, capture_output=True, text=True,
                         timeout=seconds + 300)
    if out.returncode != 0:
        raise RuntimeError(f"loadgen failed: {out.stderr[-2000:]}")
    (work / "loadgen.err").write_text(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def drain(base: Settings, ranks: int, seconds: float, workers: int, work: Path) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:6]
    settings = base.with_overrides(topic_prefix=f"c{tag}.", rebuild_horizon_s=1.0)
    ensure_topics(settings, timeout_s=60)
    cfg = work / f"n{ranks}-w{workers}-{tag}"
    cfg.mkdir(parents=True)
    gen = write_backlog(settings, f"cap-{tag}", ranks, seconds, cfg)
    ends = end_offsets(settings)
    backlog = sum(ends.values())
    topic, group = Topic.STEPS.name_for(settings), f"{app_id(settings)}-shards"
    admin = admin_client(settings.bootstrap)
    procs = []
    try:
        for i in range(workers):
            (cfg / f"proc{i}").mkdir()
            procs.append(subprocess.Popen([sys.executable, "-m", "rankscope", "processors"], cwd=ROOT,
                                          env=env_for(settings, RANKSCOPE_DATA_DIR=str(cfg / f"proc{i}")),
                                          stdout=open(cfg / f"processors-{i}.log", "wb"), stderr=subprocess.STDOUT))
        ps = [psutil.Process(p.pid) for p in procs]
        samples: list[tuple[float, int, list[float]]] = []    # (time, messages folded, CPU s per worker)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            got = committed(admin, group, topic, list(ends))
            done = sum(min(got.get(p, 0), e) for p, e in ends.items())
            samples.append((time.monotonic(), done, [sum(p.cpu_times()[:2]) for p in ps]))
            if done >= backlog:
                return {"ranks": ranks, "workers": workers, "backlog_msgs": backlog,
                        "loadgen_sent_msgs_s": gen["send_rate_msgs_s"], **drain_rate(samples, backlog),
                        "logs": str(cfg)}
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a processors worker exited (logs in {cfg})")
            time.sleep(0.25)
        raise RuntimeError(f"backlog of {backlog} not drained in {DRAIN_TIMEOUT_S:.0f} s (logs in {cfg})")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def drain_rate(samples: list[tuple[float, int, list[float]]], backlog: int) -> dict[str, Any]:
    """Rate and CPU between the samples where FROM_FRAC and TO_FRAC of the backlog were folded: past
    the start-up, the group's rebalance and a worker's first partitions, before the last stragglers."""
    def first_at(frac: float) -> tuple[float, int, list[float]]:
        return next(s for s in samples if s[1] >= frac * backlog)

    (t0, n0, c0), (t1, n1, c1) = first_at(FROM_FRAC), first_at(TO_FRAC)
    secs, msgs = t1 - t0, n1 - n0
    cpu = [b - a for a, b in zip(c0, c1, strict=True)]
    rate = msgs / secs if secs > 0 else 0.0
    return {"measured_msgs": msgs, "measured_s": round(secs, 2), "msgs_per_s": round(rate),
            "ranks_carried_at_1_beat_s": round(rate), "cpu_s_per_worker": [round(c, 2) for c in cpu],
            "cpu_cores_per_worker": [round(c / secs, 2) if secs > 0 else 0.0 for c in cpu],
            "cpu_us_per_msg": round(1e6 * sum(cpu) / max(msgs, 1), 1)}


def run(ranks: int = DEFAULT_RANKS, seconds: float = DEFAULT_SECONDS,
        workers: tuple[int, ...] = DEFAULT_WORKERS) -> dict[str, Any]:
    configs = []
    with local_stack(processors=False) as base:
        work = Path(base.data_dir) / "capacity"
        for w in workers:
            print(f"capacity: {ranks} ranks x {seconds:.0f} s of backlog, {w} worker(s) ...", file=sys.stderr,
                  flush=True)
            try:
                c = drain(base, ranks, seconds, w, work)
            except Exception as e:   # one failed configuration does not lose the others
                c = {"ranks": ranks, "workers": w, "error": f"{type(e).__name__}: {e}"}
            print(json.dumps(c), file=sys.stderr, flush=True)
            configs.append(c)
    metrics: dict[str, Any] = {}
    for c in configs:
        p = f"w{c['workers']}_"
        if "error" in c:
            metrics[p + "error"] = c["error"][:80]
            continue
        metrics.update({p + "drain_msgs_s": c["msgs_per_s"], p + "cpu_us_per_msg": c["cpu_us_per_msg"]})
    rates = {c["workers"]: c["msgs_per_s"] for c in configs if "error" not in c}
    if 1 in rates and 2 in rates and rates[1]:
        metrics["speedup_w2_over_w1"] = round(rates[2] / rates[1], 2)
    return {"name": "capacity", "configs": configs, "metrics": metrics,
            "settings": {"ranks": ranks, "backlog_s": seconds, "cpu_cores": psutil.cpu_count()},
            "targets": {"w1_drain_msgs_s": "ranks one worker carries at 1 beat/rank/s",
                        "speedup_w2_over_w1": "> 1: a job spreads over workers"}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.capacity", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=DEFAULT_RANKS)
    p.add_argument("--seconds", type=float, default=DEFAULT_SECONDS, help="seconds of backlog to write")
    p.add_argument("--workers", default=",".join(map(str, DEFAULT_WORKERS)), help="comma-separated worker counts")
    args = p.parse_args(argv)
    if args.ranks <= 0 or args.seconds <= 0:
        p.error("--ranks and --seconds must be > 0")
    try:
        workers = tuple(int(w) for w in args.workers.split(","))
    except ValueError:
        p.error(f"--workers must be comma-separated integers, got {args.workers!r}")
    result = run(args.ranks, args.seconds, workers)
    print(json.dumps(result["metrics"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
