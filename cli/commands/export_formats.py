"""The formats of ``rankscope export`` that go back into other tools (``offline/exporters.py``),
beside its Chrome trace of a stored window:

- ``--traces PATH...`` reads Kineto trace files instead of the store; ``--format kineto`` then
  writes one Kineto JSON per rank (``<out>/rank-<r>.json.gz``, with ``ac2g`` launch -> kernel flows:
  HTA, TensorBoard and ``rankscope analyze`` load them), ``chrome`` one merged Chrome/Perfetto
  trace with the flows, ``folded`` / ``speedscope`` the Python call paths by self time;
- for a stored window (``--job``, ``--window``), ``export.run`` reads its events (through serve's
  endpoint while serve holds the embedded store) and :func:`stored_chrome_json` /
  :func:`write_stored_kineto` put them through the same exporters, with the flows of the
  correlation ids the ranks sent; ``folded`` and ``speedscope`` come from its function summaries.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import sys
from pathlib import Path
from typing import Any

from rankscope.config import Settings

FORMATS = ("chrome", "kineto", "folded", "speedscope")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=FORMATS, default="chrome",
                   help="chrome (default), kineto (per-rank Kineto JSON: -o names the folder), folded or speedscope "
                        "(Python call paths by self time)")
    p.add_argument("--traces", nargs="+", default=[], metavar="PATH",
                   help="read these Kineto trace files or folders instead of the store")


def _err(msg: str, rc: int) -> int:
    print(f"rankscope export: error: {msg}", file=sys.stderr)
    return rc


def _write(out: str, data: bytes) -> int | None:
    if out == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return None
    try:
        Path(out).write_bytes(data)
    except OSError as e:
        return _err(f"cannot write {out}: {e.strerror or e}", 2)
    return None


def _text(fmt: str, functions: Any, name: str) -> bytes:
    from rankscope.offline.exporters import folded_stacks, speedscope

    if fmt == "folded":
        return folded_stacks(functions).encode()
    return json.dumps(speedscope(functions, name=name)).encode()


def run_format(args: argparse.Namespace, settings: Settings) -> int | None:
    """Handle ``--traces`` and a stored window's call paths; None when the request is a stored
    window's events (``chrome`` or ``kineto``: ``export.run`` reads them). Exit codes as ``export.run``'s."""
    if not args.traces:
        if not args.job or not args.window:
            return _err("--job and --window are required (or --traces PATH to export trace files)", 2)
        if args.format in ("chrome", "kineto"):
            if args.format == "kineto" and args.output == "-":
                return _err("--format kineto writes one file per rank: give -o FOLDER", 2)
            return None
        return _stored(args, settings)
    return _from_traces(args)


def _stored_traces(events: Any) -> tuple[dict[int, Any], int]:
    """Per rank, a stored window's events as the reader's table, times from the whole µs at or before
    the window's first event (so rounding to µs treats them as their epoch times); and that base (ns
    since the epoch)."""
    from rankscope.offline.exporters import stored_events_table

    base = int(events["start_ns"].min()) // 1000 * 1000
    return {int(r): stored_events_table(g.reset_index(drop=True), base)
            for r, g in events.groupby("rank", sort=True)}, base


def stored_chrome_json(events: Any, job: str, window_id: str) -> bytes:
    """A stored window's events (``storage/windows.py`` ``trace_events``) as one Chrome/Perfetto
    trace with launch -> GPU work flows (``exporters.merged_chrome_trace``); ``otherData`` names the
    window and its ``origin_ns``, the epoch time of ``ts`` 0."""
    from rankscope.offline.exporters import merged_chrome_trace

    traces, base = _stored_traces(events)
    doc = merged_chrome_trace(traces, job=job, other={"window_id": window_id, "origin_ns": base})
    return json.dumps(doc, separators=(",", ":")).encode()


def write_stored_kineto(events: Any, job: str, window_id: str, output: str, world_size: int | None) -> int:
    """Write a stored window's events as one Kineto JSON per rank (``<output>/rank-<r>.json.gz``,
    default folder ``<window>.kineto``): times in µs from ``baseTimeNanoseconds`` (see
    :func:`_stored_traces`), ``distributedInfo`` with the rank (and ``world_size`` when given). Returns the exit code."""
    from rankscope.offline.exporters import kineto_trace

    out_dir = Path(output or f"{window_id}.kineto")
    traces, base = _stored_traces(events)

    def doc(rank: int, table: Any) -> dict[str, Any]:
        info: dict[str, Any] = {"rank": rank}
        if world_size is not None:
            info["world_size"] = world_size
        meta = {"schemaVersion": 1, "distributedInfo": info, "baseTimeNanoseconds": base,
                "traceName": f"{job} {window_id} rank {rank}"}
        return kineto_trace(table, meta, "us")

    rc = _write_kineto_dir(out_dir, {rank: functools.partial(doc, rank, t) for rank, t in traces.items()})
    if rc is None:
        print(f"window {window_id} of job {job}: {len(events)} events from {len(traces)} ranks written to "
              f"{out_dir}/rank-<r>.json.gz")
    return rc or 0


def _write_kineto_dir(out_dir: Path, docs: dict[int, Any]) -> int | None:
    """Write ``<out_dir>/rank-<r>.json.gz`` for each rank, its document made by ``docs[r]()`` (one at a
    time, so one rank's JSON is in memory at once). None when written, else the exit code."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for rank, make in docs.items():
            (out_dir / f"rank-{rank}.json.gz").write_bytes(
                gzip.compress(json.dumps(make()).encode(), compresslevel=1))
    except OSError as e:
        return _err(f"cannot write {out_dir}: {e.strerror or e}", 2)
    return None


def _stored(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.cli.commands.export import read_store, resolve_window
    from rankscope.storage.windows import window_python_paths

    def read(store: Any) -> tuple[str, Any]:
        window_id = resolve_window(store, args.job, args.window) or args.window
        return window_id, window_python_paths(store, args.job, window_id)

    got = read_store(settings, read)
    if isinstance(got, int):
        return got
    window_id, fn = got
    if fn.empty:
        return _err(f"no stored Python call paths for job {args.job!r} window {args.window!r}", 1)
    out = args.output or f"{window_id}.{'folded' if args.format == 'folded' else 'speedscope.json'}"
    rc = _write(out, _text(args.format, fn, f"{args.job} {window_id}"))
    if rc is None and out != "-":
        print(f"window {window_id} of job {args.job}: {fn['rank'].nunique()} ranks' call paths written to {out}")
    return rc or 0


def _from_traces(args: argparse.Namespace) -> int:
    import pandas as pd

    from rankscope.offline.diagnosis import rank_summary
    from rankscope.offline.exporters import kineto_trace, merged_chrome_trace
    from rankscope.offline.kineto import load_traces
    from rankscope.stream_processors.analysis.summaries import summary_frames

    try:
        traces = load_traces(args.traces, extra_columns=True)
    except (ValueError, OSError) as e:
        return _err(str(e), 2)
    if args.format == "kineto":
        out_dir = Path(args.output or "kineto")
        if args.output == "-":
            return _err("--format kineto writes one file per rank: give -o FOLDER", 2)
        rc = _write_kineto_dir(out_dir, {rank: functools.partial(kineto_trace, t.events, t.metadata, t.time_unit)
                                         for rank, t in traces.items()})
        if rc is None:
            print(f"{len(traces)} Kineto traces written to {out_dir}/rank-<r>.json.gz")
        return rc or 0
    if args.format == "chrome":
        data = json.dumps(merged_chrome_trace({r: t.events for r, t in traces.items()})).encode()
        out = args.output or "merged.trace.json"
    else:
        try:
            fn = pd.concat([summary_frames(r, rank_summary(t))[0] for r, t in traces.items()], ignore_index=True)
        except ValueError as e:
            return _err(str(e), 2)
        data = _text(args.format, fn, "rankscope export")
        out = args.output or ("stacks.folded" if args.format == "folded" else "profile.speedscope.json")
    rc = _write(out, data)
    if rc is None and out != "-":
        print(f"{len(traces)} ranks written to {out}")
    return rc or 0
