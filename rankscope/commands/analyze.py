"""``rankscope analyze``: offline GPU time breakdown of Kineto trace files (no broker, no store)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rankscope.config import Settings


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "analyze",
        parents=[common],
        help="break down GPU time in torch.profiler (Kineto) trace files",
        description=(
            "Read Kineto trace files (.json or .json.gz; folders are expanded to the traces they hold) "
            "and report per-rank idle/compute/communication time, compute-communication overlap, "
            "kernel type breakdown, top kernels and idle time per stream."
        ),
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace files or folders of trace files")
    p.add_argument("--format", choices=("json", "md"), default="md", help="output format (default: md)")
    p.add_argument("--hta-compatible", action="store_true",
                   help="apply Holistic Trace Analysis' conventions so the numbers match HTA's")
    p.add_argument("--top", type=int, default=10, metavar="K", help="kernels listed per rank and type (default: 10)")
    p.add_argument("--output", "-o", metavar="FILE", help="write the report here instead of stdout")
    p.add_argument("--workers", type=int, default=0, metavar="N",
                   help="files read and analysed in parallel processes (default 0: one per CPU)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Analyze ``args.paths``; 0 on success, 2 with a message on stderr on bad input."""
    from stream_processors.analysis.offline import analyze_paths, render_markdown

    if args.top < 1:
        print(f"rankscope analyze: error: --top must be >= 1, got {args.top}", file=sys.stderr)
        return 2
    if args.workers < 0:
        print(f"rankscope analyze: error: --workers must be >= 0, got {args.workers}", file=sys.stderr)
        return 2
    try:
        report = analyze_paths(args.paths, hta_compatible=args.hta_compatible, top_k=args.top,
                               workers=args.workers or None)
    except (ValueError, OSError) as e:
        print(f"rankscope analyze: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2) + "\n" if args.format == "json" else render_markdown(report)
    if args.output:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as e:
            print(f"rankscope analyze: error: cannot write {args.output}: {e.strerror or e}", file=sys.stderr)
            return 2
    else:
        sys.stdout.write(text)
    return 0
