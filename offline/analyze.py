"""Offline report over Kineto trace files (``rankscope analyze``): HTA-compatible GPU time
breakdowns next to the window diagnosis the processors build (``offline/diagnosis.py``: slow workers,
causes, collective arrivals, PerfTracker's sections, under the report's ``diagnosis`` key).

:func:`analyze_traces` is pure (loaded traces in, JSON-able dict out); :func:`analyze_paths` adds
the file reading (in parallel processes, with a progress callback); :func:`render_markdown` turns
a report into text. Breakdown times are in µs, diagnosis times in ms.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rankscope import report_view
from rankscope.offline import breakdown as bd
from rankscope.offline.diagnosis import diagnose_summaries, rank_summary
from rankscope.offline.kineto import Trace, concat_events, expand_paths, load_trace

__all__ = ["REPORT_SCHEMA", "analyze_paths", "analyze_traces", "render_markdown"]

REPORT_SCHEMA = "rankscope.analyze/1"
#: ``progress(done, total, path)``: called after each trace file is read and analysed.
Progress = Callable[[int, int, str], None]


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return [_plain(r) for r in df.to_dict("records")]


def _departures(df: pd.DataFrame, hta_compatible: bool) -> dict[str, Any]:
    """What the default convention counts differently from HTA on these traces."""
    if hta_compatible:
        return {}
    gpu = bd.gpu_work(df, False)
    hta_types = bd.classify_kernels(gpu, hta_compatible=True)
    extra = (gpu["kernel_type"] == bd.COMMUNICATION) & (hta_types != bd.COMMUNICATION)
    steps = df.loc[df["step"] >= 0, ["rank", "step"]].drop_duplicates()
    n_steps = steps.groupby("rank")["step"].nunique()
    return {
        "communication_kernels_not_nccl": int(extra.sum()),
        "communication_time_not_nccl_us": float(gpu.loc[extra, "dur_ns"].sum() / 1000),
        "last_step_kept": bool((n_steps > 1).any()),
        "gpu_events_without_host_launch_kept": int(_unlaunched(df, gpu)),
    }


def _unlaunched(df: pd.DataFrame, gpu: pd.DataFrame) -> int:
    host = df.loc[(df["stream"] < 0) & (df["correlation"] >= 0), ["rank", "correlation"]]
    keys = pd.MultiIndex.from_frame(host)
    mine = pd.MultiIndex.from_frame(gpu[["rank", "correlation"]])
    return int((~mine.isin(keys)).sum())


def analyze_traces(traces: Mapping[int, Trace], hta_compatible: bool = False, top_k: int = 10,
                   diagnose: bool = True) -> dict[str, Any]:
    """Report over loaded traces: per-rank temporal breakdown, comm/compute overlap, kernel type
    breakdown (all ranks and per rank), top kernels, idle time breakdown, the convention used and
    the files read; with ``diagnose``, the window diagnosis under ``diagnosis`` (traces loaded with
    ``extra_columns=True`` keep their Python stacks there). Pure; the result is JSON-serialisable
    (NaN becomes None)."""
    if not traces:
        raise ValueError("no traces to analyze")
    report = _breakdowns(traces, hta_compatible, top_k)
    if diagnose:
        report["diagnosis"] = _plain(diagnose_summaries({r: rank_summary(t) for r, t in traces.items()}))
    return report


def _breakdowns(traces: Mapping[int, Trace], hta_compatible: bool, top_k: int) -> dict[str, Any]:
    df = concat_events(traces)
    conv = bd.convention(hta_compatible)
    files = [
        {
            "path": t.path,
            "rank": t.rank,
            "rank_source": t.rank_source,
            "time_unit": t.time_unit,
            "events": len(t.events),
            "steps": t.steps,
            "device": t.device_name,
            "world_size": t.world_size,
            "skipped_events": int(t.stats.get("skipped_events", 0)),
        }
        for t in (traces[r] for r in sorted(traces))
    ]
    with bd.cached_views():
        return _report(df, conv, files, traces, hta_compatible, top_k)


def _report(df: pd.DataFrame, conv: Any, files: list[dict[str, Any]], traces: Mapping[int, Trace],
            hta_compatible: bool, top_k: int) -> dict[str, Any]:
    report: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "convention": conv.as_dict(),
        "files": files,
        "ranks": sorted(int(r) for r in traces),
        "temporal_breakdown": _records(bd.temporal_breakdown(df, hta_compatible)),
        "comm_comp_overlap": _records(bd.comm_comp_overlap(df, hta_compatible)),
        "kernel_type_breakdown": _records(bd.kernel_type_breakdown(df, hta_compatible)),
        "kernel_type_breakdown_by_rank": _records(bd.kernel_type_breakdown(df, hta_compatible, by_rank=True)),
        "top_kernels": _records(bd.kernel_breakdown_top(df, top_k, hta_compatible)),
        "idle_time_breakdown": _records(bd.idle_time_breakdown(df, hta_compatible)),
        "departures_from_hta": _plain(_departures(df, hta_compatible)),
    }
    return report


def analyze_paths(
    paths: str | Path | Iterable[str | Path], hta_compatible: bool = False, top_k: int = 10,
    workers: int | None = None, diagnose: bool = True, progress: Progress | None = None,
) -> dict[str, Any]:
    """Load trace files or folders (see :func:`kineto.expand_paths`) and return
    :func:`analyze_traces`'s report. Blocking; ``progress`` is called after each file. Raises
    ValueError naming the file on bad input.

    Every section of the report is per rank except the all-ranks kernel type breakdown, which
    is a sum over ranks; so with ``workers`` > 1 (default: one per CPU, at most one per file)
    each file is read and analysed in its own worker process and the per-rank reports are
    merged (:func:`merge_reports`), the diagnosis built from the ranks' summaries: the parent
    never holds more than the small per-rank results, and the result equals the one-process report.
    """
    files = expand_paths(paths)
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = max(1, min(workers, len(files)))
    done = 0

    def tick(path: Path) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(files), str(path))

    if workers == 1:
        parts = []
        for f in files:
            parts.append(_analyze_file(f, hta_compatible, top_k, diagnose))
            tick(f)
        return _merged(parts, hta_compatible, diagnose)
    # Not fork: the caller may have threads (Kafka clients, chDB, the dashboard) whose locks a
    # forked child would inherit held. A forkserver starts clean and forks the workers from there.
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(["rankscope.offline.analyze"])
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        parts = []
        for f, part in zip(files, pool.map(_analyze_file, files, repeat(hta_compatible), repeat(top_k),
                                           repeat(diagnose), chunksize=1), strict=True):
            parts.append(part)
            tick(f)
    return _merged(parts, hta_compatible, diagnose)


def _analyze_file(path: Path, hta_compatible: bool, top_k: int, diagnose: bool
                  ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One file's breakdown report and, with ``diagnose``, its rank's summary body."""
    t = load_trace(path, extra_columns=diagnose)
    part = analyze_traces({t.rank: t}, hta_compatible=hta_compatible, top_k=top_k, diagnose=False)
    return part, rank_summary(t) if diagnose else None


