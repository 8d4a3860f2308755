"""What a GPU time breakdown counts: the two conventions (HTA 0.5's and rankscope's), the events
each keeps (:func:`hta_view`, :func:`gpu_work`) and the kernel classes (:func:`classify_kernels`).
Pure functions over the events table of ``kineto.py``; ``breakdown.py`` computes on their output.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from rankscope.offline.kineto import GPU_WORK_CATEGORIES

__all__ = [
    "COMMUNICATION",
    "COMPUTATION",
    "HTA_CONVENTION",
    "KERNEL_TYPES",
    "MEMORY",
    "OTHER",
    "RANKSCOPE_CONVENTION",
    "Convention",
    "cached_views",
    "classify_kernels",
    "convention",
    "gpu_work",
    "hta_view",
]

COMPUTATION = "COMPUTATION"
COMMUNICATION = "COMMUNICATION"
MEMORY = "MEMORY"
OTHER = "OTHER"
KERNEL_TYPES = (COMPUTATION, COMMUNICATION, MEMORY, OTHER)
ANALYZED_TYPES = (COMPUTATION, COMMUNICATION, MEMORY)  # HTA's order; also the overlap label order

_HTA_COMM_RE = re.compile(r"nccl.*Kernel")
_HTA_MEMORY_RE = re.compile(r"Memcpy|Memset|dma")
_HTA_NOT_COMPUTE_RE = re.compile(r".*Memcpy|Memset|.*Sync")
_COMM_RE = re.compile(
    r"nccl|rccl|msccl|hccl|oneccl|nvshmem|cross_device_reduce|custom_?all_?reduce|"
    r"all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|sendrecv|send_recv",
    re.IGNORECASE,
)
_MEMORY_NAME_RE = re.compile(r"(hip)?(Memcpy|Memset)|dma", re.IGNORECASE)
_PROFILER_STEP_RE = re.compile(r"^ProfilerStep#\d+")
NS_PER_US = 1000  # ns per µs


@dataclass(frozen=True)
class Convention:
    """How a breakdown was computed; travels with every result so readers can compare."""

    name: str
    hta_compatible: bool
    rules: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "hta_compatible": self.hta_compatible, "rules": list(self.rules)}


HTA_CONVENTION = Convention(
    name="hta",
    hta_compatible=True,
    rules=(
        "HTA 0.5 defaults (include_last_profiler_step=False)",
        "with more than one ProfilerStep, the last one is dropped: host events are kept if they start "
        "before the last ProfilerStep event (host or GPU-side copy) starts",
        "GPU work is kept only if its correlation id matches a kept host event, so GPU work without a "
        "recorded host launch is dropped",
        "timestamps are rounded inward to whole µs (start up, end down); sub-µs work can get zero or "
        "negative length",
        "GPU work is every event with a stream",
        "kernel classes by name: communication ^nccl.*Kernel; memory ^(Memcpy|Memset|dma); computation "
        "the rest except names matching .*Memcpy, ^Memset or .*Sync",
    ),
)
RANKSCOPE_CONVENTION = Convention(
    name="rankscope",
    hta_compatible=False,
    rules=(
        "all ProfilerSteps kept, including the last",
        "all GPU work kept, whether or not its host launch was recorded",
        "nanosecond precision, no rounding",
        "GPU work is kernel, memcpy and memset events",
        "communication: NCCL, RCCL, MSCCL, HCCL, oneCCL and NVSHMEM kernels, generic collective names "
        "(all_reduce, all_gather, reduce_scatter, all_to_all, sendrecv) or kernels carrying collective "
        "metadata; memory: memcpy/memset events; computation: every other kernel",
    ),
)


def convention(hta_compatible: bool) -> Convention:
    """The :class:`Convention` a breakdown uses for the given switch."""
    return HTA_CONVENTION if hta_compatible else RANKSCOPE_CONVENTION


# --------------------------------------------------------------------------- preparation


def _require(df: pd.DataFrame, cols: tuple[str, ...]) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"events frame lacks column(s) {missing}; expected the table of kineto.load_trace")


_VIEWS: dict[tuple[str, int, bool], tuple[pd.DataFrame, pd.DataFrame]] | None = None


@contextmanager
def cached_views() -> Iterator[None]:
    """Within the block, ``hta_view`` and ``gpu_work`` compute once per (frame, convention).

    For callers that run several breakdowns over the same unchanged frame (the offline report);
    each call still returns its own shallow copy, so a caller adding columns changes nothing else.
    """
    global _VIEWS
    outer, _VIEWS = _VIEWS, {}
    try:
        yield
    finally:
        _VIEWS = outer


def _cached(kind: str, df: pd.DataFrame, hta: bool, make: Callable[[], pd.DataFrame]) -> pd.DataFrame:
    if _VIEWS is None:
        return make()
    key = (kind, id(df), hta)
    hit = _VIEWS.get(key)
    if hit is None or hit[0] is not df:
        hit = (df, make())
        _VIEWS[key] = hit
    return hit[1].copy(deep=False)


def hta_view(df: pd.DataFrame) -> pd.DataFrame:
    """The events as HTA 0.5 sees them (see ``_hta_view``); a new frame, ``df`` is untouched."""
    return _cached("hta_view", df, True, lambda: _hta_view(df))


def _hta_view(df: pd.DataFrame) -> pd.DataFrame:
    """The events as HTA 0.5 sees them after ``load_traces()`` (a new frame; ``df`` is untouched).

    Steps:
      1. keep complete (``ph == "X"``) events;
      2. round each event inward to whole µs: start up, end down (ns columns stay, in µs multiples);
      3. if the ranks together show more than one ProfilerStep name, per rank: host side = events
         that are not (stream >= 0 and correlation >= 0); keep host events starting before the
         latest host-side ``ProfilerStep#N`` start; keep GPU events whose correlation matches a
         kept host event, once per match (as HTA's inner merge does).
    """
    _require(df, ("rank", "name", "ph", "ts_ns", "dur_ns", "stream", "correlation"))
    ev = df[df["ph"].astype(str) == "X"].reset_index(drop=True)
    ts = ev["ts_ns"].to_numpy()
    end = ts + ev["dur_ns"].to_numpy()
    ts_r = -((-ts) // NS_PER_US) * NS_PER_US
    end_r = (end // NS_PER_US) * NS_PER_US
    ev = ev.assign(ts_ns=ts_r, dur_ns=end_r - ts_r)

    names = ev["name"].astype("category")
    is_step_name = np.array([bool(_PROFILER_STEP_RE.match(str(c))) for c in names.cat.categories] + [False])
    step_mask = is_step_name[names.cat.codes.to_numpy()]
    n_step_names = names[step_mask].nunique()
    if n_step_names <= 1:
        return ev.reset_index(drop=True)

    parts = []
    for _, g in ev.groupby("rank", sort=True, observed=True):
        parts.append(_hta_filter_rank(g, step_mask[g.index.to_numpy()]))
    return pd.concat(parts, ignore_index=True)


def _hta_filter_rank(g: pd.DataFrame, is_step: np.ndarray) -> pd.DataFrame:
    stream = g["stream"].to_numpy()
    corr = g["correlation"].to_numpy()
    ts = g["ts_ns"].to_numpy()
    gpu_side = (stream >= 0) & (corr >= 0)
    cpu_side = ~gpu_side
    if not cpu_side.any():
        return g
    steps = cpu_side & is_step
    last_start = ts[steps].max() if steps.any() else ts[cpu_side].min()
    keep_cpu = cpu_side & (ts < last_start)
    kept_corr = pd.Series(corr[keep_cpu]).value_counts()
    gpu_idx = np.flatnonzero(gpu_side)
    mult = kept_corr.reindex(corr[gpu_idx]).fillna(0).to_numpy(dtype=np.int64)
    rows = np.concatenate([np.repeat(gpu_idx, mult), np.flatnonzero(keep_cpu)])
    return g.iloc[np.sort(rows, kind="stable")]


def _types_for_names(categories: pd.Index, hta: bool) -> np.ndarray:
    out = []
    for c in categories:
        name = str(c)
        if hta:
            if _HTA_COMM_RE.match(name):
                out.append(COMMUNICATION)
            elif _HTA_MEMORY_RE.match(name):
                out.append(MEMORY)
            elif _HTA_NOT_COMPUTE_RE.match(name):
                out.append(OTHER)
            else:
                out.append(COMPUTATION)
        elif _COMM_RE.search(name):
            out.append(COMMUNICATION)
        elif _MEMORY_NAME_RE.match(name):
            out.append(MEMORY)
        else:
            out.append(COMPUTATION)
    return np.array(out + [OTHER], dtype=object)


def classify_kernels(gpu: pd.DataFrame, hta_compatible: bool = False) -> pd.Series:
    """Kernel type (COMPUTATION, COMMUNICATION, MEMORY, OTHER) of each GPU event.

    HTA mode uses names only (HTA's rules); default mode also uses the event category (memcpy and
    memset are MEMORY) and collective metadata (a kernel with a collective name is COMMUNICATION).
    """
    names = gpu["name"].astype("category")
    types = _types_for_names(names.cat.categories, hta_compatible)[names.cat.codes.to_numpy()]
    if not hta_compatible:
        if "cat" in gpu.columns:
            cat = gpu["cat"].astype(str).to_numpy()
            types = np.where(np.isin(cat, ("memcpy", "memset")), MEMORY, types)
        if "args" in gpu.columns:
            has_coll = np.fromiter(
                (isinstance(a, dict) and "collective" in a for a in gpu["args"]), dtype=bool, count=len(gpu)
            )
            types = np.where(has_coll & (types == COMPUTATION), COMMUNICATION, types)
    return pd.Series(pd.Categorical(types, categories=KERNEL_TYPES), index=gpu.index, name="kernel_type")


def gpu_work(df: pd.DataFrame, hta_compatible: bool = False) -> pd.DataFrame:
    """GPU events under the chosen convention, with ``end_ns`` and ``kernel_type`` columns.

    Returns columns rank, name, stream, ts_ns, dur_ns, end_ns, correlation, kernel_type (new frame).
    """
    return _cached("gpu_work", df, hta_compatible, lambda: _gpu_work(df, hta_compatible))


def _gpu_work(df: pd.DataFrame, hta_compatible: bool) -> pd.DataFrame:
    _require(df, ("rank", "name", "cat", "ts_ns", "dur_ns", "stream", "correlation"))
    if hta_compatible:
        ev = hta_view(df)
        sel = ev["stream"].to_numpy() != -1
    else:
        ev = df
        sel = ev["cat"].isin(GPU_WORK_CATEGORIES).to_numpy()
    cols = [c for c in ("rank", "name", "cat", "stream", "ts_ns", "dur_ns", "correlation", "args") if c in ev]
    gpu = ev.loc[sel, cols].reset_index(drop=True)
    gpu["end_ns"] = gpu["ts_ns"] + gpu["dur_ns"]
    gpu["kernel_type"] = classify_kernels(gpu, hta_compatible)
    return gpu.drop(columns=[c for c in ("cat", "args") if c in gpu.columns])
