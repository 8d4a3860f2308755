"""``rankscope alerts [--follow] [--json] [--job J]``: read the alerts topic.

``rankscope alerts --webhook URL [--format alertmanager|slack] [--group G]``: forward every alert
version to a webhook, once, in Alertmanager's or Slack's format, until SIGTERM
(cli/commands/webhook_forwarder.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
import urllib.parse
from datetime import UTC, datetime

from rankscope.cli.commands.webhook_delivery import RetryPolicy, url_for_logs
from rankscope.cli.commands.webhook_formats import FORMATS
from rankscope.config import Settings
from rankscope.consuming import one_off_group, open_consumer
from rankscope.protocol.alerts import Alert
from rankscope.topics import Topic

log = logging.getLogger("rankscope.alerts")

DEFAULT_GROUP = "rankscope-alerts-webhook"
DEFAULT_FORMAT = "alertmanager"
DEFAULT_MAX_AGE_S = 86400.0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("alerts", parents=[common], help="print alerts from the alerts topic, or forward them to a webhook")
    p.add_argument("--follow", "-f", action="store_true", help="keep waiting for new alerts")
    p.add_argument("--json", action="store_true", help="one JSON document per line (the wire schema)")
    p.add_argument("--job", default="", help="only this job")
    p.add_argument("--timeout", type=float, default=5.0, help="without --follow: stop after this many idle seconds")
    w = p.add_argument_group("forwarding to a webhook (runs until SIGTERM)")
    w.add_argument("--webhook", default="", metavar="URL", help="POST each alert version to this http(s) URL")
    w.add_argument("--format", choices=sorted(FORMATS), default=None,
                   help="the webhook's body: Alertmanager's webhook JSON (default) or a Slack message")
    w.add_argument("--group", default=None,
                   help=f"Kafka consumer group whose offsets record what was delivered (default {DEFAULT_GROUP})")
    w.add_argument("--attempts", type=int, default=RetryPolicy.attempts,
                   help="sends per alert on connection errors and 5xx before it is skipped")
    w.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE_S,
                   help="seconds: skip alert versions older than this (0 = none are too old)")
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
    if args.webhook:
        return run_webhook(args, settings)
    if args.format or args.group:
        print("rankscope alerts: --format and --group go with --webhook", file=sys.stderr)
        return 2
    consumer = open_consumer(settings, one_off_group("alerts"), {"auto.offset.reset": "earliest",
                                                                 "enable.auto.commit": False})
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


def run_webhook(args: argparse.Namespace, settings: Settings) -> int:
    """Forward the alerts topic to ``args.webhook`` until SIGTERM or SIGINT; 2 on bad flags."""
    from rankscope.cli.commands.webhook_forwarder import Forwarder, forward

    if urllib.parse.urlsplit(args.webhook).scheme not in ("http", "https"):
        print(f"rankscope alerts: --webhook must be an http:// or https:// URL, got {args.webhook!r}", file=sys.stderr)
        return 2
    try:
        policy = RetryPolicy(attempts=args.attempts)
    except ValueError as e:
        print(f"rankscope alerts: --attempts: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    fmt, group = args.format or DEFAULT_FORMAT, args.group or DEFAULT_GROUP
    forwarder = Forwarder(args.webhook, FORMATS[fmt], policy, job=args.job, max_age_s=args.max_age, wait=stop.wait)
    # A delivery blocks the poll loop; the group must not count the consumer as gone meanwhile.
    poll_interval_ms = max(300_000, int(policy.worst_case_s() * 2000))
    consumer = open_consumer(settings, group, {"auto.offset.reset": "earliest", "enable.auto.commit": False,
                                               "max.poll.interval.ms": poll_interval_ms})
    consumer.subscribe([Topic.ALERTS.name_for(settings)])
    log.info("forwarding %s to %s (%s format, group %s)", Topic.ALERTS.name_for(settings),
             url_for_logs(args.webhook), fmt, group)
    try:
        forward(consumer, forwarder, stop)
    finally:
        consumer.close()
        log.info("stopped; alerts %s", dict(sorted(forwarder.counts.items())) or "none")
    return 0