def _merged(parts: list[tuple[dict[str, Any], dict[str, Any] | None]], hta_compatible: bool,
            diagnose: bool) -> dict[str, Any]:
    report = merge_reports([p for p, _ in parts], hta_compatible)
    if diagnose:
        bodies = {min(p["ranks"]): b for p, b in parts if b is not None}
        report["diagnosis"] = _plain(diagnose_summaries(bodies))
    return report


def merge_reports(parts: list[dict[str, Any]], hta_compatible: bool) -> dict[str, Any]:
    """One report from single-rank reports of :func:`analyze_traces` (pure).

    Raises ValueError when two parts carry the same rank (naming both files)."""
    if not parts:
        raise ValueError("no traces to analyze")
    seen: dict[int, str] = {}
    for part in parts:
        for f in part["files"]:
            if f["rank"] in seen:
                raise ValueError(f"rank {f['rank']} appears twice: {seen[f['rank']]} and {f['path']} "
                                 f"(rank from {f['rank_source']})")
            seen[f["rank"]] = f["path"]
    parts = sorted(parts, key=lambda p: min(p["ranks"]))

    def cat(key: str) -> list[dict[str, Any]]:
        return [r for p in parts for r in p[key]]

    by_rank = cat("kernel_type_breakdown_by_rank")
    sums_ns: dict[str, int] = {}        # per-rank sums are whole ns / 1000: add them exactly
    for r in by_rank:
        sums_ns[r["kernel_type"]] = sums_ns.get(r["kernel_type"], 0) + round(float(r["sum"] or 0.0) * 1000)
    total = sum(sums_ns.values())
    all_ranks = [{"kernel_type": k, "sum": v / 1000, "percentage": round(100 * v / total, 1) if total else None}
                 for k, v in sorted(sums_ns.items(), key=lambda kv: -kv[1])]
    top = sorted(cat("top_kernels"), key=lambda r: (str(r["kernel_type"]), str(r["name"]), r["rank"]))
    departures: dict[str, Any] = {}
    for p in parts:
        for k, v in (p.get("departures_from_hta") or {}).items():
            if isinstance(v, bool):
                departures[k] = bool(departures.get(k, False)) or v
            else:
                departures[k] = departures.get(k, 0) + v
    return {
        "schema": REPORT_SCHEMA,
        "convention": parts[0]["convention"],
        "files": sorted(cat("files"), key=lambda f: f["rank"]),
        "ranks": sorted(r for p in parts for r in p["ranks"]),
        "temporal_breakdown": cat("temporal_breakdown"),
        "comm_comp_overlap": cat("comm_comp_overlap"),
        "kernel_type_breakdown": all_ranks,
        "kernel_type_breakdown_by_rank": by_rank,
        "top_kernels": top,
        "idle_time_breakdown": cat("idle_time_breakdown"),
        "departures_from_hta": departures,
    }


