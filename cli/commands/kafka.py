"""``rankscope kafka start|stop|status|topics``: the project-managed Kafka broker and its topics."""

from __future__ import annotations

import argparse
import sys

from rankscope.cli.stack.admin import KafkaUnavailable, ensure_topics, kafka_answers, topic_differences
from rankscope.cli.stack.broker import BrokerError, LocalBroker, ensure_broker
from rankscope.config import Settings


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("kafka", help="manage the local Kafka broker and the rankscope topics",
                              description=__doc__)
    sub = p.add_subparsers(dest="kafka_command", required=True, metavar="ACTION")

    s = sub.add_parser("start", parents=[common], help="start (or reuse) the local broker; print bootstrap")
    s.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for readiness")
    s.add_argument("--no-topics", action="store_true", help="do not create the rankscope topics")
    s.set_defaults(func=_start)

    s = sub.add_parser("stop", parents=[common], help="stop the local broker")
    s.add_argument("--timeout", type=float, default=30.0, help="seconds before SIGKILL")
    s.set_defaults(func=_stop)

    s = sub.add_parser("status", parents=[common], help="is the broker running and answering? (rc 0 = yes)")
    s.set_defaults(func=_status)

    s = sub.add_parser("topics", parents=[common], help="create the rankscope topics (idempotent); report "
                       "existing ones whose partitions, replicas, retention or min.insync.replicas differ "
                       "from the settings")
    s.add_argument("--timeout", type=float, default=30.0)
    s.set_defaults(func=_topics)


def _start(args: argparse.Namespace, settings: Settings) -> int:
    try:
        bootstrap = ensure_broker(settings, timeout_s=args.timeout)
        if not args.no_topics:
            ensure_topics(settings, timeout_s=args.timeout)
    except (BrokerError, KafkaUnavailable) as e:
        print(f"rankscope kafka start: {e}", file=sys.stderr)
        return 1
    print(bootstrap)
    return 0


def _stop(args: argparse.Namespace, settings: Settings) -> int:
    if not settings.local_broker:
        print(f"external Kafka at {settings.bootstrap_servers}; nothing to stop")
        return 0
    stopped = LocalBroker(settings).stop(timeout_s=args.timeout)
    print("stopped" if stopped else "not running")
    return 0


def _status(args: argparse.Namespace, settings: Settings) -> int:
    answers = kafka_answers(settings, timeout_s=3.0)
    if settings.local_broker:
        pid = LocalBroker(settings).pid()
        state = f"running (pid {pid})" if pid else "not running"
        print(f"local broker {state}; {settings.bootstrap} {'answers' if answers else 'does not answer'}")
    else:
        print(f"external Kafka {settings.bootstrap} {'answers' if answers else 'does not answer'}")
    return 0 if answers else 1


def _topics(args: argparse.Namespace, settings: Settings) -> int:
    if settings.local_broker and not LocalBroker(settings).is_running():
        print("rankscope kafka topics: the local broker is not running (start it with: rankscope kafka start)",
              file=sys.stderr)
        return 1
    try:
        names = ensure_topics(settings, timeout_s=args.timeout)
    except KafkaUnavailable as e:
        hint = " (start it with: rankscope kafka start)" if settings.local_broker else ""
        print(f"rankscope kafka topics: {e}{hint}", file=sys.stderr)
        return 1
    for name in names:
        print(name)
    for line in topic_differences(settings, timeout_s=args.timeout):
        print(f"differs: {line}")
    return 0
