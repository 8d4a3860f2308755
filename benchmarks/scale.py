"""Scale of the processing tier: one job of 1,024 / 4,096 / 10,000 simulated ranks at 1 step/s.

``python -m benchmarks.scale [--ranks 1024,4096,10000] [--workers 1,2] [--duration 75] [--wire v2|v1]``
(``make bench`` runs the default matrix as ``scale``; JSON in benchmarks/results/scale.json).

Per configuration (rank count x processors workers), on one local broker with a fresh topic prefix
(so fresh topics, a fresh processors consumer group and a fresh sink group and chDB directory):

- ``workers`` x ``python -m rankscope processors`` (one consumer group: the faust app id) and one
  ``python -m rankscope sink``, started and waited for until both groups are stable;
- the load generator (benchmarks/loadgen.py, its own processes) for ``duration`` seconds, each
  rank sending its sampled stacks every ``--profile-s`` (10 s, as ranks do by default), with a
  slow rank (x1.5 busy from ``slow_at``), a dead rank (silent from ``dead_at``) and a hang
  (``hang_at``; the rest of the job stalls a step later) planted on three distinct ranks.

Measured:

- messages/s the generator actually sent, and whether it kept to its schedule;
- lag of the processors and of the sink, in seconds from the messages' send times: every second,
  per partition of the steps topic, the group's committed offset; the message just before it is
  read with a separate consumer (assign + seek) and lag = now - its envelope ``sent_ns`` when newer
  messages exist, 0 when caught up (nothing committed yet: the age of the partition's first
  message). p50/p99 over every (second, partition) sample while the generator runs. The processors'
  groups are found by their id (it starts with the faust app id, ``app_id()``): the one that holds
  the steps topic gives "processors" lag; where a second stage consumes the shards topic, its lag is
  reported as "processors_stage2". A group has a lag floor of its commit interval even when it keeps
  up (stage one commits every 0.25 s, the faust stage every 0.5 s);
- hang alert latency past the threshold: the alert's receive time (read from the alerts topic)
  minus (the culprit's last step end + ``hang_min_s``), and whether it names the culprit;
- whether the slow and the dead rank are named, and false alerts (any alert of a kind not
  planted, or naming a rank other than the one planted for its kind);
- peak RSS and CPU seconds of each service process (psutil, every second), and the processors'
  CPU per rank per second (µs);
- sustained: the generator kept up, the processors' lag p99 stayed under the hang threshold and
  did not grow (least-squares slope of the per-second worst partition lag, after the first 10 s,
  under ``LAG_GROWTH_MAX``); the largest sustained rank count per worker count is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from benchmarks._stack import env_for, free_port
from rankscope.cli.stack.admin import admin_client, ensure_topics
from rankscope.cli.stack.broker import LocalBroker
from rankscope.config import Settings
from rankscope.consuming import one_off_group, open_consumer
from rankscope.protocol.alerts import Alert
from rankscope.stream_processors.app import app_id
from rankscope.topics import Topic

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RANKS = (1024, 4096, 10000)
DEFAULT_WORKERS = (1, 2)
DEFAULT_DURATION_S = 75.0
DEFAULT_PROFILE_S = Settings().profile_s   # how often ranks send their sampled stacks (the default)
LAG_GROWTH_MAX = 0.05      # s of lag per s of run: above it the tier falls behind
WARMUP_S = 10.0            # lag samples before this (from the generator's start) are left out of the slope
TAIL_MAX_S = 30.0          # after the generator stops: wait at most this for missing alerts / the drain


def fault_times(duration_s: float, hang_min_s: float) -> dict[str, float]:
    """slow 10 s, dead 25 s, hang 45 s into the run (a 75 s run); earlier for shorter runs. The slow
    rank needs ~30 s (~25 of its 1.25 s steps: a 20-step median, then 3 evaluations 5 steps apart)
    before the hang stops the job, so runs under ~65 s plant it too late to be named."""
    hang = min(45.0, duration_s - hang_min_s - 20.0)
    dead = min(25.0, hang - 8.0)
    slow = min(10.0, max(3.0, hang - 35.0))
    if hang < 20.0:
        raise ValueError(f"--duration {duration_s:.0f} is too short for the planted faults "
                         f"(>= {fault_min_duration_s(hang_min_s):.0f} s)")
    return {"slow_at": slow, "dead_at": dead, "hang_at": hang}


def fault_min_duration_s(hang_min_s: float) -> float:
    return hang_min_s + 40.0


def fault_ranks(n: int) -> dict[str, int]:
    return {"slow_rank": max(1, n // 4), "dead_rank": n // 2 + 1, "hang_rank": (3 * n) // 4 + 2}


# ------------------------------------------------------------------------------------------------
# Samplers (threads of this process)
# ------------------------------------------------------------------------------------------------

class ResourceSampler(threading.Thread):
    """Every second: RSS and CPU (user + system) of each named service, children included; a
    process that exits keeps the CPU it was last seen with."""

    def __init__(self) -> None:
        super().__init__(name="scale-resources", daemon=True)
        import psutil

        self.psutil = psutil
        self.procs: dict[str, Any] = {}
        self.samples: list[tuple[float, dict[str, tuple[float, float]]]] = []   # (wall s, name -> (rss MB, cpu s))
        self._cpu_seen: dict[str, dict[int, float]] = {}
        self.stop = threading.Event()

    def watch(self, name: str, pid: int | None) -> None:
        if pid:
            try:
                proc = self.psutil.Process(pid)
                self._cpu_seen.setdefault(name, {})
                self.procs[name] = proc
            except self.psutil.NoSuchProcess:
                pass

    def sample(self) -> None:
        now, row = time.time(), {}
        for name, p in list(self.procs.items()):
            rss, seen = 0, self._cpu_seen[name]
            try:
                family = [p, *p.children(recursive=True)]
            except self.psutil.NoSuchProcess:
                family = []
            for q in family:
                try:
                    with q.oneshot():
                        t = q.cpu_times()
                        rss += q.memory_info().rss
                        seen[q.pid] = t.user + t.system
                except self.psutil.Error:
                    pass
            row[name] = (rss / 2**20, sum(seen.values()))
        self.samples.append((now, row))

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.sample()

    def summary(self, t0: float, t1: float) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for name in self.procs:
            rows = [(t, r[name]) for t, r in self.samples if name in r]
            if not rows:
                continue
            during = [(t, v) for t, v in rows if t0 <= t <= t1] or rows
            peak = max(v[0] for _, v in rows)
            cpu_run = during[-1][1][1] - during[0][1][1]
            span = max(during[-1][0] - during[0][0], 1e-9)
            out[name] = {"peak_rss_mb": round(peak, 1), "cpu_s_total": round(rows[-1][1][1], 2),
                         "cpu_s_during_run": round(cpu_run, 2), "cpu_cores_during_run": round(cpu_run / span, 3),
                         "run_span_s": round(span, 1)}
        return out


class LagSampler(threading.Thread):
    """Every second, for each (label -> consumer group, topic) and each partition of the topic:
    now - sent_ns of the last message the group committed, when newer messages exist (0 when
    caught up; nothing committed yet: the age of the partition's first message)."""

    def __init__(self, settings: Settings, targets: dict[str, tuple[str, str]]) -> None:
        super().__init__(name="scale-lag", daemon=True)
        base = {"enable.auto.commit": False}
        self.targets = targets
        self.meta = {label: open_consumer(settings, gid, base) for label, (gid, _) in targets.items()}
        # Small fetches and prefetch: only the first message at each offset is wanted.
        self.reader = open_consumer(settings, one_off_group("scale-lag"), {
            **base, "fetch.wait.max.ms": 10, "auto.offset.reset": "earliest", "max.partition.fetch.bytes": 65536,
            "queued.max.messages.kbytes": 2048})
        self.partitions = {t: sorted(self.reader.list_topics(t, timeout=30).topics[t].partitions)
                           for t in {t for _, t in targets.values()}}
        self.samples: dict[str, list[tuple[float, int, float]]] = {label: [] for label in targets}  # (t, p, lag s)
        self.errors = 0
        self.error_reasons: dict[str, int] = {}
        self.stop = threading.Event()

    def _error(self, reason: str) -> None:
        self.errors += 1
        self.error_reasons[reason] = self.error_reasons.get(reason, 0) + 1

    def _sent_ns(self, wanted: list[tuple[str, int, int]]) -> dict[tuple[str, int, int], int]:
        """sent_ns of the messages at these (topic, partition, offset): one offset per partition."""
        from confluent_kafka import TopicPartition

        got: dict[tuple[str, int, int], int] = {}
        tps = [TopicPartition(t, p, o) for t, p, o in wanted]
        self.reader.assign(tps)
        self.reader.resume(tps)   # librdkafka keeps a partition's pause across assignments
        want = {(t, p): o for t, p, o in wanted}
        deadline = time.monotonic() + 3.0
        while len(got) < len(wanted) and time.monotonic() < deadline:
            for m in self.reader.consume(500, 0.2):
                if m.error() is not None or want.get((m.topic(), m.partition())) != m.offset():
                    continue
                key = (m.topic(), m.partition(), m.offset())
                if key not in got:
                    self.reader.pause([TopicPartition(m.topic(), m.partition())])   # the rest is not wanted
                    try:
                        got[key] = int(msgpack.unpackb(m.value(), raw=False, strict_map_key=False)["sent_ns"])
                    except Exception:
                        got[key] = 0
        self.reader.resume(tps)
        self.reader.unassign()
        return got

    def sample_once(self) -> None:
        from confluent_kafka import TopicPartition

        now_ns = time.time_ns()
        marks = {(t, p): self.reader.get_watermark_offsets(TopicPartition(t, p), timeout=5, cached=False)
                 for t, ps in self.partitions.items() for p in ps}
        need: dict[str, dict[int, int]] = {}
        for label, (_, topic) in self.targets.items():
            committed = self.meta[label].committed([TopicPartition(topic, p) for p in self.partitions[topic]],
                                                   timeout=5)
            need[label] = {}
            for tp in committed:
                low, high = marks[(topic, tp.partition)]
                off = tp.offset
                if high <= low or (off >= 0 and off >= high):
                    self.samples[label].append((now_ns / 1e9, tp.partition, 0.0))
                    continue
                need[label][tp.partition] = off - 1 if off > low else low
        # One read per (topic, partition, offset); in rounds that ask one offset per partition.
        targets = sorted({(self.targets[lb][1], p, o) for lb, d in need.items() for p, o in d.items()})
        sent: dict[tuple[str, int, int], int] = {}
        while targets:
            round_, rest, seen = [], [], set()
            for t, p, o in targets:
                (rest if (t, p) in seen else round_).append((t, p, o))
                seen.add((t, p))
            sent.update(self._sent_ns(round_))
            targets = rest
        for label, d in need.items():
            for p, o in d.items():
                sn = sent.get((self.targets[label][1], p, o))
                if sn:
                    self.samples[label].append((now_ns / 1e9, p, max(0.0, (now_ns - sn) / 1e9)))
                else:
                    self._error(f"{label}: message not read" if sn is None else f"{label}: no sent_ns")

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                self.sample_once()
            except Exception as e:
                self._error(f"{type(e).__name__}: {e}"[:120])
            self.stop.wait(max(0.0, 1.0 - (time.monotonic() - t)))

    def close(self) -> None:
        for c in (*self.meta.values(), self.reader):
            try:
                c.close()
            except Exception:
                pass

    def summary(self, label: str, t0: float, t1: float) -> dict[str, Any]:
        rows = [(t, p, v) for t, p, v in self.samples[label] if t0 <= t <= t1]
        if not rows:
            return {"p50_s": None, "p99_s": None, "max_s": None, "growth_s_per_s": None, "samples": 0}
        lags = np.array([v for _, _, v in rows])
        worst: dict[int, float] = {}
        for t, _, v in rows:   # the worst partition per second
            worst[int(t)] = max(worst.get(int(t), 0.0), v)
        ts = np.array(sorted(worst), dtype=float)
        ws = np.array([worst[int(t)] for t in ts])
        keep = ts >= t0 + WARMUP_S
        slope = float(np.polyfit(ts[keep], ws[keep], 1)[0]) if keep.sum() >= 5 else None
        return {"group": self.targets[label][0], "topic": self.targets[label][1],
                "p50_s": round(float(np.percentile(lags, 50)), 3), "p99_s": round(float(np.percentile(lags, 99)), 3),
                "max_s": round(float(lags.max()), 3), "growth_s_per_s": None if slope is None else round(slope, 4),
                "last_s": round(float(ws[-1]), 3), "samples": len(rows),
                "worst_per_s": [[round(float(t - t0), 1), round(float(w), 2)] for t, w in zip(ts, ws, strict=True)]}

    def caught_up_at(self, label: str, after: float) -> float | None:
        """First second after ``after`` at which every partition's lag was 0."""
        n = len(self.partitions[self.targets[label][1]])
        by_t: dict[int, list[float]] = {}
        for t, _, v in self.samples[label]:
            if t >= after:
                by_t.setdefault(int(t), []).append(v)
        for t in sorted(by_t):
            if len(by_t[t]) >= n and max(by_t[t]) == 0.0:
                return float(t)
        return None


class AlertReader(threading.Thread):
    def __init__(self, settings: Settings) -> None:
        super().__init__(name="scale-alerts", daemon=True)
        from confluent_kafka import TopicPartition

        topic = Topic.ALERTS.name_for(settings)
        self.consumer = open_consumer(settings, one_off_group("scale"), {"enable.auto.commit": False,
                                                                          "fetch.wait.max.ms": 50})
        parts = self.consumer.list_topics(topic, timeout=30).topics[topic].partitions
        self.consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        self.alerts: list[tuple[int, Alert]] = []
        self.bad = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for m in self.consumer.consume(100, 0.2):
                if m.error() is not None:
                    continue
                now = time.time_ns()
                try:
                    self.alerts.append((now, Alert.from_json(m.value())))
                except ValueError:
                    self.bad += 1
        self.consumer.close()


# ------------------------------------------------------------------------------------------------
# One configuration
# ------------------------------------------------------------------------------------------------

def processors_groups(admin: Any, settings: Settings) -> dict[str, Any]:
    """The processors' consumer groups (ids starting with the faust app id: the faust group, and
    any group of a stage with its own consumer) -> their description."""
    listed = admin.list_consumer_groups(request_timeout=5).result(10)
    ids = [g.group_id for g in listed.valid if g.group_id.startswith(app_id(settings))]
    if not ids:
        return {}
    return {gid: f.result(10) for gid, f in admin.describe_consumer_groups(ids, request_timeout=5).items()}


def group_topics(desc: Any) -> set[str]:
    return {tp.topic for m in desc.members for tp in (m.assignment.topic_partitions or [])}


def wait_services(settings: Settings, workers: int, timeout_s: float,
                  procs: list[subprocess.Popen[bytes]]) -> tuple[float, dict[str, str]]:
    """Block until every processors group is stable with ``workers`` members (one of them holding
    the steps topic, another the shards topic where a second stage has one) and the sink group is
    stable with one member. Returns the seconds it took and topic -> processors group id."""
    from confluent_kafka import ConsumerGroupState

    admin = admin_client(settings.bootstrap)
    steps = Topic.STEPS.name_for(settings)
    t0 = time.monotonic()
    while True:
        try:
            groups = processors_groups(admin, settings)
            sink = admin.describe_consumer_groups([settings.sink_group], request_timeout=5)[settings.sink_group].result(10)
            by_topic = {t: gid for gid, d in groups.items() for t in group_topics(d)}
            ok = (bool(groups) and steps in by_topic
                  and all(d.state == ConsumerGroupState.STABLE and len(d.members) == workers for d in groups.values())
                  and sink.state == ConsumerGroupState.STABLE and len(sink.members) == 1)
        except Exception:
            ok = False
        if ok:
            return time.monotonic() - t0, by_topic
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a service exited while starting: {[p.args for p in procs if p.poll() is not None]}")
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"processors/sink consumer groups not stable after {timeout_s:.0f} s")
        time.sleep(0.5)