# --------------------------------------------------------------------------- markdown


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 1e15 else f"{v:.4g}"
    return str(v).replace("|", "\\|")


def _table(rows: list[dict[str, Any]], cols: list[str], headers: list[str] | None = None,
           width: dict[str, int] | None = None) -> str:
    if not rows:
        return "_none_\n"
    width = width or {}
    out = ["| " + " | ".join(headers or cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            s = _fmt(r.get(c))
            w = width.get(c)
            if w and len(s) > w:
                s = s[: w - 1] + "…"
            cells.append(s)
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def render_markdown(report: Mapping[str, Any]) -> str:
    """A human-readable Markdown page for a report from :func:`analyze_traces`: the diagnosis
    first (:func:`rankscope.report_view.render_markdown`), then the GPU time breakdown."""
    conv = report["convention"]
    parts = []
    if isinstance(report.get("diagnosis"), dict):
        parts.append(report_view.render_markdown(report["diagnosis"]).replace("# rankscope diagnosis", "# rankscope analyze: diagnosis", 1))
    parts.append("# rankscope analyze: GPU time breakdown\n")
    parts.append(f"Convention: **{conv['name']}** (hta_compatible={conv['hta_compatible']})\n")
    parts += [f"- {rule}" for rule in conv["rules"]]
    dep = report.get("departures_from_hta") or {}
    if dep:
        parts.append(
            f"\nDepartures from HTA on these traces: last step kept: {dep['last_step_kept']}; "
            f"GPU events without a recorded host launch kept: {dep['gpu_events_without_host_launch_kept']}; "
            f"non-NCCL communication kernels: {dep['communication_kernels_not_nccl']} "
            f"({_fmt(dep['communication_time_not_nccl_us'])} µs). "
            "Run with --hta-compatible to reproduce HTA's numbers."
        )
    parts.append("\n## Files\n")
    files = [dict(f, steps=", ".join(str(s) for s in f["steps"])) for f in report["files"]]
    parts.append(_table(files, ["rank", "path", "rank_source", "device", "events", "steps", "time_unit"]))
    parts.append("\n## Temporal breakdown per rank (µs)\n")
    parts.append(_table(
        report["temporal_breakdown"],
        ["rank", "kernel_time(us)", "idle_time(us)", "compute_time(us)", "non_compute_time(us)",
         "idle_time_pctg", "compute_time_pctg", "non_compute_time_pctg"],
        ["rank", "GPU span", "idle", "compute", "non-compute", "idle %", "compute %", "non-compute %"],
    ))
    parts.append("\n## Communication overlapped by computation\n")
    parts.append(_table(report["comm_comp_overlap"],
                        ["rank", "comm_time(us)", "overlap_time(us)", "comp_comm_overlap_pctg"],
                        ["rank", "communication (µs)", "overlapped (µs)", "overlap %"]))
    parts.append("\n## Kernel type breakdown, all ranks (µs)\n")
    parts.append(_table(report["kernel_type_breakdown"], ["kernel_type", "sum", "percentage"],
                        ["kernel type", "time (µs)", "%"]))
    parts.append("\n## Top kernels per rank (µs)\n")
    top = sorted(report["top_kernels"], key=lambda r: (r["rank"], r["kernel_type"], -(r["sum (us)"] or 0)))
    parts.append(_table(top, ["rank", "kernel_type", "name", "sum (us)", "mean (us)", "max (us)", "min (us)"],
                        ["rank", "type", "kernel", "total", "mean", "max", "min"], width={"name": 90}))
    parts.append("\n## Idle time per stream (µs)\n")
    parts.append(_table(report["idle_time_breakdown"],
                        ["rank", "stream", "idle_category", "idle_time(us)", "idle_time_ratio"],
                        ["rank", "stream", "category", "idle (µs)", "share"]))
    return "\n".join(parts)
