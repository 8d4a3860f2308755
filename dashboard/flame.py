"""Flame graph (icicle) data from Python events of a trace window. Pure; no I/O, no plotting.

Python events come in two shapes, and both are handled (even mixed in one thread):

- call-path names ``"main;train_step;forward"`` (outermost first): the path is the name;
- plain names ``"forward"``: the path is the caller's path plus the name, the caller being the
  innermost event of the same rank and thread that is still running when this one starts.

Each event is one call with its inclusive duration. Time nesting (per rank and thread) gives each
call its self time (its duration minus the time of the calls inside it); a node's total is the self
time of its subtree, so callers that were not recorded (a lone ``a;b;c`` event) still add up.

rankscope's own frames (its wrappers around torch.distributed calls, the tracer's step hooks; see
:mod:`rankscope.own_frames`) are folded into the user's call that made them by
:func:`rankscope.own_frames.user_path`: they leave the paths, and their self time counts as the caller's.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pandas as pd

from rankscope.own_frames import is_own_frame, user_path

SEP = ";"
ROOT = "all"
PATH_COLUMNS = ["path", "dur_ns", "self_ns", "folded"]
TREE_COLUMNS = ["path", "name", "depth", "total_ns", "self_ns", "calls"]
ICICLE_COLUMNS = ["path", "name", "depth", "x0", "x1", "total_ms", "self_ms", "share", "calls", "label"]


def call_paths(events: pd.DataFrame) -> pd.DataFrame:
    """One row per event: its call path (tuple of names, outermost first, rankscope's frames left
    out), duration, self time, and ``folded``: the event is one of rankscope's own frames, whose
    self time is thus its caller's.

    Needs columns name, start_ns, dur_ns; uses rank and ``attrs["tid"]`` (else stream) to separate
    threads. Steps, per (rank, thread): 1. sort by start, longer first on ties; 2. pop the open calls
    that ended at or before this start; 3. the innermost open call is the caller: it loses the
    overlap from its self time, and gives a plain name its path; 4. push this call.
    """
    if events.empty:
        return pd.DataFrame(columns=PATH_COLUMNS)
    ev = pd.DataFrame({"rank": events["rank"] if "rank" in events.columns else 0, "tid": _thread_ids(events),
                       "name": events["name"].astype(str), "start": events["start_ns"].astype("int64"),
                       "dur": events["dur_ns"].astype("int64").clip(lower=0)})
    ev = ev.sort_values(["rank", "tid", "start", "dur"], ascending=[True, True, True, False])
    paths: list[tuple[str, ...]] = []
    durs: list[int] = []
    inner: list[int] = []            # time of calls inside each call
    stack: list[tuple[int, int]] = []  # (end, row) of open calls
    key: tuple[int, int] | None = None
    for r, t, name, start, dur in zip(ev["rank"], ev["tid"], ev["name"], ev["start"], ev["dur"], strict=True):
        if (r, t) != key:
            key, stack = (r, t), []
        start, dur = int(start), int(dur)
        while stack and stack[-1][0] <= start:
            stack.pop()
        caller = stack[-1][1] if stack else -1
        if SEP in name:
            path = tuple(p for p in name.split(SEP) if p)
        else:
            path = (paths[caller] if caller >= 0 else ()) + (name,)
        if caller >= 0:
            inner[caller] += min(start + dur, stack[-1][0]) - start
        paths.append(path)
        durs.append(dur)
        inner.append(0)
        stack.append((start + dur, len(paths) - 1))
    out = pd.DataFrame({"path": paths, "dur_ns": durs, "self_ns": [max(0, d - i) for d, i in zip(durs, inner,
                                                                                                  strict=True)]})
    out["folded"] = [bool(p) and is_own_frame(p[-1]) for p in out["path"]]
    out["path"] = [user_path(p) for p in out["path"]]
    return out[out["path"].map(len) > 0].reset_index(drop=True)


def _thread_ids(events: pd.DataFrame) -> list[int]:
    attrs = events["attrs"] if "attrs" in events.columns else [None] * len(events)
    stream = events["stream"] if "stream" in events.columns else [-1] * len(events)
    out = []
    for a, s in zip(attrs, stream, strict=True):
        tid = a.get("tid") if isinstance(a, dict) else None
        try:
            out.append(int(tid) if tid is not None else int(s))
        except (TypeError, ValueError):
            out.append(int(s))
    return out


def call_tree(events: pd.DataFrame) -> pd.DataFrame:
    """Aggregate events into call-tree nodes: :data:`TREE_COLUMNS`, parents before children.

    ``path`` is a tuple; a synthetic root ``("all",)`` at depth 0 holds every top-level frame.
    ``self_ns`` sums the self time of the node's calls; ``total_ns`` is the node's subtree.
    """
    paths = call_paths(events)
    own: dict[tuple[str, ...], int] = defaultdict(int)
    calls: dict[tuple[str, ...], int] = defaultdict(int)
    for p, s, folded in zip(paths["path"], paths["self_ns"], paths["folded"], strict=True):
        full = (ROOT, *p)
        own[full] += int(s)
        calls[full] += 0 if folded else 1
    return _tree(own, calls)


def sampled_tree(paths: pd.Series, self_ns: pd.Series) -> pd.DataFrame:
    """A :func:`call_tree` of sampled call paths (``"root;...;leaf"`` strings with the self time each
    was seen innermost); ``calls`` counts nothing (samples are not calls)."""
    own: dict[tuple[str, ...], int] = defaultdict(int)
    for p, s in zip(paths, self_ns, strict=True):
        if p:
            own[(ROOT, *str(p).split(SEP))] += int(s)
    return _tree(own, {})


def _tree(own: dict[tuple[str, ...], int], calls: dict[tuple[str, ...], int]) -> pd.DataFrame:
    nodes: set[tuple[str, ...]] = {(ROOT,)}
    for p in own:
        nodes.update(p[:i] for i in range(1, len(p) + 1))
    total: dict[tuple[str, ...], int] = defaultdict(int)
    for n in sorted(nodes, key=len, reverse=True):   # children before parents
        total[n] += own.get(n, 0)
        if len(n) > 1:
            total[n[:-1]] += total[n]
    rows = [{"path": n, "name": n[-1], "depth": len(n) - 1, "total_ns": total[n], "self_ns": own.get(n, 0),
             "calls": calls.get(n, 0)} for n in sorted(nodes, key=lambda x: (len(x), x))]
    return pd.DataFrame(rows, columns=TREE_COLUMNS)


def icicle(tree: pd.DataFrame, min_share: float = 0.002, max_nodes: int = 1500,
           chars_per_unit: float = 140.0) -> pd.DataFrame:
    """Lay out a :func:`call_tree` as an icicle: :data:`ICICLE_COLUMNS`.

    Each node spans [x0, x1) in milliseconds inside its parent's span, callees ordered by time spent
    (largest first), depth 0 = the root row. Nodes under ``min_share`` of the root are dropped with
    their callees; the threshold grows until at most ``max_nodes`` remain. ``label`` is the name cut
    to what fits a node of its width when the whole chart is about ``chars_per_unit`` characters wide.
    """
    if not 0 <= min_share < 1:
        raise ValueError(f"min_share must be in [0, 1), got {min_share!r}")
    if tree.empty or int(tree["total_ns"].max()) <= 0:
        return pd.DataFrame(columns=ICICLE_COLUMNS)
    info: dict[tuple[str, ...], dict[str, Any]] = {
        p: {"total": int(t), "self": int(s), "calls": int(c)}
        for p, t, s, c in zip(tree["path"], tree["total_ns"], tree["self_ns"], tree["calls"], strict=True)}
    kids: dict[tuple[str, ...], list[tuple[str, ...]]] = defaultdict(list)
    for p in info:
        if len(p) > 1:
            kids[p[:-1]].append(p)
    root = (ROOT,)
    whole = info[root]["total"]
    share = float(min_share)
    while True:
        keep = [p for p in info if info[p]["total"] >= share * whole]
        if len(keep) <= max_nodes or share >= 0.5:
            break
        share = max(share * 2, 0.001)
    cut = share * whole
    rows: list[dict[str, Any]] = []

    def place(p: tuple[str, ...], x0: int) -> None:
        t = info[p]["total"]
        rows.append({"path": p, "x0": x0, "x1": x0 + t})
        x = x0
        for c in sorted(kids[p], key=lambda k: (-info[k]["total"], k[-1])):
            if info[c]["total"] >= cut and info[c]["total"] > 0:
                place(c, x)
                x += info[c]["total"]

    place(root, 0)
    df = pd.DataFrame(rows)
    df["name"] = df["path"].map(lambda p: p[-1])
    df["depth"] = df["path"].map(lambda p: len(p) - 1)
    df["total_ms"] = df["path"].map(lambda p: info[p]["total"] / 1e6).round(3)
    df["self_ms"] = df["path"].map(lambda p: info[p]["self"] / 1e6).round(3)
    df["calls"] = df["path"].map(lambda p: info[p]["calls"])
    df["share"] = df["path"].map(lambda p: info[p]["total"] / whole).round(4)
    df["x0"], df["x1"] = df["x0"] / 1e6, df["x1"] / 1e6
    width = (df["x1"] - df["x0"]) / (whole / 1e6) * chars_per_unit
    df["label"] = [n if len(n) <= w else (n[: int(w) - 1] + "…" if w >= 4 else "")
                   for n, w in zip(df["name"], width, strict=True)]
    return df[ICICLE_COLUMNS]