def judge_alerts(alerts: list[tuple[int, Alert]], job: str, faults: dict[str, Any], settings: Settings,
                 end_ns: int) -> dict[str, Any]:
    """Planted faults named or not, and false alerts: an incident of a kind not planted, or one whose
    versions received before ``end_ns`` (the generator's last beat, before its exit records) name a
    rank other than the one planted for its kind. Versions after it (the job's exit records close
    incidents) are counted apart, as ``after_end_extra_ranks``."""
    planted = {"hang": faults["hang"]["rank"], "slow_rank": faults["slow"]["rank"], "dead_rank": faults["dead"]["rank"]}
    mine = [(t, a) for t, a in alerts if a.job == job]
    incidents: dict[str, dict[str, Any]] = {}
    for t, a in mine:
        inc = incidents.setdefault(a.alert_id, {"kind": a.kind, "ranks": set(), "ranks_after_end": set(),
                                                "first_recv_ns": t, "summaries": []})
        inc["ranks" if t < end_ns else "ranks_after_end"] |= set(a.ranks)
        if len(inc["summaries"]) < 3 or inc["ranks"] - {planted.get(a.kind)}:
            inc["summaries"] = [*inc["summaries"][:2], f"{a.status} v{a.version} at end{(t - end_ns) / 1e9:+.1f}s: "
                                                       f"{a.summary} (ranks {sorted(a.ranks)[:10]})"]

    def extra(v: dict[str, Any], key: str) -> list[int]:
        return sorted(v[key] - {planted.get(v["kind"])})

    false = [{"alert_id": k, "kind": v["kind"], "extra_ranks": extra(v, "ranks")[:20],
              "n_extra_ranks": len(extra(v, "ranks")), "summaries": v["summaries"]}
             for k, v in incidents.items()
             if v["first_recv_ns"] < end_ns and (v["kind"] not in planted or extra(v, "ranks"))]
    after_end = {k: len(extra(v, "ranks_after_end")) for k, v in incidents.items() if extra(v, "ranks_after_end")}

    def first(kind: str, rank: int) -> tuple[int, Alert] | None:
        return next(((t, a) for t, a in mine if a.kind == kind and rank in a.ranks), None)

    hang, slow, dead = (first(k, r) for k, r in planted.items())
    first_hang = next(((t, a) for t, a in mine if a.kind == "hang"), None)
    h = faults["hang"]
    due_ns = h["last_step_end_ns"] + int(settings.hang_min_s * 1e9)
    return {
        "hang_named": hang is not None,
        "hang_first_alert_ranks": sorted(first_hang[1].ranks)[:20] if first_hang else None,
        "hang_alert_latency_past_threshold_s": round((hang[0] - due_ns) / 1e9, 3) if hang else None,
        "hang_alert_opened_past_threshold_s": round((hang[1].opened_ns - due_ns) / 1e9, 3) if hang else None,
        "slow_named": slow is not None,
        "slow_alert_after_slowdown_s": (round((slow[0] - faults["slow"]["first_slow_step_start_ns"]) / 1e9, 3)
                                        if slow else None),
        "dead_named": dead is not None,
        "dead_alert_after_silence_s": (round((dead[0] - faults["dead"].get("last_sent_ns", faults["dead"]["at_ns"]))
                                             / 1e9, 3) if dead else None),
        "false_alerts": len(false), "false_alert_list": false[:10], "after_end_extra_ranks": after_end,
        "alert_messages": len(mine), "incidents": len(incidents),
    }


