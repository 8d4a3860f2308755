"""A diagnosis report as people read it: the verdict, chart data, PerfTracker's sections with units
and explanations, and Markdown. Pure (report dicts in, plain data or text out); the dashboard's
Reports page, ``rankscope report --format md`` and ``rankscope analyze`` all render through it.

Accepted reports: a window's diagnosis (``stream_processors/analysis/report.py``: ``slow_workers``,
``causes``, ``collective_arrivals`` ...) or an offline ``rankscope analyze`` report, whose
diagnosis is under its ``diagnosis`` key (:func:`diagnosis_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Section", "Verdict", "chart_data", "diagnosis_of", "render_markdown", "sections", "verdict"]

TOP_CAUSES = 3
NOT_WORK = ("annotation",)   # markers around work, not work: left out of the bottleneck chart
MAX_CELL = 100


@dataclass(frozen=True)
class Verdict:
    """The first thing to read: ``headline`` plus one line per finding (slow workers, causes, straggler)."""

    headline: str
    lines: list[str]
    slow_ranks: list[int]
    straggler: int | None
    cost_rank_seconds: float


@dataclass(frozen=True)
class Section:
    """One PerfTracker section: facts (label, value with unit) and a table whose headers carry units."""

    key: str
    title: str
    explanation: str
    facts: list[tuple[str, str]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)


def diagnosis_of(report: dict[str, Any]) -> dict[str, Any] | None:
    """The window diagnosis inside ``report`` (itself, or its ``diagnosis`` key), None if it has none."""
    if isinstance(report.get("diagnosis"), dict):
        return report["diagnosis"]
    return report if "slow_workers" in report else None


def short(name: Any, n: int = 80) -> str:
    """``name`` cut to ``n`` characters (C++ kernel names run to thousands)."""
    s = str(name)
    return s if len(s) <= n else s[: n - 1] + "…"


def _pct(x: Any) -> str:
    return "–" if x is None else f"{100 * float(x):.1f}%"


def _ms(x: Any) -> str:
    return "–" if x is None else f"{float(x):,.3f} ms"


def verdict(report: dict[str, Any]) -> Verdict:
    """Who is slow and by how much, the top causes with their cost in rank-seconds, the straggler."""
    d = diagnosis_of(report) or {}
    slow = d.get("slow_workers") or []
    lines = []
    for s in slow:
        base = float(s["median_busy_ms"]) or 1.0
        lines.append(f"Rank {s['rank']} is slow: busy {s['busy_ms']:,.1f} ms in the window vs {s['median_busy_ms']:,.1f} ms "
                     f"on the other ranks (+{100 * (float(s['busy_ms']) / base - 1):.0f}%, z {s['z']}).")
        if s.get("held_back_by_host"):
            lines.append(f"Rank {s['rank']} is held back by its host: its training thread waited for a CPU "
                         f"{100 * float(s['cpu_wait_share']):.0f}% of the time it was ready to run (the other ranks' "
                         f"median {100 * float(s['peers_cpu_wait_share']):.0f}%): look for other work on its cores.")
    for s in d.get("slow_only_by_cpu_wait") or []:
        lines.append(f"Rank {s['rank']} was busy {s['busy_ms']:,.1f} ms vs {s['median_busy_ms']:,.1f} ms, but its training "
                     f"thread waited {s['extra_cpu_wait_ms']:,.1f} ms longer for a CPU than the other ranks' share of ready "
                     "time gives: its cores were shared, its work is not slower.")
    causes = (d.get("causes") or [])[:TOP_CAUSES]
    for i, c in enumerate(causes, 1):
        lines.append(f"Cause {i}: {c['category']} `{short(c['leaf'])}` on rank {c['rank']}: +{c['excess_ms']:,.1f} ms, "
                     f"costing {c['cost_rank_seconds']:.3f} rank-seconds (every rank waits for it).")
    arr = d.get("collective_arrivals") or {}
    straggler = arr.get("straggler")
    if straggler is not None:
        lines.append(f"Straggler at collectives: rank {straggler} arrives last at {100 * float(arr['straggler_share']):.0f}% "
                     f"of {arr['matched_calls']} matched calls, {arr['mean_lateness_ms']:,.3f} ms behind the median "
                     f"arrival; arriving with the others would save {arr['what_if_saving_rank_seconds']:.3f} rank-seconds.")
    cost = round(sum(float(c["cost_rank_seconds"]) for c in d.get("causes") or []
                     if c["rank"] in {s["rank"] for s in slow}), 6)
    if slow:
        who = ", ".join(str(s["rank"]) for s in slow)
        headline = f"Slow worker{'s' if len(slow) > 1 else ''}: rank {who}"
        if causes:
            headline += f"; top cause `{short(causes[0]['leaf'], 60)}` ({causes[0]['cost_rank_seconds']:.3f} rank-seconds)"
    elif d:
        headline = "No slow worker in this window"
        lines.insert(0, "Every rank's busy time is within the normal spread of the others.")
    else:
        headline = "No diagnosis in this report"
    if straggler is not None:
        headline += f"; straggler at collectives: rank {straggler}"
    if d.get("missing_ranks"):
        lines.append(f"Missing ranks (no summary before the deadline): {d['missing_ranks']}.")
    return Verdict(headline, lines, [int(s["rank"]) for s in slow], None if straggler is None else int(straggler), cost)


def chart_data(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Rows for the three charts: ``busy`` (rank, busy ms), ``lateness`` (rank, mean ms behind the
    median arrival at collectives) and ``bottleneck`` (category, median bottleneck ratio %)."""
    d = diagnosis_of(report) or {}
    slow = {int(s["rank"]) for s in d.get("slow_workers") or []}
    busy = [{"rank": int(r), "busy (ms)": float(v), "slow": int(r) in slow} for r, v in (d.get("busy_ms") or {}).items()]
    arr = d.get("collective_arrivals") or {}
    late = [{"rank": int(r), "lateness (ms)": float(v), "straggler": int(r) == arr.get("straggler")}
            for r, v in (arr.get("mean_lateness_ms_by_rank") or {}).items()]
    bott = [{"category": c, "bottleneck ratio (%)": round(100 * float(v), 2)}
            for c, v in (d.get("bottleneck_ratio_by_category") or {}).items() if c not in NOT_WORK]
    return {"busy": sorted(busy, key=lambda x: x["rank"]), "lateness": sorted(late, key=lambda x: x["rank"]),
            "bottleneck": bott}


