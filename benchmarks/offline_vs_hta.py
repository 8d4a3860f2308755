"""Offline analysis against Holistic Trace Analysis (HTA) 0.5.0 on a synthetic 64-rank trace set.

The set is built from the real traces in tests/data: 48 ranks copy ``hta_nccl_meta_a100`` and 16
copy the two ``hta_sampled2`` ranks, each with ``distributedInfo.rank``/``world_size`` rewritten and
its timestamps shifted a little per rank; gzipped like torch writes them (over 1M timed events).

Each tool runs in a fresh subprocess on the same folder:

(a) rankscope: ``analyze_paths(folder, hta_compatible=True)`` (one process);
(b) HTA: ``TraceAnalysis(trace_dir=folder)`` (parses with a process pool of cpu_count workers),
    then ``get_temporal_breakdown()``, ``get_comm_comp_overlap()``, ``get_gpu_kernel_breakdown()``.

Measured per subprocess: wall time (start to exit, imports included), CPU time of the process tree
(``os.wait4`` rusage: the process plus its waited-for children, or the sum of the last CPU times
polled for every process of the tree if larger: a forkserver's workers are not waited for by the
measured process) and peak memory: the highest sum
of RSS over the process tree, polled every 10 ms. (Not ``ru_maxrss``: Linux carries the forking
process's high-water mark across fork and exec, so a child of a large benchmark process reports
the parent's peak.)
HTA needs pandas < 3, so it runs from its own virtual environment, created on first use at
``~/.cache/rankscope/hta-venv``. The results of the two are compared (temporal breakdown and
overlap per rank, percentage points). HTA disagrees with itself on this set: the copies of an
``hta_sampled2`` rank, identical but for a shift of a multiple of 17 µs, get temporal breakdowns
that differ by multiples of 128 µs (up to 0.05 points apart), and none of them need equal HTA's
breakdown of that rank parsed on its own. So ``temporal_max_diff_pct_points`` compares each rank
with HTA's reference for its source trace (``tests/data/<set>/hta_reference``, HTA on the source
set alone), ``temporal_max_diff_vs_hta_run_pct_points`` with HTA's numbers from this run, and
``hta_self_spread_pct_points`` is the largest spread of HTA's own numbers over the copies of one
source rank: the scale of that noise. If HTA cannot run, the result says why in ``error`` and its
metrics are None.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
HTA_VENV = Path.home() / ".cache" / "rankscope" / "hta-venv"
HTA_REQUIREMENTS = ("holistictraceanalysis==0.5.0", "pandas<3")
RANKS = 64
TIMEOUT_S = 3600

RANKSCOPE_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
from rankscope.offline.analyze import analyze_paths
rep = analyze_paths(sys.argv[1], hta_compatible=True, diagnose=False)  # HTA's tables only, as HTA computes
out = {"compute_s": time.perf_counter() - t0,
       "events": sum(f["events"] for f in rep["files"]), "ranks": len(rep["ranks"]),
       "temporal": rep["temporal_breakdown"], "overlap": rep["comm_comp_overlap"],
       "kernel_types": rep["kernel_type_breakdown"]}
print("RESULT " + json.dumps(out))
"""

HTA_SCRIPT = r"""
import json, logging, sys, time
t0 = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1])
t_parse = time.perf_counter() - t0
tb = a.get_temporal_breakdown(visualize=False)
ov = a.get_comm_comp_overlap(visualize=False)
kt, kb = a.get_gpu_kernel_breakdown(visualize=False)
out = {"compute_s": time.perf_counter() - t0, "parse_s": t_parse, "ranks": len(a.t.traces),
       "events": int(sum(len(df) for df in a.t.traces.values())),
       "temporal": json.loads(tb.to_json(orient="records")), "overlap": json.loads(ov.to_json(orient="records")),
       "kernel_types": json.loads(kt.to_json(orient="records"))}
print("RESULT " + json.dumps(out))
"""


# --------------------------------------------------------------------------- trace set

def _load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def _shifted(doc: dict[str, Any], rank: int, world: int, shift_us: float) -> dict[str, Any]:
    out = {k: copy.deepcopy(v) for k, v in doc.items() if k != "traceEvents"}
    info = dict(out.get("distributedInfo") or {})
    info.update(rank=rank, world_size=world)
    out["distributedInfo"] = info
    events = []
    for e in doc["traceEvents"]:
        ts = e.get("ts")
        if isinstance(ts, int | float) and not isinstance(ts, bool):
            e = dict(e)
            e["ts"] = round(ts + shift_us, 3) if isinstance(ts, float) else ts + int(shift_us)
        events.append(e)
    out["traceEvents"] = events
    return out