def run_config(base: Settings, ranks: int, workers: int, duration_s: float, wire: str, procs: int,
               workdir: Path, extra_loadgen: list[str] | None = None, profile_s: float = 0.0) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:6]
    cfgdir = workdir / f"n{ranks}-w{workers}-{tag}"
    cfgdir.mkdir(parents=True)
    settings = base.with_overrides(topic_prefix=f"s{tag}.", sink_group=f"rankscope-sink-s{tag}",
                                   bootstrap_servers=base.bootstrap, data_dir=str(cfgdir),
                                   clickhouse_dsn=f"chdb://{cfgdir / 'clickhouse'}")
    ensure_topics(settings, timeout_s=60)
    job = f"scale-{ranks}-{tag}"
    faults_at, faults_rank = fault_times(duration_s, settings.hang_min_s), fault_ranks(ranks)
    services: dict[str, subprocess.Popen[bytes]] = {}
    res = ResourceSampler()
    res.watch("broker", LocalBroker(base).pid())
    lag = alerts = None
    out: dict[str, Any] = {"ranks": ranks, "workers": workers, "wire": wire, "duration_s": duration_s,
                           "loadgen_procs": procs, "job": job, "faults_at_s": faults_at, "fault_ranks": faults_rank,
                           "profile_s": profile_s}
    try:
        for i in range(workers):
            (cfgdir / f"proc{i}").mkdir()
            env = env_for(settings, RANKSCOPE_DATA_DIR=str(cfgdir / f"proc{i}"))
            services[f"processors-{i}"] = subprocess.Popen(
                [sys.executable, "-m", "rankscope", "processors"], env=env, cwd=ROOT,
                stdout=open(cfgdir / f"processors-{i}.log", "wb"), stderr=subprocess.STDOUT)
        services["sink"] = subprocess.Popen([sys.executable, "-m", "rankscope", "sink"], env=env_for(settings), cwd=ROOT,
                                            stdout=open(cfgdir / "sink.log", "wb"), stderr=subprocess.STDOUT)
        ready_s, by_topic = wait_services(settings, workers, 180, list(services.values()))
        out["groups_ready_s"] = round(ready_s, 1)
        for name, p in services.items():
            res.watch(name, p.pid)
        steps, shards = Topic.STEPS.name_for(settings), Topic.SHARDS.name_for(settings)
        targets = {"processors": (by_topic[steps], steps), "sink": (settings.sink_group, steps)}
        if shards in by_topic:   # the processors' second stage (job-wide rules on shard summaries)
            targets["processors_stage2"] = (by_topic[shards], shards)
        lag = LagSampler(settings, targets)
        alerts = AlertReader(settings)
        for t in (res, lag, alerts):
            t.start()
        cmd = [sys.executable, "-m", "benchmarks.loadgen", "--ranks", str(ranks), "--duration", str(duration_s),
               "--procs", str(procs), "--job", job, "--wire", wire, "--exit",
               *(f"--{k.replace('_', '-')}={v}" for k, v in {**faults_at, **faults_rank}.items()),
               "--profile-s", str(profile_s), *(extra_loadgen or [])]
        lg_log = cfgdir / "loadgen.out"
        gen = subprocess.Popen(cmd, env=env_for(settings), cwd=ROOT, stdout=open(lg_log, "wb"),
                               stderr=open(cfgdir / "loadgen.err", "wb"))
        res.watch("loadgen", gen.pid)
        rc = gen.wait(duration_s + 180)
        lines = lg_log.read_text().strip().splitlines()
        if rc != 0 or not lines:
            raise RuntimeError(f"loadgen failed (rc {rc}): {(cfgdir / 'loadgen.err').read_text()[-2000:]}")
        gen_out = json.loads(lines[-1])
        t0, t1 = gen_out["t0_ns"] / 1e9, gen_out["end_ns"] / 1e9
        # Tail: until the planted faults are named (or TAIL_MAX_S) and the processors drained.
        tail_end = time.time() + TAIL_MAX_S
        while time.time() < tail_end:
            j = judge_alerts(alerts.alerts, job, gen_out["faults"], settings, gen_out["end_ns"])
            drained = lag.caught_up_at("processors", t1) is not None
            if j["hang_named"] and j["slow_named"] and j["dead_named"] and drained:
                break
            time.sleep(1.0)
        time.sleep(1.5)
        out["loadgen"] = {k: gen_out[k] for k in ("messages", "messages_total", "send_rate_msgs_s",
                                                  "steps_topic_rate_msgs_s", "expected_steps_topic_rate_msgs_s",
                                                  "lateness_p99_s", "lateness_max_s", "kept_up", "cpu_s",
                                                  "max_message_bytes", "bytes_total", "wall_s", "unflushed")}
        out["faults"] = gen_out["faults"]
        out["processors_lag"] = lag.summary("processors", t0, t1)
        out["sink_lag"] = lag.summary("sink", t0, t1)
        if "processors_stage2" in targets:
            out["processors_stage2_lag"] = lag.summary("processors_stage2", t0, t1)
        for name in ("processors", "sink"):
            at = lag.caught_up_at(name, t1)
            out[f"{name}_drained_after_end_s"] = None if at is None else round(max(0.0, at - t1), 1)
        out["lag_sample_errors"] = lag.errors
        out["lag_sample_error_reasons"] = lag.error_reasons
        out["alerts"] = judge_alerts(alerts.alerts, job, gen_out["faults"], settings, gen_out["end_ns"])
        out["resources"] = res.summary(t0, t1)
        proc_cpu = sum(v["cpu_s_during_run"] for k, v in out["resources"].items() if k.startswith("processors"))
        out["processors_cpu_us_per_rank_s"] = round(1e6 * proc_cpu / (ranks * (t1 - t0)), 2)
        out["services_alive_at_end"] = {name: p.poll() is None for name, p in services.items()}
        pl = out["processors_lag"]
        out["sustained"] = bool(out["loadgen"]["kept_up"] and all(out["services_alive_at_end"].values())
                                and pl["p99_s"] is not None and pl["p99_s"] < settings.hang_min_s
                                and pl["growth_s_per_s"] is not None and pl["growth_s_per_s"] < LAG_GROWTH_MAX)
        out["logs"] = str(cfgdir)
        return out
    finally:
        for t in (res, lag, alerts):
            if t is not None:
                t.stop.set()
        for t in (res, lag, alerts):
            if t is not None and t.is_alive():
                t.join(10)
        if lag is not None:
            lag.close()
        for p in services.values():
            if p.poll() is None:
                p.terminate()
        for p in services.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def config_row(c: dict[str, Any]) -> dict[str, Any]:
    if "error" in c:
        return {"ranks": c["ranks"], "workers": c["workers"], "error": c["error"][:60]}
    r, a = c["resources"], c["alerts"]
    procs = [v for k, v in r.items() if k.startswith("processors")]
    return {"ranks": c["ranks"], "workers": c["workers"], "sent msg/s": c["loadgen"]["send_rate_msgs_s"],
            "steps msg/s": c["loadgen"]["steps_topic_rate_msgs_s"], "kept up": c["loadgen"]["kept_up"],
            "proc lag p50": c["processors_lag"]["p50_s"], "proc lag p99": c["processors_lag"]["p99_s"],
            "proc growth": c["processors_lag"]["growth_s_per_s"],
            "stage2 lag p99": c.get("processors_stage2_lag", {}).get("p99_s"),
            "sink lag p50": c["sink_lag"]["p50_s"], "sink lag p99": c["sink_lag"]["p99_s"],
            "hang late s": a["hang_alert_latency_past_threshold_s"], "hang named": a["hang_named"],
            "slow named": a["slow_named"], "dead named": a["dead_named"], "false": a["false_alerts"],
            "proc us/rank/s": c["processors_cpu_us_per_rank_s"],
            "proc RSS MB": max((v["peak_rss_mb"] for v in procs), default=None),
            "sink RSS MB": r.get("sink", {}).get("peak_rss_mb"),
            "proc cores": round(sum(v["cpu_cores_during_run"] for v in procs), 2),
            "sink cores": r.get("sink", {}).get("cpu_cores_during_run"),
            "sustained": c["sustained"]}


