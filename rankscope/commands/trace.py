"""``rankscope trace --job J [--ranks 0-7] --steps N [--every 10m | --every-steps K | --continuous] [--stop]``

Sends a control message to the job's ranks and prints each rank's acknowledgement (accepted,
queued, rejected with the reason, then done with the window's event counts when ``--wait-done``).
Exit status: 0 all addressed ranks accepted; 1 some rejected; 2 bad arguments, unknown job or
ranks, or no answer in time.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

from rankscope.config import Settings
from rankscope.kafka_client import client_conf
from rankscope.topics import Topic
from rankscope.trace_start import START_LEAD_NS, plan_start_step, steps_per_period
from rankscope.wire import Envelope, WireError, decode, encode

DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)?$")
UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("trace", parents=[common], help="open trace windows on a running job's ranks")
    p.add_argument("--job", required=True)
    p.add_argument("--ranks", default="", help="e.g. 0-3,8 (default: every rank)")
    p.add_argument("--steps", type=int, default=3, help="steps per window (1-10000)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--every", default="", help="periodic: a window every DURATION (e.g. 30s, 10m)")
    mode.add_argument("--every-steps", type=int, default=0, help="periodic: a window every K steps")
    mode.add_argument("--continuous", action="store_true", help="back-to-back windows until --stop")
    mode.add_argument("--stop", action="store_true", help="stop running windows and schedules")
    p.add_argument("--shapes", action="store_true", help="record tensor shapes (more overhead)")
    p.add_argument("--no-stack", action="store_true", help="without Python stacks (less overhead)")
    p.add_argument("--byte-budget", type=int, default=0, help="raw-event bytes per window per rank (0 = rank default)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds to wait for acknowledgements")
    p.add_argument("--wait-done", action="store_true", help="also wait until every rank has sent its window")
    p.add_argument("--auto-analyze", action="store_true",
                   help="wait for the window's diagnosis report (implies --wait-done) and print or save it")
    p.add_argument("--output-dir", default="", help="with --auto-analyze: write the report here (JSON and Markdown)")
    p.set_defaults(func=run)


def parse_ranks(spec: str) -> list[int] | None:
    """``"0-3,8"`` -> [0, 1, 2, 3, 8]; empty -> None (all ranks). Raises ValueError naming the part."""
    if not spec.strip():
        return None
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"bad rank range {part!r} in --ranks {spec!r}; use e.g. 0-3,8")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"bad rank range {part!r}: {hi} < {lo}")
        out.update(range(lo, hi + 1))
    return sorted(out)


def parse_duration(spec: str) -> float:
    m = DURATION.match(spec.strip())
    if not m:
        raise ValueError(f"bad duration {spec!r}; use e.g. 500ms, 30s, 10m, 1h")
    return float(m.group(1)) * UNIT_S[m.group(2)]


def known_ranks(settings: Settings, job: str, timeout_s: float = 5.0) -> dict[str, list[int]]:
    """Jobs and their ranks, from the latest stats published by the processors (tail of the stats topic)."""
    return {j: sorted(r["rank"] for r in rows) for j, rows in latest_stats(settings, timeout_s).items()}


def latest_stats(settings: Settings, timeout_s: float = 5.0) -> dict[str, list[dict[str, Any]]]:
    """Per job, the latest stats row of each rank (tail of the stats topic; a job's ranks arrive in
    messages from several shards)."""
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    topic = Topic.STATS.name_for(settings)
    c = Consumer({**client_conf(settings, fatal=True), "group.id": f"rankscope-cli-{uuid.uuid4().hex[:8]}",
                  "enable.auto.commit": False})
    latest: dict[str, dict[int, dict[str, Any]]] = {}
    jobs: dict[str, list[dict[str, Any]]] = {}
    try:
        md = c.list_topics(topic, timeout=timeout_s)
        parts = list(md.topics[topic].partitions) if topic in md.topics else []
        assign = []
        ends: dict[int, int] = {}
        for p in parts:
            try:
                lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
            except KafkaException:  # partition leader not elected yet (new topic): nothing to read there
                continue
            if hi > lo:
                assign.append(TopicPartition(topic, p, max(lo, hi - 2000)))
                ends[p] = hi
        if not assign:
            return jobs
        c.assign(assign)
        remaining = {tp.partition for tp in assign}
        deadline = time.monotonic() + timeout_s
        while remaining and time.monotonic() < deadline:
            msg = c.poll(0.2)
            if msg is None or msg.error():
                continue
            if msg.offset() + 1 >= ends.get(msg.partition(), 0):
                remaining.discard(msg.partition())
            try:
                env = decode(msg.value())
            except WireError:
                continue
            rows = latest.setdefault(env.job, {})
            for r in env.body["ranks"]:
                if isinstance(r, dict) and isinstance(r.get("rank"), int) and \
                        r.get("ts_ns", 0) >= rows.get(r["rank"], {}).get("ts_ns", 0):
                    rows[r["rank"]] = r
    finally:
        c.close()
    for job, rows in latest.items():
        jobs[job] = [rows[r] for r in sorted(rows)]
    return jobs


def open_replies_reader(settings: Settings, group_id: str, timeout_s: float = 10.0,
                        consumer_factory: Any = None) -> Any:
    """A consumer at the end of every partition of the replies topic, assigned before a request goes
    out so that no ack is missed (the CLI's and the dashboard's). Raises RuntimeError naming the fix
    when the topic is missing (a cluster set up before it existed)."""
    from confluent_kafka import OFFSET_END, Consumer, TopicPartition

    replies = Topic.REPLIES.name_for(settings)
    consumer = (consumer_factory or Consumer)({**client_conf(settings, fatal=True), "group.id": group_id,
                                               "enable.auto.commit": False})
    try:
        meta = consumer.list_topics(replies, timeout=timeout_s).topics.get(replies)
        if meta is None or meta.error is not None or not meta.partitions:
            raise RuntimeError(f"the replies topic {replies} is missing at {settings.bootstrap}, so no "
                               "acknowledgement can be read; create it with: rankscope kafka topics")
        consumer.assign([TopicPartition(replies, p, OFFSET_END) for p in meta.partitions])
        consumer.poll(0.5)  # take the assignment now
    except BaseException:
        consumer.close()
        raise
    return consumer


def iter_acks(consumer: Any, request_id: str, deadline: float, job: str | None = None,
              poll_s: float = 0.2) -> Iterator[Envelope]:
    """The ``ack`` envelopes answering ``request_id`` (of ``job`` if given) read from ``consumer``
    until the monotonic ``deadline``; undecodable and unrelated messages are skipped."""
    while time.monotonic() < deadline:
        msg = consumer.poll(poll_s)
        if msg is None or msg.error():
            continue
        try:
            env = decode(msg.value())
        except WireError:
            continue
        if env.kind == "ack" and env.body.get("request_id") == request_id and (job is None or env.job == job):
            yield env


def build_request(args: argparse.Namespace, ranks: list[int] | None, request_id: str, job: str,
                  first_step: int = 0, period_steps: int = 0) -> bytes:
    """The control message; ``first_step`` > 0 makes every rank start at that step
    (:func:`rankscope.trace_start.plan_start_step`); ``period_steps`` > 0 sends ``--every DURATION``
    as that many steps (:func:`rankscope.trace_start.steps_per_period`), else as seconds."""
    if args.stop:
        command, cargs = "stop", {}
    else:
        cargs: dict[str, Any] = {"steps": args.steps, "with_shapes": args.shapes, "with_stack": not args.no_stack,
                                 "byte_budget": args.byte_budget}
        if first_step > 0:
            cargs.update(start_step=first_step, lead_ns=START_LEAD_NS)
        if args.every and period_steps > 0:
            cargs["every_steps"] = period_steps
        elif args.every:
            cargs["every_s"] = parse_duration(args.every)
        if args.every_steps:
            cargs["every_steps"] = args.every_steps
        if args.continuous:
            cargs["continuous"] = True
        command = "trace"
    env = Envelope(kind="control", job=job, rank=-1, host="cli", pid=0, seq=1, sent_ns=time.time_ns(),
                   body={"command": command, "request_id": request_id, "ranks": ranks, "args": cargs})
    return encode(env)


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.auto_analyze:
        args.wait_done = True
    rc, request_id = send_and_wait(args, settings)
    if rc != 0 or not args.auto_analyze or args.stop:
        return rc
    from rankscope.commands.report import render_markdown_for, wait_for_report, write_report

    rep = wait_for_report(settings, args.job, request_id, max(args.timeout, settings.report_deadline_s + 30))
    if rep is None:
        print(f"no report for window {request_id} (are the processors running?)", file=sys.stderr)
        return 1
    if args.output_dir:
        for p in write_report(rep, args.output_dir):
            print(f"report written: {p}")
    else:
        print(render_markdown_for(rep))
    return 0


def send_and_wait(args: argparse.Namespace, settings: Settings) -> tuple[int, str]:
    from confluent_kafka import Producer

    try:
        ranks = parse_ranks(args.ranks)
        if not 1 <= args.steps <= 10_000:
            raise ValueError(f"--steps must be in [1, 10000], got {args.steps}")
        if args.every:
            parse_duration(args.every)
        if args.every_steps and args.every_steps < args.steps:
            raise ValueError(f"--every-steps {args.every_steps} must be >= --steps {args.steps}")
    except ValueError as e:
        print(f"rankscope trace: {e}", file=sys.stderr)
        return 2, ""
    stats = latest_stats(settings)
    jobs = {j: sorted(r["rank"] for r in rows) for j, rows in stats.items()}
    if args.job not in jobs:
        known = ", ".join(sorted(jobs)) or "none"
        print(f"rankscope trace: unknown job {args.job!r} (jobs with recent stats: {known})", file=sys.stderr)
        return 2, ""
    job_ranks = jobs[args.job]
    if ranks is not None:
        missing = sorted(set(ranks) - set(job_ranks))
        if missing:
            print(f"rankscope trace: job {args.job} has no rank {missing}; its ranks are {job_ranks}", file=sys.stderr)
            return 2, ""
    targets = ranks if ranks is not None else job_ranks
    request_id = f"tw{uuid.uuid4().hex[:8]}"
    topic = Topic.CONTROL.name_for(settings)
    try:
        consumer = open_replies_reader(settings, f"rankscope-cli-{request_id}")
    except RuntimeError as e:
        print(f"rankscope trace: {e}", file=sys.stderr)
        return 2, ""
    producer = Producer(client_conf(settings, fatal=True))
    period = steps_per_period(stats[args.job], parse_duration(args.every), args.steps) if args.every else 0
    producer.produce(topic, key=args.job.encode(),
                     value=build_request(args, ranks, request_id, args.job,
                                         plan_start_step(stats[args.job], time.time_ns(), START_LEAD_NS), period))
    producer.flush(10)
    print(f"request {request_id} sent to job {args.job} ranks {targets}", flush=True)
    if period:
        print(f"--every {args.every} = every {period} steps at the job's current step time "
              "(so that every rank traces the same steps)", flush=True)
    status: dict[int, str] = {}
    done: set[int] = set()
    deadline = time.monotonic() + args.timeout
    try:
        for env in iter_acks(consumer, request_id, deadline):
            st = env.body["status"]
            print(f"rank {env.rank}: {st} {env.body['detail']}", flush=True)
            if st == "done":
                done.add(env.rank)
            else:
                status[env.rank] = st
            answered = set(status) >= set(targets)
            if answered and (not args.wait_done or args.stop or set(done) >= set(targets)
                             or any(v == "rejected" for v in status.values())):
                break
    finally:
        consumer.close()
    silent = sorted(set(targets) - set(status))
    if silent:
        print(f"no answer from ranks {silent} within {args.timeout:g}s (not running, or not reachable)", file=sys.stderr)
        return 2, request_id
    if args.wait_done and not args.stop and set(done) < set(targets):
        print(f"ranks {sorted(set(targets) - done)} did not finish their window within {args.timeout:g}s", file=sys.stderr)
        return 1, request_id
    return (1 if any(v == "rejected" for v in status.values()) else 0), request_id
