"""``rankscope flight --job J [--ranks 0-3] [--reason TEXT]``: ask a running job's ranks for their
step histories (rankscope's own: each rank's last step records and every thread's stack) and their
PyTorch Flight Recorder dumps (every collective each rank's ring holds), as a hang alert does by itself.

Prints each rank's acknowledgement and the command that exports the dumps once the sink has stored
them. Exit status: 0 every addressed rank answered; 1 some did not in time; 2 bad arguments or
Kafka unreachable.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid

from rankscope.config import Settings
from rankscope.topics import Topic


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("flight", parents=[common], help="ask a job's ranks for their step histories and "
                                                        "PyTorch Flight Recorder dumps")
    p.add_argument("--job", required=True)
    p.add_argument("--ranks", default="", help="e.g. 0-3,8 (default: every rank)")
    p.add_argument("--reason", default="requested", help="stored with the dumps")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds to wait for acknowledgements")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from confluent_kafka import Producer

    from rankscope.control_io import iter_acks, open_replies_reader
    from rankscope.kafka_client import client_conf
    from rankscope.protocol.envelope import Envelope, encode
    from rankscope.trace_request import parse_ranks

    try:
        ranks = parse_ranks(args.ranks)
    except ValueError as e:
        print(f"rankscope flight: error: {e}", file=sys.stderr)
        return 2
    if args.timeout <= 0:
        print(f"rankscope flight: error: --timeout must be > 0, got {args.timeout}", file=sys.stderr)
        return 2
    request_id = f"flight-cli-{uuid.uuid4().hex[:10]}"
    body = {"command": "flight", "request_id": request_id, "ranks": ranks, "args": {"reason": args.reason[:200]}}
    try:
        replies = open_replies_reader(settings, f"rankscope-cli-{uuid.uuid4().hex[:8]}")
    except Exception as e:
        print(f"rankscope flight: error: {e}", file=sys.stderr)
        return 2
    try:
        producer = Producer(client_conf(settings))
        env = Envelope(kind="control", job=args.job, rank=-1, host="cli", pid=0, seq=1, sent_ns=time.time_ns(),
                       body=body)
        producer.produce(Topic.CONTROL.name_for(settings), key=args.job.encode(), value=encode(env))
        if producer.flush(10.0):
            print(f"rankscope flight: error: the request was not delivered to {settings.bootstrap}", file=sys.stderr)
            return 2
        print(f"request {request_id} sent to job {args.job}")
        answered: set[int] = set()
        for ack in iter_acks(replies, request_id, time.monotonic() + args.timeout, job=args.job):
            answered.add(ack.rank)
            print(f"rank {ack.rank}: {ack.body['status']} {ack.body['detail']}")
            if ranks is not None and answered >= set(ranks):
                break
    finally:
        replies.close()
    print(f"export the dumps (once stored): rankscope export --job {args.job} --fr-dump --window {request_id} "
          f"-o fr-{args.job}")
    missing = sorted(set(ranks) - answered) if ranks is not None else []
    if missing or not answered:
        print(f"rankscope flight: no answer in {args.timeout:.0f}s from "
              f"{'ranks ' + ','.join(map(str, missing)) if missing else 'any rank'}", file=sys.stderr)
        return 1
    return 0
