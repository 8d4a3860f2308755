"""``rankscope run [--step-marker M:F] -- COMMAND ...``: run a launcher with every rank instrumented.

The command (``torchrun ... train.py``, or any launcher whose ranks have ``RANK`` set) is executed in
place of this process, with ``RANKSCOPE_ATTACH=1``, ``producers/attach/boot`` first on
``PYTHONPATH`` and these settings in ``RANKSCOPE_*`` variables; the script needs no change
(see producers/attach). ``--print-env`` prints the variables instead, for launchers started another way.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from rankscope.cli.logs import SECRET_NAME
from rankscope.config import ConfigError, Settings


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "run", parents=[common], help="run an unmodified training job with every rank instrumented",
        description="Run COMMAND (e.g. torchrun --nproc-per-node 8 train.py) so that every rank (a Python "
                    "process with RANK set) makes a rankscope tracer at start-up: steps come from the "
                    "optimizer (or --step-marker), DDP models are found by themselves, exceptions are "
                    "recorded. The launcher itself is not instrumented.",
        usage="rankscope run [options] -- COMMAND [ARG ...]")
    p.add_argument("--step-marker", dest="step_marker", default=None, metavar="MODULE:FUNCTION",
                   help="calls of this function end a step (RANKSCOPE_STEP_MARKER; default: optimizer steps)")
    p.add_argument("--job-id", dest="job_id", default=None, help="job id (RANKSCOPE_JOB_ID; default: torchrun's run id)")
    p.add_argument("--print-env", action="store_true",
                   help="print the variables as shell exports and exit (for launchers other than torchrun)")
    p.add_argument("command_line", nargs=argparse.REMAINDER, metavar="COMMAND", help="the launcher and its arguments")
    p.set_defaults(func=cmd_run)


def run_env(settings: Settings, base: dict[str, str]) -> dict[str, str]:
    """``base`` plus the settings and the attach variables."""
    from rankscope.producers.attach import attach_env

    env = dict(base)
    env.update(settings.to_env())
    env.update(attach_env(base))
    env.pop("RANKSCOPE_ATTACHED_PID", None)
    return env


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    try:
        settings = settings.with_overrides(step_marker=args.step_marker, job_id=args.job_id)
    except ConfigError as e:
        print(f"rankscope run: {e}", file=sys.stderr)
        return 2
    env = run_env(settings, dict(os.environ))
    if args.print_env:
        defaults = Settings().to_env()
        changed = {k for k, v in settings.to_env().items() if defaults.get(k) != v}
        for key in sorted(changed | {"PYTHONPATH", "RANKSCOPE_ATTACH"}):
            if SECRET_NAME.search(key):   # never printed: the launcher passes on the caller's value
                print(f'export {key}="${{{key}}}"')
            else:
                print(f"export {key}={shlex.quote(env[key])}")
        return 0
    command = list(args.command_line)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("rankscope run: no command given (rankscope run -- torchrun ... train.py)", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        print(f"rankscope run: cannot run {command[0]!r}: {e.strerror or e}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process