def _abnormal_rows(items: list[dict[str, Any]], value: str = "time (ms)") -> list[dict[str, Any]]:
    return [{"rank": a["rank"], value: a["value_ms"], "others' median (ms)": a["median_ms"], "z": a["z"]} for a in items]


def sections(report: dict[str, Any]) -> list[Section]:
    """PerfTracker's sections of the diagnosis, in PerfTracker's order, each explained."""
    d = diagnosis_of(report) or {}
    out = [Section("slow_workers", "Slow workers",
                   "Busy time = kernels, memory ops, runtime calls and CPU ops not overlapped by other work, each "
                   "function's calls at their median cost; slow = robust z against the other ranks above the threshold, "
                   "also without the rank's wait for a CPU beyond the others' (or its host starves it of CPU).",
                   rows=[{"rank": s["rank"], "busy (ms)": s["busy_ms"], "others' median (ms)": s["median_busy_ms"],
                          "z": s["z"], **({"extra wait for a CPU (ms)": s["extra_cpu_wait_ms"],
                                           "held back by its host": s["held_back_by_host"]}
                                          if "held_back_by_host" in s else {})}
                         for s in d.get("slow_workers") or []]),
           Section("causes", "Causes, by cost",
                   "A slow rank's functions by their excess time over the other ranks' median; cost = excess x world "
                   "size, since every rank waits for it.",
                   rows=[{"rank": c["rank"], "category": c["category"], "function": c["leaf"], "call path": c["function"],
                          "excess (ms)": c["excess_ms"], "cost (rank-s)": c["cost_rank_seconds"]}
                         for c in d.get("causes") or []])]
    g = d.get("gpu_compute")
    if g:
        u = g["utilisation"]
        out.append(Section("gpu_compute", "GPU compute",
                           "Utilisation = kernel time / window. Major kernels by median total time; bottleneck ratio = "
                           "time the kernel runs with nothing else useful overlapping it / window.",
                           facts=[("utilisation min / median / max", f"{_pct(u['min'])} / {_pct(u['median'])} / {_pct(u['max'])}"),
                                  ("ranks with abnormal utilisation", ", ".join(str(a["rank"]) for a in g["abnormal_utilisation"]) or "none"),
                                  ("ranks with potential GPU problems", ", ".join(sorted({str(p["rank"]) for p in g["workers_with_potential_gpu_problems"]})) or "none")],
                           rows=[{"kernel": k["name"], "median cost per call (µs)": k["median_cost_per_call_us"],
                                  "bottleneck ratio (%)": round(100 * k["bottleneck_ratio"], 2)} for k in g["major_kernels"]]))
    m = d.get("gpu_memory_operations")
    if m:
        out.append(Section("gpu_memory_operations", "GPU memory operations",
                           "memcpy and memset time not overlapped by other work; abnormal ranks need at least 1% of the window.",
                           facts=[("average bottleneck ratio", _pct(m["average_bottleneck_ratio"]))],
                           rows=_abnormal_rows(m["abnormal_workers"])))
    c = d.get("communication")
    if c:
        no_bytes = all(b["mean_throughput_Bps"] is None for b in c["by_collective"])
        out.append(Section("communication", "Communication, by collective",
                           "The normal worker is the rank whose time is closest to the median. In synchronous training the "
                           "slow worker waits least: long collective time marks the ranks that wait for it.",
                           rows=[{"collective": b["collective"], "normal worker": b["normal_worker"],
                                  "bottleneck ratio (%)": round(100 * b["bottleneck_ratio"], 2),
                                  "median time (ms)": b["median_time_ms"],
                                  "mean throughput (GB/s)": None if b["mean_throughput_Bps"] is None else round(b["mean_throughput_Bps"] / 1e9, 3),
                                  "throughput std (GB/s)": None if b["throughput_std_Bps"] is None else round(b["throughput_std_Bps"] / 1e9, 3),
                                  "abnormal ranks": ", ".join(str(a["rank"]) for a in b["abnormal_workers"]) or "none"}
                                 for b in c["by_collective"]]))
        if no_bytes:   # no message sizes in this window: no throughput to show
            for row in out[-1].rows:
                del row["mean throughput (GB/s)"], row["throughput std (GB/s)"]
    r = d.get("cuda_runtime")
    if r:
        out.append(Section("cuda_runtime", "CUDA runtime",
                           "Runtime calls (launches, synchronisation) on the host; share = their total time / window.",
                           facts=[("bottleneck ratio (median rank)", _pct(r["bottleneck_ratio"])),
                                  ("share of the window (median rank)", _pct(r["share_of_window"]))],
                           rows=_abnormal_rows(r["abnormal_workers"])))
    p = d.get("python_functions")
    if p:
        out.append(Section("python_functions", "Python functions",
                           "Call paths whose time not overlapped by other work exceeds 1% of the window, per rank.",
                           rows=[{"rank": int(rank), "call path": x["path"], "bottleneck ratio (%)": round(100 * x["bottleneck_ratio"], 2)}
                                 for rank, xs in sorted(p["per_worker"].items(), key=lambda kv: int(kv[0])) for x in xs]))
    a = d.get("collective_arrivals")
    if a and a.get("matched_calls"):
        out.append(Section("collective_arrivals", "Collective arrivals",
                           "The k-th call of each collective matched across ranks; the last to arrive makes the others wait. "
                           "What-if saving = sum over calls of (last - second-to-last arrival) x world size.",
                           facts=[("straggler", f"rank {a['straggler']} ({100 * a['straggler_share']:.0f}% of calls)"),
                                  ("matched calls", str(a["matched_calls"])),
                                  ("straggler's mean lateness", _ms(a["mean_lateness_ms"])),
                                  ("what-if saving", f"{a['what_if_saving_rank_seconds']:.3f} rank-seconds")],
                           rows=[{"rank": int(k), "last arrivals": v,
                                  "mean lateness (ms)": (a.get("mean_lateness_ms_by_rank") or {}).get(k)}
                                 for k, v in sorted(a["last_arrival_counts"].items(), key=lambda kv: int(kv[0]))]))
    return out


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.3f}".rstrip("0").rstrip(".") if abs(v) < 1e12 else f"{v:.4g}"
    s = str(v)
    return (s if len(s) <= MAX_CELL else s[:MAX_CELL - 1] + "…").replace("|", "\\|")


