"""``rankscope analyze``: the offline diagnosis of Kineto trace files (no broker, no store): the
processors' window diagnosis (slow workers, causes, collective arrivals, PerfTracker's sections)
next to HTA-compatible GPU time breakdowns. Progress goes to stderr."""

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
        help="diagnose torch.profiler (Kineto) trace files: slow workers, causes, GPU time breakdown",
        description=(
            "Read Kineto trace files (.json or .json.gz; folders are expanded to the traces they hold, one "
            "file per rank) and report what the processors report for a live trace window (slow workers, "
            "causes with their cost in rank-seconds, the straggler at collectives, PerfTracker's sections), "
            "then per-rank idle/compute/communication time, compute-communication overlap, kernel type "
            "breakdown, top kernels and idle time per stream."
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
    p.add_argument("--no-diagnosis", action="store_true",
                   help="only the GPU time breakdowns (skips summarising every event)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Analyze ``args.paths``; 0 on success, 2 with a message on stderr on bad input."""
    from rankscope.offline.analyze import analyze_paths, render_markdown

    if args.top < 1:
        print(f"rankscope analyze: error: --top must be >= 1, got {args.top}", file=sys.stderr)
        return 2
    if args.workers < 0:
        print(f"rankscope analyze: error: --workers must be >= 0, got {args.workers}", file=sys.stderr)
        return 2
    def progress(done: int, total: int, path: str) -> None:
        print(f"rankscope analyze: {done}/{total} files analysed ({path})", file=sys.stderr, flush=True)

    try:
        report = analyze_paths(args.paths, hta_compatible=args.hta_compatible, top_k=args.top,
                               workers=args.workers or None, diagnose=not args.no_diagnosis,
                               progress=None if args.quiet else progress)
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
