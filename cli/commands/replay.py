"""``rankscope replay <files or folder> --job NAME [--window-id W]``: send recorded Kineto trace files
through the live pipeline, as if the ranks had just traced a window.

Each rank's file becomes the messages a trace window ships (producers/trace_window.py): its events
in ``trace`` chunks on the traces topic (key ``job/rank``), then a ``summary`` on the summaries topic
(key ``job``, ``request_ranks`` None, collective arrivals). The processors then build the window's
diagnosis report (after ``report_deadline_s``, as no live rank announces the job's ranks) and the
sink stores events, summaries and report, so the dashboard, ``rankscope report`` and
``rankscope export`` work on recorded traces.

Timestamps are shifted, all ranks by the same amount, so that the latest event ends now (the store
expires old rows); ``--keep-timestamps`` keeps the trace's own epoch time.
Exit status: 0 sent; 1 the broker did not take every message; 2 bad arguments or trace files.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from typing import Any

from rankscope.config import Settings
from rankscope.kafka_client import client_conf
from rankscope.protocol.envelope import Envelope, encode
from rankscope.topics import Topic


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "replay", parents=[common], help="send recorded Kineto trace files through the pipeline as a trace window",
        description="Read torch.profiler (Kineto) trace files, one per rank (.json or .json.gz; folders are "
                    "expanded), and ship them like a live trace window so the processors build a report "
                    "and the store keeps the events.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace files or folders of trace files")
    p.add_argument("--job", required=True, help="job name to file the window under")
    p.add_argument("--window-id", default="", help="window id (default: rp<random>-0)")
    p.add_argument("--byte-budget", type=int, default=0,
                   help="event bytes per rank, as for live windows (0 = RANKSCOPE_TRACE_BYTE_BUDGET)")
    p.add_argument("--keep-timestamps", action="store_true",
                   help="keep the traces' own times instead of moving the window to end now")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the broker to take the messages")
    p.set_defaults(func=run)


def host_of(metadata: Mapping[str, Any]) -> str:
    for key in ("hostname", "host", "hostName"):
        v = metadata.get(key)
        if isinstance(v, str) and v:
            return v
    return "replay"


def window_messages(events: list[dict[str, Any]], window_id: str, byte_budget: int
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The ``trace`` bodies and the ``summary`` body of one rank's window, built exactly like a live
    window (producers/trace_window.py ``WindowController._ship``)."""
    from rankscope.producers.trace_events import chunk, summarize, summary_body, to_columnar
    from rankscope.producers.trace_window import collective_arrivals

    cols = to_columnar(events, window_id, None)
    bodies, truncated, sent = chunk(cols, byte_budget)
    summary = summary_body(cols, summarize(cols, compact_paths=True), events_sent=sent, truncated=truncated,
                           status="complete")
    summary.update(request_id=window_id.rsplit("-", 1)[0], request_ranks=None, arrivals=collective_arrivals(cols))
    return bodies, summary


def _err(msg: str) -> int:
    print(f"rankscope replay: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.offline.kineto import load_traces
    from rankscope.offline.replay import event_dicts, skipped_count, time_offsets_ns

    job = args.job.strip()
    if not job or "/" in job:
        return _err(f"--job must be a non-empty name without '/', got {args.job!r}")
    if args.byte_budget < 0:
        return _err(f"--byte-budget must be >= 0, got {args.byte_budget}")
    window_id = args.window_id.strip() or f"rp{uuid.uuid4().hex[:8]}-0"
    budget = args.byte_budget or settings.trace_byte_budget
    try:
        traces = load_traces(args.paths, extra_columns=True)
    except (ValueError, OSError) as e:
        return _err(str(e))
    offsets = time_offsets_ns(traces, None if args.keep_timestamps else time.time_ns())

    prepared: list[tuple[int, str, list[dict[str, Any]], dict[str, Any], int, Counter[str]]] = []
    for rank, trace in traces.items():
        events = event_dicts(trace.events, offset_ns=offsets[rank])
        if not events:
            return _err(f"{trace.path}: no kernel, memcpy, runtime, op, python or annotation events to replay")
        try:
            bodies, summary = window_messages(events, window_id, budget)
        except ValueError as e:
            return _err(f"{trace.path}: {e}")
        prepared.append((rank, host_of(trace.metadata), bodies, summary, skipped_count(trace.events),
                         Counter(e["type"] for e in events)))

    from confluent_kafka import KafkaException, Producer

    # log_level 2: librdkafka's connection-refused lines would bury the one message below.
    producer = Producer({**client_conf(settings, fatal=True), "client.id": f"rankscope-replay-{job}",
                         "log_level": 2})
    try:
        producer.list_topics(timeout=min(10.0, args.timeout))
    except KafkaException as e:
        print(f"rankscope replay: cannot reach Kafka at {settings.bootstrap}: {e} "
              "(start it with `rankscope up`, or pass --bootstrap-servers)", file=sys.stderr)
        return 1
    failed: list[str] = []

    def delivered(err: Any, msg: Any) -> None:
        if err is not None:
            failed.append(f"{msg.topic()}: {err}")

    def send(topic: str, key: str, env: Envelope) -> None:
        data = encode(env)
        while True:
            try:
                producer.produce(topic, key=key.encode(), value=data, on_delivery=delivered)
                break
            except BufferError:
                producer.poll(0.2)
        producer.poll(0)

    traces_topic, summaries_topic = Topic.TRACES.name_for(settings), Topic.SUMMARIES.name_for(settings)
    total = 0
    for rank, host, bodies, summary, skipped, types in prepared:
        seq = 0
        for body in bodies:
            seq += 1
            send(traces_topic, f"{job}/{rank}",
                 Envelope(kind="trace", job=job, rank=rank, host=host, pid=0, seq=seq, sent_ns=time.time_ns(),
                          body=body))
        seq += 1
        send(summaries_topic, job,
             Envelope(kind="summary", job=job, rank=rank, host=host, pid=0, seq=seq, sent_ns=time.time_ns(),
                      body=summary))
        n, sent = summary["events_total"], summary["events_sent"]
        total += sent
        kinds = ", ".join(f"{t} {c}" for t, c in types.most_common())
        line = (f"rank {rank}: {sent}/{n} events in {len(bodies)} chunks, steps {summary['first_step']}-"
                f"{summary['last_step']} ({kinds})")
        if skipped:
            line += f"; {skipped} other events left out"
        if summary["truncated"]:
            line += f"; TRUNCATED to the {budget}-byte budget (raise --byte-budget)"
        print(line, flush=True)
    left = producer.flush(args.timeout)
    if left or failed:
        why = "; ".join(failed[:3]) or f"{left} messages still queued after {args.timeout:g}s"
        print(f"rankscope replay: not every message reached Kafka at {settings.bootstrap}: {why}", file=sys.stderr)
        return 1
    print(f"window {window_id} of job {job}: {total} events from {len(prepared)} ranks sent; the report follows "
          f"within about {settings.report_deadline_s:g}s (rankscope report --job {job} --window {window_id})")
    return 0
