"""``rankscope export --job J --window W [-o trace.json]``: a stored trace window as a Chrome /
Perfetto trace, or with ``--format kineto`` as one Kineto JSON per rank.

Reads the window's ``trace_events`` from the store (``storage/windows.py``) and writes them through
the trace files' exporters (``export_formats.py``), with launch -> kernel flows. While ``rankscope
serve`` (or ``up``) holds the embedded store, the reads go through serve's loopback query endpoint
(``storage/query_endpoint.py``); a ClickHouse server DSN is read directly. ``--window`` is a window
id or a request id (prefix): the newest matching window is taken. Exit status: 0 written; 1 store
unavailable or no such window; 2 bad arguments or unwritable output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rankscope.cli import store_reader
from rankscope.cli.commands import export_formats
from rankscope.config import Settings


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("export", parents=[common], help="write a stored trace window as a Chrome/Perfetto trace",
                       description="Export the events of one stored trace window to a Chrome trace JSON file "
                                   "that opens in https://ui.perfetto.dev or chrome://tracing.")
    p.add_argument("--job", default="", help="job of the stored window")
    p.add_argument("--window", default="", help="window id, or a request id prefix (newest match)")
    p.add_argument("--ranks", default="", help="only these ranks, e.g. 0-3,8 (default: all)")
    p.add_argument("--limit", type=int, default=0, help="at most this many events (default: the dashboard's cap)")
    p.add_argument("--output", "-o", default="", metavar="FILE",
                   help="output file (default: <window>.trace.json; '-' for stdout)")
    export_formats.add_arguments(p)     # --format kineto|folded|speedscope, --traces PATH
    p.add_argument("--fr-dump", action="store_true",
                   help="write the ranks' stored PyTorch Flight Recorder dumps of one request (--window: its "
                        "request id or a prefix; default the newest) into the folder --output, as "
                        "`python -m torch.distributed.flight_recorder.fr_trace FOLDER --prefix rank_` reads them")
    p.add_argument("--profile", action="store_true",
                   help="write the job's sampled Python stacks (all ranks, or --ranks; --from/--to in seconds since "
                        "the epoch) into the folder --output as profile.folded, profile.speedscope.json and "
                        "profile.pb.gz (pprof)")
    p.add_argument("--from", dest="t_from", type=float, default=0.0, help="with --profile: from this time (s)")
    p.add_argument("--to", dest="t_to", type=float, default=0.0, help="with --profile: until this time (s)")
    p.add_argument("--role", default="", help="with --profile: only threads of this role (training, dataloader, "
                                              "pin_memory, other)")
    p.set_defaults(func=run)


LOCKED_HINT = ("hint: the embedded store allows one process at a time, and the one holding it answers no queries "
               "(`rankscope serve` and `up` do; `rankscope sink` alone does not): stop `rankscope serve` or the "
               "sink and retry, or download the window from the dashboard's Trace windows page (Export button), "
               "or point --clickhouse-dsn at a ClickHouse server.")


def _err(msg: str, rc: int) -> int:
    print(f"rankscope export: error: {msg}", file=sys.stderr)
    return rc


def resolve_window(store: object, job: str, window: str) -> str | None:
    """``window`` itself if the job has a window with that id, else the newest whose id starts with it."""
    from rankscope.storage.windows import trace_windows

    wins = trace_windows(store, job, limit=10_000)  # newest first
    ids = [str(w) for w in wins["window_id"]] if not wins.empty else []
    if window in ids:
        return window
    return next((w for w in ids if w.startswith(window)), None)


FR_PREFIX = "rank_"


def write_fr_dumps(dumps: dict[int, dict], out: Path) -> list[Path]:
    """One pickle file per rank, ``<out>/rank_<r>``: the form the recorder's own ``_dump_fr_trace``
    writes and fr_trace's loader reads, with every group in ``pg_config``
    (:func:`~rankscope.storage.fr_dumps.with_group_configs`). Raises OSError."""
    import pickle

    from rankscope.storage.fr_dumps import with_group_configs

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank, dump in sorted(with_group_configs(dumps).items()):
        path = out / f"{FR_PREFIX}{rank}"
        path.write_bytes(pickle.dumps(dump))
        paths.append(path)
    return paths


def read_store(settings: Settings, read: Any) -> Any:
    """``read(store)`` (:func:`rankscope.cli.store_reader.read_store`), or the exit status."""
    return store_reader.read_store(settings, read, "export", LOCKED_HINT)


def export_fr_dumps(args: argparse.Namespace, settings: Settings) -> int:
    """``--fr-dump``: the stored dumps of one request through :func:`write_fr_dumps`."""
    from rankscope.storage.fr_dumps import rank_dumps, resolve_request
    if not args.job:
        return _err("--fr-dump needs --job", 2)
    got = read_store(settings, lambda store: (lambda r: (r, rank_dumps(store, args.job, r) if r else {}))(
        resolve_request(store, args.job, args.window)))
    if isinstance(got, int):
        return got
    request, dumps = got
    if not dumps:
        return _err(f"no stored Flight Recorder dumps for job {args.job!r}"
                    + (f" request {args.window!r}" if args.window else "")
                    + " (a hang alert or `rankscope flight --job J` asks the ranks for them)", 1)
    out = Path(args.output or f"fr-{args.job}")
    try:
        write_fr_dumps(dumps, out)
    except OSError as e:
        return _err(f"cannot write {out}: {e.strerror or e}", 2)
    print(f"request {request} of job {args.job}: {len(dumps)} ranks' dumps written to {out}/rank_<r>; read them with "
          f"python -m torch.distributed.flight_recorder.fr_trace {out} --prefix rank_")
    return 0


def export_profile(args: argparse.Namespace, settings: Settings) -> int:
    """``--profile``: the job's sampled stacks as folded stacks, speedscope and pprof."""
    import json

    from rankscope import profiles
    from rankscope.offline.exporters import folded_stacks, speedscope
    from rankscope.protocol.profile import ROLES
    from rankscope.storage.profiles import profile_rows
    from rankscope.trace_request import parse_ranks

    if not args.job:
        return _err("--profile needs --job", 2)
    if args.role and args.role not in ROLES:
        return _err(f"--role must be one of {', '.join(ROLES)}, got {args.role!r}", 2)
    if args.t_from < 0 or args.t_to < 0 or (args.t_to and args.t_to <= args.t_from):
        return _err("--from and --to are seconds since the epoch, --to after --from", 2)
    try:
        ranks = parse_ranks(args.ranks)
    except ValueError as e:
        return _err(str(e), 2)
    t0, t1 = int(args.t_from * 1e9), int(args.t_to * 1e9)
    got = read_store(settings, lambda store: profile_rows(store, args.job, ranks, t0, t1,
                                                          [args.role] if args.role else None))
    if isinstance(got, int):
        return got
    per_path = profiles.seconds(got)
    per_path = per_path.groupby(["rank", "path"], as_index=False)["seconds"].sum() if not per_path.empty else per_path
    if per_path.empty:
        return _err(f"no stored profile samples for job {args.job!r}"
                    + (f" ranks {ranks}" if ranks is not None else "") + " in that range", 1)
    out = Path(args.output or f"profile-{args.job}")
    fns = profiles.as_functions(per_path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile.folded").write_text(folded_stacks(fns))
        (out / "profile.speedscope.json").write_text(json.dumps(speedscope(fns, f"rankscope {args.job}")))
        (out / "profile.pb.gz").write_bytes(profiles.pprof(per_path, t0, max(0, t1 - t0)))
    except OSError as e:
        return _err(f"cannot write {out}: {e.strerror or e}", 2)
    print(f"job {args.job}: {float(per_path['seconds'].sum()):.1f} sampled seconds of {per_path['rank'].nunique()} "
          f"ranks written to {out}/profile.folded, profile.speedscope.json and profile.pb.gz")
    return 0


def run(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.trace_request import parse_ranks

    if args.fr_dump:
        return export_fr_dumps(args, settings)
    if args.profile:
        return export_profile(args, settings)
    rc = export_formats.run_format(args, settings)
    if rc is not None:
        return rc

    try:
        ranks = parse_ranks(args.ranks)
    except ValueError as e:
        return _err(str(e), 2)
    if args.limit < 0:
        return _err(f"--limit must be >= 0, got {args.limit}", 2)

    from rankscope.storage.windows import MAX_EVENTS, trace_events

    limit = args.limit or MAX_EVENTS

    def read(store: Any) -> tuple[str, Any]:
        window_id = resolve_window(store, args.job, args.window) or args.window
        return window_id, trace_events(store, args.job, window_id, ranks=ranks, limit=limit)

    got = read_store(settings, read)
    if isinstance(got, int):
        return got
    window_id, events = got
    if events.empty:
        return _err(f"no stored trace events for job {args.job!r} window {args.window!r}"
                    + (f" ranks {ranks}" if ranks is not None else "")
                    + " (list windows on the dashboard's Trace windows page)", 1)
    if args.format == "kineto":
        return export_formats.write_stored_kineto(events, args.job, window_id, args.output,
                                                  int(events["rank"].nunique()) if ranks is None else None)
    data = export_formats.stored_chrome_json(events, job=args.job, window_id=window_id)
    out = args.output or f"{window_id}.trace.json"
    if out == "-":
        sys.stdout.buffer.write(data + b"\n")
        sys.stdout.flush()
    else:
        try:
            Path(out).write_bytes(data)
        except OSError as e:
            return _err(f"cannot write {out}: {e.strerror or e}", 2)
    n_ranks = events["rank"].nunique()
    msg = f"window {window_id} of job {args.job}: {len(events)} events from {n_ranks} ranks"
    if len(events) >= limit:
        msg += f" (capped at {limit}; raise --limit)"
    print(msg + (f" written to {out}" if out != "-" else ""), file=sys.stderr if out == "-" else sys.stdout)
    return 0