def table_md(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of ``rows`` (their keys are the headers), ``_none_`` when empty."""
    if not rows:
        return "_none_\n"
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(out) + "\n"


def render_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown, in the Reports page's order: verdict, chart data as tables, sections."""
    d = diagnosis_of(report) or {}
    v = verdict(report)
    head = f"# rankscope diagnosis: job {d.get('job') or report.get('job', '')} window {d.get('window_id', '')}".rstrip()
    lines = [head, "", f"ranks {d.get('ranks', report.get('ranks'))} (world size {d.get('world_size', '?')})", "",
             "## Verdict", "", f"**{v.headline}**", ""] + [f"- {x}" for x in v.lines]
    charts = chart_data(report)
    for key, title in (("busy", "Busy time per rank"), ("lateness", "Collective lateness per rank"),
                       ("bottleneck", "Bottleneck ratio per category")):
        if charts[key]:
            lines += ["", f"## {title}", "", table_md(charts[key]).rstrip()]
    for s in sections(report):
        lines += ["", f"## {s.title}", "", f"_{s.explanation}_", ""]
        lines += [f"- {label}: {value}" for label, value in s.facts]
        if s.rows or not s.facts:
            lines += (["" ] if s.facts else []) + [table_md(s.rows).rstrip()]
    if d.get("not_applicable"):
        lines += ["", "## Not applicable", ""] + [f"- {x}" for x in d["not_applicable"]]
    return "\n".join(lines) + "\n"
