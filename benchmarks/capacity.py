"""Capacity of the processing tier: how many ranks one processors worker carries, and two; how
many the sink carries.

``python -m benchmarks.capacity [--ranks 10000] [--seconds 40] [--workers 1,2] [--no-sink] [--profile-s 10]``
(``make bench`` runs it as ``capacity``; JSON in benchmarks/results/capacity.json).

A backlog is written first, with nothing consuming it: the load generator (benchmarks/loadgen.py)
sends ``seconds`` of one job of ``ranks`` simulated ranks at 1 beat per rank per second (the real
v2 wire format through real producers; for the sink also one hardware sample per rank per second,
sent as ranks send them, five to a message). Then the consumers start on it and the drain is timed from their group's
committed offsets until they reach the end of every partition they read; the rate is taken
between 20% and 90% of the backlog (past start-up and the group's rebalance).

- processors: ``workers`` x ``rankscope processors`` (one consumer group, fresh per configuration)
  on the steps topic;
- sink: one ``rankscope sink`` (embedded chDB, fresh directory) on the steps and hw topics;
- sink with profiles: the same, with each rank's sampled stacks every ``profile_s`` seconds (as ranks
  send them by default; 24 call paths, ~4 KB) on the profiles topic too: whether one sink given a core
  of its own keeps up with a job of ``ranks`` ranks with profiles on (the scale benchmark runs the
  load generator, broker, processors and sink together on the machine's cores).

Measured, per configuration:

- drain rate in messages/s, and the ranks that rate carries (each rank sends one beat per second,
  plus for the sink a hardware message every `hw_send_s`);
- CPU of every consumer process during the drain (psutil), in µs per message;
- the speed-up of two processors workers over one.

The rebuild a processors worker makes of the partitions it takes (reading their last
``rebuild_horizon_s``) is set to 1 s here, so the drain measures folding, not re-reading. All on
this machine: the broker and the consumers share its cores, so the speed-up is bounded by what the
broker leaves free.
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
from rankscope.cli.stack.admin import ensure_topics
from rankscope.config import Settings
from rankscope.consuming import one_off_group, open_consumer
from rankscope.stream_processors.app import app_id
from rankscope.topics import Topic

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RANKS = 10_000
DEFAULT_SECONDS = 40.0
DEFAULT_WORKERS = (1, 2)
DRAIN_TIMEOUT_S = 600.0
FROM_FRAC, TO_FRAC = 0.2, 0.9
DEFAULT_PROFILE_S = Settings().profile_s   # how often ranks send their sampled stacks (the default)


def end_offsets(settings: Settings, kind: Topic = Topic.STEPS) -> dict[int, int]:
    from confluent_kafka import TopicPartition

    topic = kind.name_for(settings)
    c = open_consumer(settings, one_off_group("capacity"))
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
    finally:
        c.close()


def committed(reader: Any, topic: str, parts: list[int]) -> dict[int, int]:
    """The offsets committed on ``topic``'s partitions by the group of ``reader``, a consumer that
    never subscribes (so it does not join the group; it only asks the group's coordinator). Not an
    AdminClient's list_consumer_group_offsets: polled this often, it can crash librdkafka 2.16's
    main thread."""
    from confluent_kafka import KafkaException, TopicPartition

    try:
        got = reader.committed([TopicPartition(topic, p) for p in parts], timeout=10)
    except KafkaException:
        return {}
    return {tp.partition: max(tp.offset, 0) for tp in got if tp.error is None}


def write_backlog(settings: Settings, job: str, ranks: int, seconds: float, work: Path,
                  hw: bool = False, profile_s: float = 0.0) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.loadgen", "--ranks", str(ranks), "--duration", str(seconds),
           "--procs", "2", "--job", job, *(() if hw else ("--no-hw",)), "--profile-s", str(profile_s)]
    out = subprocess.run(cmd, env=env_for(settings), cwd=ROOT, capture_output=True, text=True,
                         timeout=seconds + 300)
    if out.returncode != 0:
        raise RuntimeError(f"loadgen failed: {out.stderr[-2000:]}")
    (work / "loadgen.err").write_text(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def drain(base: Settings, ranks: int, seconds: float, workers: int, work: Path) -> dict[str, Any]:
    """``workers`` processors workers drain a backlog of beats."""
    tag = uuid.uuid4().hex[:6]
    settings = base.with_overrides(topic_prefix=f"c{tag}.", rebuild_horizon_s=1.0)
    ensure_topics(settings, timeout_s=60)
    cfg = work / f"n{ranks}-w{workers}-{tag}"
    cfg.mkdir(parents=True)
    gen = write_backlog(settings, f"cap-{tag}", ranks, seconds, cfg)
    procs = []
    for i in range(workers):
        (cfg / f"proc{i}").mkdir()
        procs.append(subprocess.Popen([sys.executable, "-m", "rankscope", "processors"], cwd=ROOT,
                                      env=env_for(settings, RANKSCOPE_DATA_DIR=str(cfg / f"proc{i}")),
                                      stdout=open(cfg / f"processors-{i}.log", "wb"), stderr=subprocess.STDOUT))
    measured = time_drain(settings, procs, f"{app_id(settings)}-shards", (Topic.STEPS,), cfg)
    return {"service": "processors", "ranks": ranks, "workers": workers,
            "loadgen_sent_msgs_s": gen["send_rate_msgs_s"], **measured,
            "ranks_carried_at_1_beat_s": measured["msgs_per_s"]}


def drain_sink(base: Settings, ranks: int, seconds: float, work: Path, profile_s: float = 0.0) -> dict[str, Any]:
    """One sink drains a backlog of beats and hardware samples (and, with ``profile_s``, the ranks'
    profiles) into a fresh embedded store."""
    tag = uuid.uuid4().hex[:6]
    settings = base.with_overrides(topic_prefix=f"c{tag}.", sink_group=f"cap-sink-{tag}")
    ensure_topics(settings, timeout_s=60)
    cfg = work / f"n{ranks}-sink-{tag}"
    cfg.mkdir(parents=True)
    gen = write_backlog(settings, f"cap-{tag}", ranks, seconds, cfg, hw=True, profile_s=profile_s)
    (cfg / "store").mkdir()
    sink = subprocess.Popen([sys.executable, "-m", "rankscope", "sink"], cwd=ROOT,
                            env=env_for(settings, RANKSCOPE_DATA_DIR=str(cfg / "store")),
                            stdout=open(cfg / "sink.log", "wb"), stderr=subprocess.STDOUT)
    topics = (Topic.STEPS, Topic.HW, *((Topic.PROFILES,) if profile_s > 0 else ()))
    measured = time_drain(settings, [sink], settings.sink_group, topics, cfg)
    return {"service": "sink_profiles" if profile_s > 0 else "sink", "ranks": ranks, "workers": 1,
            "profile_s": profile_s, "loadgen_sent_msgs_s": gen["send_rate_msgs_s"], **measured,
            "ranks_carried_at_1_beat_s": round(measured["msgs_per_s"] / msgs_per_rank_s(settings, profile_s))}


def msgs_per_rank_s(settings: Settings, profile_s: float = 0.0) -> float:
    """What a rank sends the sink per second: a beat per heartbeat, a hardware message per hw_send_s,
    and with ``profile_s`` a profile that often."""
    hw_every = max(1, round(settings.hw_send_s / settings.heartbeat_s))
    return (1 + 1 / hw_every) / settings.heartbeat_s + (1 / profile_s if profile_s > 0 else 0.0)


def time_drain(settings: Settings, procs: list[subprocess.Popen[bytes]], group: str, topics: tuple[Topic, ...],
               cfg: Path) -> dict[str, Any]:
    """Poll ``group``'s committed offsets on ``topics`` until they reach the ends; stop ``procs``."""
    ends = {t: end_offsets(settings, t) for t in topics}
    backlog = sum(sum(e.values()) for e in ends.values())
    reader = open_consumer(settings, group, {"enable.auto.commit": False})
    try:
        ps = [psutil.Process(p.pid) for p in procs]
        samples: list[tuple[float, int, list[float]]] = []    # (time, messages done, CPU s per process)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            done = 0
            for t, e in ends.items():
                got = committed(reader, t.name_for(settings), list(e))
                done += sum(min(got.get(p, 0), n) for p, n in e.items())
            samples.append((time.monotonic(), done, [sum(p.cpu_times()[:2]) for p in ps]))
            if done >= backlog:
                return {"backlog_msgs": backlog, **drain_rate(samples, backlog), "logs": str(cfg)}
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a consumer exited (logs in {cfg})")
            time.sleep(0.25)
        raise RuntimeError(f"backlog of {backlog} not drained in {DRAIN_TIMEOUT_S:.0f} s (logs in {cfg})")
    finally:
        reader.close()
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
            "cpu_s_per_worker": [round(c, 2) for c in cpu],
            "cpu_cores_per_worker": [round(c / secs, 2) if secs > 0 else 0.0 for c in cpu],
            "cpu_us_per_msg": round(1e6 * sum(cpu) / max(msgs, 1), 1)}


