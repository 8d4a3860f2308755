"""``rankscope alerts [--follow] [--json] [--job J]``: read the alerts topic."""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from datetime import UTC, datetime

from rankscope.alerts import Alert
from rankscope.config import Settings
from rankscope.kafka_client import client_conf
from rankscope.topics import Topic


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("alerts", parents=[common], help="print alerts from the alerts topic")
    p.add_argument("--follow", "-f", action="store_true", help="keep waiting for new alerts")
    p.add_argument("--json", action="store_true", help="one JSON document per line (the wire schema)")
    p.add_argument("--job", default="", help="only this job")
    p.add_argument("--timeout", type=float, default=5.0, help="without --follow: stop after this many idle seconds")
    p.set_defaults(func=run)


def format_alert(a: Alert) -> str:
    when = datetime.fromtimestamp(a.updated_ns / 1e9, UTC).strftime("%H:%M:%S")
    lines = [f"{when} [{a.severity}] {a.kind} {a.status} v{a.version} {a.alert_id}: {a.summary}"]
    for g in a.stack_groups:
        tag = "waiting in collective" if g.waiting_in_collective else "CULPRIT?"
        lines.append(f"    ranks {','.join(map(str, g.ranks))} ({tag}):")
        lines += [f"        {f}" for f in g.frames[-8:]]
    return "\n".join(lines)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from confluent_kafka import Consumer

    consumer = Consumer({**client_conf(settings, fatal=True), "group.id": f"rankscope-alerts-{uuid.uuid4().hex[:8]}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([Topic.ALERTS.name_for(settings)])
    idle_since = time.monotonic()
    try:
        while True:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                if not args.follow and time.monotonic() - idle_since > args.timeout:
                    return 0
                continue
            idle_since = time.monotonic()
            try:
                alert = Alert.from_json(msg.value() or b"")
            except ValueError as e:
                print(f"skipping malformed alert at offset {msg.offset()}: {e}", file=sys.stderr)
                continue
            if args.job and alert.job != args.job:
                continue
            print(json.dumps(json.loads(alert.to_json())) if args.json else format_alert(alert), flush=True)
    except KeyboardInterrupt:
        return 0
    finally:
        consumer.close()