def print_table(configs: list[dict[str, Any]]) -> None:
    rows = [config_row(c) for c in configs]
    cols = list(dict.fromkeys(k for row in rows for k in row))
    widths = {k: max(len(k), *(len(_fmt(row.get(k))) for row in rows)) for k in cols}
    print("  ".join(f"{k:>{widths[k]}}" for k in cols))
    for row in rows:
        print("  ".join(f"{_fmt(row.get(k)):>{widths[k]}}" for k in cols))


def run(ranks: tuple[int, ...] = DEFAULT_RANKS, workers: tuple[int, ...] = DEFAULT_WORKERS,
        duration_s: float = DEFAULT_DURATION_S, wire: str = "v2", procs: int = 2, keep: bool = False,
        partitions: int | None = None, warmup: bool = True, profile_s: float = DEFAULT_PROFILE_S) -> dict[str, Any]:
    fault_times(duration_s, Settings().hang_min_s)   # fail fast on a too-short run
    workdir = Path(tempfile.mkdtemp(prefix="rankscope-scale-"))
    base = Settings.from_env(data_dir=str(workdir / "broker"), kafka_port=free_port(),
                             kafka_controller_port=free_port(), topic_prefix="scale-broker.", bootstrap_servers="",
                             clickhouse_dsn="", topic_partitions=partitions)
    broker = LocalBroker(base)
    broker.start(timeout_s=120)
    configs: list[dict[str, Any]] = []
    warmup_s = fault_min_duration_s(base.hang_min_s)
    try:
        if warmup:
            # A fresh broker's JVM spends its first tens of seconds compiling its produce and fetch
            # paths (~0.4 of a core instead of ~0.25 at 10,000 ranks here), starving whatever the
            # first configuration measures. A cluster's brokers run for months, so the first
            # configuration is run once, shorter, and its results are dropped.
            print(f"scale: warm-up, {min(ranks)} ranks, {warmup_s:.0f} s (results dropped) ...", file=sys.stderr,
                  flush=True)
            try:
                run_config(base, min(ranks), workers[0], warmup_s, wire, procs, workdir, profile_s=profile_s)
            except Exception as e:
                print(f"scale: warm-up failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        for n in ranks:
            for w in workers:
                t = time.monotonic()
                print(f"scale: {n} ranks, {w} processors worker(s), {duration_s:.0f} s, wire {wire} ...",
                      file=sys.stderr, flush=True)
                try:
                    c = run_config(base, n, w, duration_s, wire, procs, workdir, profile_s=profile_s)
                except Exception as e:   # one failed configuration does not lose the others
                    c = {"ranks": n, "workers": w, "error": f"{type(e).__name__}: {e}"}
                c["config_wall_s"] = round(time.monotonic() - t, 1)
                configs.append(c)
                print(json.dumps(config_row(c)), file=sys.stderr, flush=True)
    finally:
        broker.stop()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    metrics: dict[str, Any] = {}
    for c in configs:
        p = f"n{c['ranks']}_w{c['workers']}_"
        if "error" in c:
            metrics[p + "error"] = c["error"][:80]
            continue
        a = c["alerts"]
        metrics.update({
            p + "sent_msgs_s": c["loadgen"]["send_rate_msgs_s"],
            p + "proc_lag_p50_s": c["processors_lag"]["p50_s"], p + "proc_lag_p99_s": c["processors_lag"]["p99_s"],
            p + "sink_lag_p50_s": c["sink_lag"]["p50_s"], p + "sink_lag_p99_s": c["sink_lag"]["p99_s"],
            p + "hang_alert_past_threshold_s": a["hang_alert_latency_past_threshold_s"],
            p + "planted_named": f"hang={_fmt(a['hang_named'])} slow={_fmt(a['slow_named'])} dead={_fmt(a['dead_named'])}",
            p + "false_alerts": a["false_alerts"],
            p + "proc_cpu_us_per_rank_s": c["processors_cpu_us_per_rank_s"],
            p + "sustained": c["sustained"]})
    for w in workers:
        ok = [c["ranks"] for c in configs if c["workers"] == w and c.get("sustained")]
        metrics[f"max_ranks_sustained_w{w}"] = max(ok) if ok else 0
    return {"name": "scale", "configs": configs, "metrics": metrics,
            "settings": {"duration_s": duration_s, "wire": wire, "loadgen_procs": procs, "steps_per_s": 1.0,
                         "hang_min_s": base.hang_min_s, "dead_after_s": base.dead_after_s,
                         "topic_partitions": base.topic_partitions, "lag_growth_max": LAG_GROWTH_MAX,
                         "cpu_cores": os.cpu_count(), "broker_warmup_s": warmup_s if warmup else 0.0},
            "targets": {f"max_ranks_sustained_w{w}": "largest rank count with lag p99 < hang_min_s and not growing"
                        for w in workers}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)), help="comma-separated rank counts")
    p.add_argument("--workers", default=",".join(map(str, DEFAULT_WORKERS)), help="comma-separated processors worker counts")
    p.add_argument("--duration", type=float, default=DEFAULT_DURATION_S, help="seconds of load per configuration")
    p.add_argument("--wire", choices=("v1", "v2"), default="v2")
    p.add_argument("--procs", type=int, default=2, help="load generator processes")
    p.add_argument("--partitions", type=int, default=None, help="partitions per topic (default: the setting)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (service logs)")
    p.add_argument("--profile-s", type=float, default=DEFAULT_PROFILE_S,
                   help="each rank sends its sampled stacks this often, as ranks do by default (0: none)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="measure the first configuration on a cold broker (no discarded warm-up run)")
    a = p.parse_args(argv)
    try:
        fault_times(a.duration, Settings().hang_min_s)
    except ValueError as e:
        p.error(str(e))
    t0 = time.monotonic()
    result = run(tuple(int(x) for x in a.ranks.split(",")), tuple(int(x) for x in a.workers.split(",")), a.duration,
                 a.wire, a.procs, a.keep, a.partitions, a.warmup, a.profile_s)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scale.json").write_text(json.dumps(result, indent=2))
    print()
    print_table(result["configs"])
    print(f"\nJSON results in {RESULTS / 'scale.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
