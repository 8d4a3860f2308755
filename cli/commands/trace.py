"""``rankscope trace --job J [--ranks 0-7] --steps N [--every 10m | --every-steps K | --continuous] [--stop]``

Sends a control message to the job's ranks and prints each rank's acknowledgement (accepted,
queued, rejected with the reason, then done with the window's event counts when ``--wait-done``).
Exit status: 0 all addressed ranks accepted; 1 some rejected; 2 bad arguments, unknown job or
ranks, or no answer in time.
"""

from __future__ import annotations

import argparse
import sys
import time

from rankscope.config import Settings
from rankscope.control_io import latest_stats
from rankscope.trace_client import WindowRequest
from rankscope.trace_request import TraceRequest, parse_duration, parse_ranks, stalled_note


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("trace", parents=[common], help="open trace windows on a running job's ranks")
    p.add_argument("--job", required=True)
    p.add_argument("--ranks", default="", help="e.g. 0-3,8 (default: every rank)")
    p.add_argument("--steps", type=int, default=3, help="steps per window (1-10000)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--every", default="", help="periodic: a window every DURATION (e.g. 30s, 10m)")
    mode.add_argument("--every-steps", type=int, default=0, help="periodic: a window every K steps")
    mode.add_argument("--continuous", action="store_true", help="back-to-back windows until --stop")
    mode.add_argument("--stop", action="store_true", help="stop running windows and schedules")
    p.add_argument("--shapes", action="store_true", help="record tensor shapes (more overhead)")
    p.add_argument("--no-stack", action="store_true", help="without Python stacks (less overhead)")
    p.add_argument("--byte-budget", type=int, default=0, help="raw-event bytes per window per rank (0 = rank default)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds to wait for acknowledgements")
    p.add_argument("--wait-done", action="store_true", help="also wait until every rank has sent its window")
    p.add_argument("--auto-analyze", action="store_true",
                   help="wait for the window's diagnosis report (implies --wait-done) and print or save it")
    p.add_argument("--output-dir", default="", help="with --auto-analyze: write the report here (JSON and Markdown)")
    p.set_defaults(func=run)


def request_from_args(args: argparse.Namespace) -> TraceRequest:
    """The request the flags describe. Raises ValueError naming the bad flag value."""
    if args.every_steps and args.every_steps < args.steps:
        raise ValueError(f"--every-steps {args.every_steps} must be >= --steps {args.steps}")
    mode = ("every_s" if args.every else "every_steps" if args.every_steps else
            "continuous" if args.continuous else "once")
    return TraceRequest(job=args.job, ranks=parse_ranks(args.ranks), steps=args.steps, mode=mode,
                        every_s=parse_duration(args.every) if args.every else 0.0, every_steps=args.every_steps,
                        with_stack=not args.no_stack, with_shapes=args.shapes, byte_budget=args.byte_budget,
                        stop=args.stop)


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.auto_analyze:
        args.wait_done = True
    asked_ns = time.time_ns()
    rc, request_id = send_and_wait(args, settings)
    if rc != 0 or not args.auto_analyze or args.stop:
        return rc
    from rankscope.cli.commands.report import write_report
    from rankscope.report_view import render_markdown
    from rankscope.trace_client import wait_for_report

    rep = wait_for_report(settings, args.job, request_id, max(args.timeout, settings.report_deadline_s + 30),
                          since_ns=asked_ns)
    if rep is None:
        print(f"no report for window {request_id} (are the processors running?)", file=sys.stderr)
        return 1
    if args.output_dir:
        for p in write_report(rep, args.output_dir):
            print(f"report written: {p}")
    else:
        print(render_markdown(rep))
    return 0


def send_and_wait(args: argparse.Namespace, settings: Settings) -> tuple[int, str]:
    try:
        req = request_from_args(args)
    except ValueError as e:
        print(f"rankscope trace: {e}", file=sys.stderr)
        return 2, ""
    ranks = req.ranks
    stats = latest_stats(settings)
    jobs = {j: sorted(r["rank"] for r in rows) for j, rows in stats.items()}
    if args.job not in jobs:
        known = ", ".join(sorted(jobs)) or "none"
        print(f"rankscope trace: unknown job {args.job!r} (jobs with recent stats: {known})", file=sys.stderr)
        return 2, ""
    job_ranks = jobs[args.job]
    if ranks is not None:
        missing = sorted(set(ranks) - set(job_ranks))
        if missing:
            print(f"rankscope trace: job {args.job} has no rank {missing}; its ranks are {job_ranks}", file=sys.stderr)
            return 2, ""
    targets = ranks if ranks is not None else job_ranks
    request_id = req.request_id
    status: dict[int, str] = {}
    done: set[int] = set()
    stalled: str | None = None
    try:
        with WindowRequest(settings, req, "cli") as w:
            p = w.send(stats[args.job])
            print(f"request {request_id} sent to job {args.job} ranks {targets}", flush=True)
            rows, now_ns = stats[args.job], time.time_ns()
            stalled = None if args.stop else stalled_note(
                args.job, {r["rank"]: str(r.get("state", "")) for r in rows}, targets, min_idle_s=settings.hang_min_s,
                idle_s={r["rank"]: (now_ns - r["step_end_ns"]) / 1e9 for r in rows
                        if isinstance(r.get("step_end_ns"), int) and r["step_end_ns"] > 0})
            if stalled:
                print(f"note: {stalled}", file=sys.stderr, flush=True)
            if p.period_steps:
                print(f"--every {args.every} = every {p.period_steps} steps at the job's current step time "
                      "(so that every rank traces the same steps)", flush=True)
            for ack in w.acks(time.monotonic() + args.timeout):
                print(f"rank {ack.rank}: {ack.status} {ack.detail}", flush=True)
                if ack.status == "done":
                    done.add(ack.rank)
                else:
                    status[ack.rank] = ack.status
                answered = set(status) >= set(targets)
                if answered and (not args.wait_done or args.stop or set(done) >= set(targets)
                                 or any(v == "rejected" for v in status.values())):
                    break
    except RuntimeError as e:
        print(f"rankscope trace: {e}", file=sys.stderr)
        return 2, ""
    silent = sorted(set(targets) - set(status))
    if silent:
        print(f"no answer from ranks {silent} within {args.timeout:g}s (not running, or not reachable)", file=sys.stderr)
        return 2, request_id
    if args.wait_done and not args.stop and set(done) < set(targets):
        print(f"ranks {sorted(set(targets) - done)} did not finish their window within {args.timeout:g}s"
              + (" (the job was not stepping when asked; see the note above)" if stalled else ""), file=sys.stderr)
        return 1, request_id
    return (1 if any(v == "rejected" for v in status.values()) else 0), request_id
