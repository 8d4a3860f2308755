"""``rankscope serve`` (dashboard + sink in one process) and ``rankscope sink`` (the sink alone)."""

from __future__ import annotations

import argparse
import sys

from rankscope.cli import extras
from rankscope.config import Settings


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "serve", parents=[common],
        help="run the dashboard and the Kafka->ClickHouse sink in one process",
        description="Run the Streamlit dashboard on <dashboard host>:<dashboard port> and, unless --no-sink, the "
                    "sink in the same process. In embedded mode (chdb:// store) this process must be the "
                    "only one holding the data directory.")
    p.add_argument("--no-sink", action="store_true",
                   help="dashboard only (production: sinks run elsewhere against a ClickHouse server)")
    p.add_argument("--script", default=None, help="Streamlit script to run (default: the rankscope dashboard)")
    p.set_defaults(func=cmd_serve)

    s = sub.add_parser(
        "sink", parents=[common], help="run the Kafka->ClickHouse sink alone",
        description="Consume the rankscope topics into ClickHouse, committing offsets after each insert. "
                    "Meant for a ClickHouse server DSN; several sinks share the work as a consumer group.")
    s.set_defaults(func=cmd_sink)


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    extras.require("rankscope serve", "dashboard", *extras.store_extras(settings.embedded_store))
    from rankscope.storage.serve import serve
    from rankscope.storage.store import StoreError

    try:
        return serve(settings, args.script, with_sink=not args.no_sink)
    except StoreError as e:
        print(f"rankscope serve: {e}", file=sys.stderr)
        return 2


def cmd_sink(args: argparse.Namespace, settings: Settings) -> int:
    extras.require("rankscope sink", *extras.store_extras(settings.embedded_store))
    from rankscope.storage.serve import run_sink
    from rankscope.storage.store import StoreError

    try:
        return run_sink(settings)
    except StoreError as e:
        print(f"rankscope sink: {e}", file=sys.stderr)
        return 2
