"""``rankscope report --job J [--window W] [--format json|md] [--output-dir D]``: a diagnosis report
(the processors build one per trace window) as the store keeps it, the same the dashboard's Reports
page reads; through serve's query endpoint while serve holds the embedded store. ``--timeout`` waits
that long for a matching report to be stored. Markdown is the Reports page's reading
(:mod:`rankscope.report_view`): verdict, charts' data, PerfTracker's sections. Exit status: 0 shown
or written; 1 the store cannot be read; 2 no matching report."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rankscope.cli.store_reader import read_store
from rankscope.config import Settings
from rankscope.report_view import render_markdown


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("report", parents=[common], help="print or save diagnosis reports of a job")
    p.add_argument("--job", required=True)
    p.add_argument("--window", default="", help="window id, or a request id prefix (default: the latest)")
    p.add_argument("--format", choices=("json", "md"), default="md")
    p.add_argument("--output-dir", default="", help="write <window>.json and <window>.md here")
    p.add_argument("--timeout", type=float, default=0.0, help="seconds to wait for a matching report to be stored")
    p.set_defaults(func=run)


def write_report(report: dict[str, Any], output_dir: str) -> list[Path]:
    d = Path(output_dir)
    d.mkdir(parents=True, exist_ok=True)
    base = d / str(report["window_id"]).replace("/", "_")
    paths = [base.with_suffix(".json"), base.with_suffix(".md")]
    paths[0].write_text(json.dumps(report, indent=2, default=str))
    paths[1].write_text(render_markdown(report))
    return paths


def stored_report(settings: Settings, job: str, window_prefix: str, timeout_s: float) -> dict[str, Any] | int | None:
    """The newest stored report of ``job`` matching ``window_prefix``, polled for up to ``timeout_s``;
    None when there is none by then, or the exit status when the store cannot be read."""
    from rankscope.storage.reports import latest_report

    deadline = time.monotonic() + timeout_s
    while True:
        got = read_store(settings, lambda store: latest_report(store, job, window_prefix), "report")
        if got is not None or time.monotonic() >= deadline:
            return got
        time.sleep(1.0)


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.timeout < 0:
        print("rankscope report: --timeout must be >= 0", file=sys.stderr)
        return 2
    rep = stored_report(settings, args.job, args.window, args.timeout)
    if isinstance(rep, int):
        return rep
    if rep is None:
        print(f"rankscope report: no report for job {args.job!r}"
              + (f" window {args.window!r}" if args.window else "")
              + (f" within {args.timeout:g}s" if args.timeout else " in the store")
              + f" (open a window: rankscope trace --job {args.job} --steps 3 --auto-analyze)",
              file=sys.stderr)
        return 2
    if args.output_dir:
        for p in write_report(rep, args.output_dir):
            print(p)
        return 0
    print(json.dumps(rep, indent=2, default=str) if args.format == "json" else render_markdown(rep))
    return 0