def collective_fold_us(per_beat: int, ranks: int = 256, beats: int = 40) -> float:
    """Stage one's CPU per beat (fold, and the shard summary every scan) for beats that carry
    ``per_beat`` collective records of one group, in-process: what the collective records add to
    the ``w1_cpu_us_per_msg`` measured above."""
    from rankscope.config import Settings
    from rankscope.protocol.envelope import Envelope, decode, encode
    from rankscope.stream_processors.shard import ShardJob

    settings = Settings()
    job = ShardJob("bench", 0)
    seq = {r: 0 for r in range(ranks)}
    t0_ns = 1_800_000_000 * 10**9
    raw = []
    for b in range(beats):
        for r in range(ranks):
            body: dict[str, Any] = {"step": [b], "start_ns": [t0_ns + b * 10**9], "end_ns": [t0_ns + b * 10**9 + 9 * 10**8],
                                    "comm_ns": [0], "hb_step": b, "since_step_s": 0.0, "dropped": 0,
                                    "world_size": ranks, "local_rank": r % 8, "stacks": None}
            if per_beat:
                first = seq[r] + 1
                seq[r] += per_beat
                body["coll"] = [{"pg": "0", "size": ranks, "seq": list(range(first, first + per_beat)),
                                 "op": [0] * per_beat, "reach_ns": [t0_ns + b * 10**9 + k * 1000 + r for k in range(per_beat)],
                                 "dur_ns": [-1] * per_beat, "ops": ["all_reduce bfloat16[4096]"],
                                 "last": [seq[r], -1, seq[r]]}]
            raw.append(encode(Envelope("beat", "bench", r, "h", r, b, t0_ns + b * 10**9 + 9 * 10**8, body)))
    t0 = time.process_time()
    for i, m in enumerate(raw):
        env = decode(m)
        job.apply(env, env.sent_ns / 1e9, settings)
        if (i + 1) % ranks == 0:
            job.summary(env.sent_ns / 1e9, settings)
    return (time.process_time() - t0) / len(raw) * 1e6


