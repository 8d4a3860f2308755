"""``rankscope demo``: the local stack plus a 4-rank job with a slow rank and a hang.

``rankscope demo-job`` runs the job itself in the foreground (torchrun, gloo on CPU);
``rankscope demo`` starts it in the background after ``rankscope up`` and prints where to look.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from rankscope.cli.stack import services
from rankscope.cli.stack.ports import free_port
from rankscope.config import Settings


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("demo", parents=[common], help="start the stack and a demo job with a slow rank and a hang")
    _job_flags(p)
    p.add_argument("--timeout", type=float, default=180.0)
    p.set_defaults(func=demo)
    p = sub.add_parser("demo-job", parents=[common], help="run the demo training job in the foreground")
    _job_flags(p)
    p.set_defaults(func=demo_job)


def _job_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", default="", help="job id (default demo-<time>)")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-factor", type=float, default=6.0,
                   help="the slow rank does this many times the others' compute (clear of the noise of a busy host)")
    p.add_argument("--hang-rank", type=int, default=3)
    p.add_argument("--hang-at-step", type=int, default=600)
    p.add_argument("--hang-after-s", type=float, default=0.0,
                   help="instead, the hang rank hangs at its first step this many seconds in (0 = off)")
    p.add_argument("--hang-when-file", default="", metavar="PATH",
                   help="instead, the hang rank hangs at its first step after PATH exists (`touch PATH` when you "
                        "are ready to see a hang)")


def _train_flags(args: argparse.Namespace) -> list[str]:
    """The demo job's flags as ``rankscope.demo.train`` takes them: a hang planted by time or by a file
    replaces the one at --hang-at-step."""
    at_step = -1 if args.hang_when_file or args.hang_after_s > 0 else args.hang_at_step
    return ["--steps", str(args.steps), "--slow-rank", str(args.slow_rank), "--slow-factor", str(args.slow_factor),
            "--hang-rank", str(args.hang_rank), "--hang-at-step", str(at_step),
            "--hang-after-s", str(args.hang_after_s), "--hang-when-file", args.hang_when_file]


def _hang_said(args: argparse.Namespace) -> str:
    if args.hang_when_file:
        return f"once {args.hang_when_file} exists"
    if args.hang_after_s > 0:
        return f"{args.hang_after_s:g} s in"
    return f"at step {args.hang_at_step}"


def demo_job(args: argparse.Namespace, settings: Settings) -> int:
    if args.nproc < 1:
        raise SystemExit(f"--nproc must be >= 1, got {args.nproc}")
    job = args.job or settings.job_id or f"demo-{time.strftime('%H%M%S')}"
    env = {**os.environ, **settings.to_env(), "RANKSCOPE_JOB_ID": job}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "rankscope.demo.train", *_train_flags(args)]
    print(f"demo job {job}: {' '.join(cmd[2:])}", flush=True)
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


def demo(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.cli.commands.local_stack import up

    rc = up(args, settings)
    if rc:
        return rc
    job = args.job or f"demo-{time.strftime('%H%M%S')}"
    services.start(settings, "demo-job", ["demo-job", "--job", job, "--nproc", str(args.nproc), *_train_flags(args)])
    url = f"http://127.0.0.1:{settings.dashboard_port}/job?job={job}"
    print(f"\ndemo job {job}: rank {args.slow_rank} is slow, rank {args.hang_rank} hangs {_hang_said(args)}")
    print(f"job log      {services.log_path(settings, 'demo-job')}")
    print("alerts       rankscope alerts --follow")
    print(f"\nDashboard: {url}\n\nStop everything with `make down` (or `rankscope down`).")
    return 0