def source_of(rank: int) -> tuple[str, int]:
    """(test data set, rank in it) that synthetic ``rank`` copies (see :func:`build_trace_set`)."""
    return ("hta_sampled2", (rank // 4) % 2) if rank % 4 == 3 else ("hta_nccl_meta_a100", 0)


def build_trace_set(folder: Path, ranks: int = RANKS) -> dict[str, int]:
    """Write ``ranks`` gzipped traces to ``folder``; returns counts (raw trace events, files)."""
    folder.mkdir(parents=True, exist_ok=True)
    nccl = _load(DATA / "hta_nccl_meta_a100" / "nccl_data.json.gz")
    sampled = [_load(DATA / "hta_sampled2" / f"sampled_rank-{r}.json.gz") for r in (0, 1)]
    raw = 0
    for r in range(ranks):
        name, src_rank = source_of(r)
        src = sampled[src_rank] if name == "hta_sampled2" else nccl
        doc = _shifted(src, r, ranks, shift_us=float(r * 17))
        raw += len(doc["traceEvents"])
        # Default separators as torch writes them: HTA finds the rank with the regex `"rank":\s+(\d+)`.
        data = json.dumps(doc).encode()
        (folder / f"rank-{r}.json.gz").write_bytes(gzip.compress(data, compresslevel=1))
    return {"raw_trace_events": raw, "files": ranks}


# --------------------------------------------------------------------------- HTA venv

def hta_python() -> Path:
    """Python of the HTA venv, created (python3 -m venv + pip install) on first use.
    Raises RuntimeError with the failing step's output."""
    py = HTA_VENV / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import hta.trace_analysis, psutil"],
                                      capture_output=True, timeout=300).returncode == 0:
        return py
    HTA_VENV.parent.mkdir(parents=True, exist_ok=True)
    base = shutil.which("python3") or sys.executable
    for cmd in ([base, "-m", "venv", str(HTA_VENV)],
                [str(py), "-m", "pip", "install", "-q", *HTA_REQUIREMENTS, "psutil"]):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {(p.stderr or p.stdout)[-800:]}")
    return py


# --------------------------------------------------------------------------- measuring

def _tree_rss(proc: psutil.Process, cpu_seen: dict[int, float] | None = None) -> int:
    """Sum of RSS over the process tree; also records each process's CPU time in ``cpu_seen``
    (processes that are not waited for by the measured one, such as a forkserver's workers,
    are missing from its rusage)."""
    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
            if cpu_seen is not None:
                t = p.cpu_times()
                cpu_seen[p.pid] = max(cpu_seen.get(p.pid, 0.0), t.user + t.system)
        except psutil.Error:
            pass
    return total


def measure(cmd: list[str], cwd: Path, env: dict[str, str] | None = None,
            timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Run ``cmd`` and return wall_s, cpu_s, peak_mb, rc, the parsed ``RESULT`` line and the output tail."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ps = psutil.Process(proc.pid)
    peak = 0
    cpu_seen: dict[int, float] = {}
    out_parts: dict[str, str] = {}

    def read(name: str, stream: Any) -> None:
        out_parts[name] = stream.read()

    readers = [threading.Thread(target=read, args=(n, s), daemon=True)
               for n, s in (("out", proc.stdout), ("err", proc.stderr))]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout_s
    status = None
    while True:
        pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            status, rusage = st, ru
            break
        peak = max(peak, _tree_rss(ps, cpu_seen))
        if time.monotonic() > deadline:
            for c in ps.children(recursive=True):
                c.kill()
            proc.kill()
            _, status, rusage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    for t in readers:
        t.join(10)
    stdout, stderr = out_parts.get("out", ""), out_parts.get("err", "")
    result = None
    for line in stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            break
    # CPU: the process and its waited-for children (rusage), or the last CPU time seen of every
    # process of the tree while polling, whichever is larger.
    cpu = max(rusage.ru_utime + rusage.ru_stime, sum(cpu_seen.values()))
    return {"wall_s": wall, "cpu_s": cpu, "peak_mb": peak / 2**20,
            "rc": proc.returncode, "result": result, "tail": (stderr or stdout)[-1500:]}


def _max_diff(a: list[dict[str, Any]], b: list[dict[str, Any]], cols: list[str]) -> float | None:
    ia, ib = {int(r["rank"]): r for r in a}, {int(r["rank"]): r for r in b}
    if set(ia) != set(ib):
        return None
    diffs = [abs(float(ia[k][c]) - float(ib[k][c])) for k in ia for c in cols
             if ia[k].get(c) is not None and ib[k].get(c) is not None]
    return round(max(diffs), 4) if diffs else None


TEMPORAL_PCT = ["idle_time_pctg", "compute_time_pctg", "non_compute_time_pctg"]


def hta_reference(table: str, ranks: int = RANKS) -> list[dict[str, Any]]:
    """HTA's stored ``table`` (percentages) for every synthetic rank, from its source trace's reference."""
    import csv

    rows: dict[str, dict[int, dict[str, Any]]] = {}
    out = []
    for r in range(ranks):
        name, src_rank = source_of(r)
        if name not in rows:
            with open(DATA / name / "hta_reference" / f"{table}.csv", newline="") as f:
                rows[name] = {int(row["rank"]): row for row in csv.DictReader(f)}
        out.append({**rows[name][src_rank], "rank": r})
    return out


def _self_spread(rows: list[dict[str, Any]], cols: list[str]) -> float | None:
    """Largest spread (max - min) of one column over the ranks that copy the same source rank."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(source_of(int(row["rank"])), []).append(row)
    spreads = [max(float(x[c]) for x in g) - min(float(x[c]) for x in g)
               for g in groups.values() for c in cols if all(x.get(c) is not None for x in g)]
    return round(max(spreads), 4) if spreads else None


# --------------------------------------------------------------------------- run

def run() -> dict[str, Any]:
    targets = {"speedup": ">= 3", "rankscope_peak_mb": "<= hta_peak_mb"}
    tmp = Path(tempfile.mkdtemp(prefix="rankscope-hta-bench-"))
    metrics: dict[str, Any] = {}
    out: dict[str, Any] = {"name": "offline_vs_hta", "metrics": metrics, "targets": targets}
    try:
        folder = tmp / "traces"
        t0 = time.perf_counter()
        counts = build_trace_set(folder)
        out["trace_set"] = {**counts, "ranks": RANKS, "build_s": round(time.perf_counter() - t0, 1),
                            "bytes_gz": sum(p.stat().st_size for p in folder.iterdir()),
                            "sources": "48 x hta_nccl_meta_a100, 16 x hta_sampled2"}
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        rs = measure([sys.executable, "-c", RANKSCOPE_SCRIPT, str(folder)], REPO, env)
        if rs["result"] is None:
            raise RuntimeError(f"rankscope analyze failed (rc {rs['rc']}): {rs['tail']}")
        r = rs["result"]
        metrics.update(rankscope_s=round(rs["wall_s"], 2), hta_s=None, speedup=None,
                       rankscope_peak_mb=round(rs["peak_mb"], 1), hta_peak_mb=None, events=int(r["events"]),
                       rankscope_cpu_s=round(rs["cpu_s"], 2), hta_cpu_s=None,
                       rankscope_compute_s=round(r["compute_s"], 2))
        try:
            py = hta_python()
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            out["error"] = f"HTA venv unavailable: {e}"
            return out
        hta_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        hs = measure([str(py), "-c", HTA_SCRIPT, str(folder)], tmp, hta_env)
        if hs["result"] is None:
            out["error"] = f"HTA failed on the synthetic set (rc {hs['rc']}, {hs['wall_s']:.0f}s): {hs['tail']}"
            metrics.update(hta_peak_mb=round(hs["peak_mb"], 1))
            return out
        h = hs["result"]
        metrics.update(hta_s=round(hs["wall_s"], 2), speedup=round(hs["wall_s"] / rs["wall_s"], 2),
                       hta_peak_mb=round(hs["peak_mb"], 1), hta_cpu_s=round(hs["cpu_s"], 2),
                       cpu_speedup=round(hs["cpu_s"] / max(rs["cpu_s"], 1e-9), 2),
                       hta_compute_s=round(h["compute_s"], 2), hta_events=int(h["events"]),
                       memory_ratio=round(rs["peak_mb"] / max(hs["peak_mb"], 1e-9), 3),
                       temporal_max_diff_pct_points=_max_diff(
                           r["temporal"], hta_reference("temporal_breakdown"), TEMPORAL_PCT),
                       temporal_max_diff_vs_hta_run_pct_points=_max_diff(r["temporal"], h["temporal"], TEMPORAL_PCT),
                       hta_self_spread_pct_points=_self_spread(h["temporal"], TEMPORAL_PCT),
                       overlap_max_diff_pct_points=_max_diff(r["overlap"], h["overlap"], ["comp_comm_overlap_pctg"]))
        targets.update(memory_ratio="<= 1", temporal_max_diff_pct_points="<= 0.01",
                       temporal_max_diff_vs_hta_run_pct_points="<= hta_self_spread_pct_points",
                       overlap_max_diff_pct_points="<= 0.01")
        out["hta_parse_workers"] = min(os.cpu_count() or 1, RANKS)
        return out
    except Exception as e:  # a benchmark reports, it does not crash the table
        out["error"] = f"{type(e).__name__}: {e}"
        for k in ("rankscope_s", "hta_s", "speedup", "rankscope_peak_mb", "hta_peak_mb", "events"):
            metrics.setdefault(k, None)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
