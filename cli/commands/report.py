"""``rankscope report --job J [--window W] [--format json|md] [--output-dir D]``: diagnosis reports
from the reports topic (the processors build one per trace window). Markdown is the Reports page's
reading (:mod:`rankscope.report_view`): verdict, charts' data, PerfTracker's sections."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rankscope.config import Settings
from rankscope.consuming import one_off_group, open_consumer
from rankscope.report_view import render_markdown
from rankscope.topics import Topic


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("report", parents=[common], help="print or save diagnosis reports of a job")
    p.add_argument("--job", required=True)
    p.add_argument("--window", default="", help="window id, or a request id prefix (default: the latest)")
    p.add_argument("--format", choices=("json", "md"), default="md")
    p.add_argument("--output-dir", default="", help="write <window>.json and <window>.md here")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a matching report")
    p.set_defaults(func=run)


def wait_for_report(settings: Settings, job: str, window_prefix: str, timeout_s: float,
                    from_beginning: bool = True) -> dict[str, Any] | None:
    """The newest report of ``job`` whose window id starts with ``window_prefix``, waiting up to timeout."""
    c = open_consumer(settings, one_off_group("cli"), {"auto.offset.reset": "earliest" if from_beginning else "latest",
                                                       "enable.auto.commit": False})
    c.subscribe([Topic.REPORTS.name_for(settings)])
    found: dict[str, Any] | None = None
    deadline = time.monotonic() + timeout_s
    idle_since = time.monotonic()
    try:
        while time.monotonic() < deadline:
            msg = c.poll(0.3)
            if msg is None or msg.error():
                if found is not None and time.monotonic() - idle_since > 1.5:
                    break  # caught up: the newest match is known
                continue
            idle_since = time.monotonic()
            try:
                rep = json.loads(msg.value() or b"")
            except ValueError:
                continue
            if rep.get("job") == job and str(rep.get("window_id", "")).startswith(window_prefix):
                found = rep
    finally:
        c.close()
    return found


def write_report(report: dict[str, Any], output_dir: str) -> list[Path]:
    d = Path(output_dir)
    d.mkdir(parents=True, exist_ok=True)
    base = d / str(report["window_id"]).replace("/", "_")
    paths = [base.with_suffix(".json"), base.with_suffix(".md")]
    paths[0].write_text(json.dumps(report, indent=2, default=str))
    paths[1].write_text(render_markdown(report))
    return paths


def render_markdown_for(report: dict[str, Any]) -> str:
    """The Markdown reading of ``report`` (as ``--format md`` prints it)."""
    return render_markdown(report)


def run(args: argparse.Namespace, settings: Settings) -> int:
    rep = wait_for_report(settings, args.job, args.window, args.timeout)
    if rep is None:
        print(f"rankscope report: no report for job {args.job!r}"
              + (f" window {args.window!r}" if args.window else "")
              + f" within {args.timeout:g}s (open a window: rankscope trace --job {args.job} --steps 3)",
              file=sys.stderr)
        return 2
    if args.output_dir:
        for p in write_report(rep, args.output_dir):
            print(p)
        return 0
    print(json.dumps(rep, indent=2, default=str) if args.format == "json" else render_markdown(rep))
    return 0