def run(ranks: int = DEFAULT_RANKS, seconds: float = DEFAULT_SECONDS,
        workers: tuple[int, ...] = DEFAULT_WORKERS, sink: bool = True,
        profile_s: float = DEFAULT_PROFILE_S) -> dict[str, Any]:
    configs = []
    with local_stack(processors=False) as base:
        work = Path(base.data_dir) / "capacity"
        plan: list[tuple[str, int]] = [("processors", w) for w in workers] + ([("sink", 1)] if sink else []) \
            + ([("sink_profiles", 1)] if sink and profile_s > 0 else [])
        for service, w in plan:
            print(f"capacity: {ranks} ranks x {seconds:.0f} s of backlog, {service} x {w} ...", file=sys.stderr,
                  flush=True)
            try:
                c = drain(base, ranks, seconds, w, work) if service == "processors" else \
                    drain_sink(base, ranks, seconds, work, profile_s if service == "sink_profiles" else 0.0)
            except Exception as e:   # one failed configuration does not lose the others
                c = {"service": service, "ranks": ranks, "workers": w, "error": f"{type(e).__name__}: {e}"}
            print(json.dumps(c), file=sys.stderr, flush=True)
            configs.append(c)
    metrics: dict[str, Any] = {}
    for c in configs:
        p = f"w{c['workers']}_" if c["service"] == "processors" else f"{c['service']}_"
        if "error" in c:
            metrics[p + "error"] = c["error"][:80]
            continue
        metrics.update({p + "drain_msgs_s": c["msgs_per_s"], p + "cpu_us_per_msg": c["cpu_us_per_msg"],
                        p + "ranks_carried": c["ranks_carried_at_1_beat_s"]})
    fold = {k: round(collective_fold_us(k), 2) for k in (0, 16, 64)}
    metrics.update({f"fold_us_per_beat_with_{k}_collectives": v for k, v in fold.items()})
    metrics["fold_us_per_collective_record"] = round((fold[64] - fold[0]) / 64, 3)
    rates = {c["workers"]: c["msgs_per_s"] for c in configs if "error" not in c and c["service"] == "processors"}
    if 1 in rates and 2 in rates and rates[1]:
        metrics["speedup_w2_over_w1"] = round(rates[2] / rates[1], 2)
    return {"name": "capacity", "configs": configs, "metrics": metrics,
            "settings": {"ranks": ranks, "backlog_s": seconds, "cpu_cores": psutil.cpu_count()},
            "targets": {"w1_drain_msgs_s": "ranks one worker carries at 1 beat/rank/s",
                        "speedup_w2_over_w1": "> 1: a job spreads over workers",
                        "sink_ranks_carried": "ranks one sink carries (a beat per rank per s, a hardware message per rank per hw_send_s)",
                        "sink_profiles_ranks_carried": f">= {ranks}: one sink keeps up with the job, profiles every "
                                                       f"{profile_s:g} s included"}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.capacity", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=DEFAULT_RANKS)
    p.add_argument("--seconds", type=float, default=DEFAULT_SECONDS, help="seconds of backlog to write")
    p.add_argument("--workers", default=",".join(map(str, DEFAULT_WORKERS)),
                   help="comma-separated processors worker counts; empty for none")
    p.add_argument("--no-sink", dest="sink", action="store_false", help="do not measure the sink")
    p.add_argument("--profile-s", type=float, default=DEFAULT_PROFILE_S,
                   help="the sink's second run: each rank's profile this often (0: no such run)")
    args = p.parse_args(argv)
    if args.ranks <= 0 or args.seconds <= 0 or args.profile_s < 0:
        p.error("--ranks and --seconds must be > 0, --profile-s >= 0")
    try:
        workers = tuple(int(w) for w in args.workers.split(",") if w.strip())
    except ValueError:
        p.error(f"--workers must be comma-separated integers, got {args.workers!r}")
    if any(w <= 0 for w in workers):
        p.error("--workers must be > 0")
    result = run(args.ranks, args.seconds, workers, args.sink, args.profile_s)
    print(json.dumps(result["metrics"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
