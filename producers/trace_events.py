"""One finished torch.profiler window -> compact columnar records, an on-rank summary, byte-budgeted chunks.

Pipeline (all on the rank, after the profiler stopped)::

    extract_events(prof)                  # KinetoEvent objects -> plain dicts (the only torch-facing code)
    col = to_columnar(events, window_id, first_step)
    functions = summarize(col)            # per (category, name): count, total, median, p95, max, exclusive
    bodies, truncated, sent = chunk(col, byte_budget)   # "trace" message bodies
    summary = summary_body(col, functions, events_sent=sent, truncated=truncated)  # "summary" body

Event dicts (``extract_events`` output; also what an offline Kineto-JSON reader should produce)::

    {"type": kineto activity type ("cpu_op", "python_function", "user_annotation", "kernel",
              "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "gpu_user_annotation", ...),
     "name": str, "start_ns": int (host wall clock, ns since the epoch), "dur_ns": int,
     # optional, defaults in brackets:
     "device": GPU index, -1 for host-side events [-1], "stream": GPU stream [-1],
     "tid": system thread id of host-side events [-1], "corr": correlation id [0],
     "linked": for GPU events the correlation id of the CPU op that launched them [0],
     "py_id"/"py_parent": python_function id and its parent's id [-1], "bytes": [0],
     "meta": dict of Kineto metadata (collective fields, grid/block, bytes) [None],
     "shapes"/"dtypes": input shapes and dtypes of collective ops, when recorded [None]}

Clock: Kineto reports ``start_ns`` on the Unix epoch (torch converts its TSC clock with
``ApproximateClockToUnixTimeConverter``; measured with torch 2.15 on CPU: every event lies between
``time.time_ns()`` taken before ``start()`` and after ``stop()``), so the offset is 0.
:func:`detect_clock_offset_ns` checks that on every window and returns ``wall - monotonic`` if a
build ever reports monotonic time.

Categories (``trace_events.category``), codes = index in :data:`CATEGORIES`:
kernel, memcpy, memset, runtime (cuda/hip/xpu runtime and driver calls), cpu_op, collective
(``c10d::*`` and ``record_param_comms`` CPU ops, ``gloo:*``/``nccl:*`` annotations, ``nccl*`` GPU
kernels), python (python_function), annotation (user and GPU annotations, ``ProfilerStep#N``, other
Kineto types such as overhead or instant events).

GPU metadata (stream, memcpy bytes, grid/block, NCCL collective fields) is only exposed to Python
when the profiler runs with ``experimental_config=experimental_config()`` (``expose_kineto_event_metadata``);
without it GPU streams still come from ``device_resource_id`` but bytes and collective sizes are 0.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import numpy as np

CATEGORIES: tuple[str, ...] = ("kernel", "memcpy", "memset", "runtime", "cpu_op", "collective", "python",
                               "annotation")
CAT = {c: i for i, c in enumerate(CATEGORIES)}
KERNEL, MEMCPY, MEMSET, RUNTIME, CPU_OP, COLLECTIVE, PYTHON, ANNOTATION = range(len(CATEGORIES))
# Device-side categories that count as useful GPU work for exclusive time.
GPU_WORK = (KERNEL, MEMCPY, MEMSET, COLLECTIVE)

# Truncation tiers: when a window exceeds its byte budget, higher tiers go first.
# python -> cpu_op -> runtime -> annotations -> (kernels, memcpy/memset, collectives, ProfilerStep#N).
TIER_OF_CATEGORY = {PYTHON: 4, CPU_OP: 3, RUNTIME: 2, ANNOTATION: 1, KERNEL: 0, MEMCPY: 0, MEMSET: 0,
                    COLLECTIVE: 0}

EVENT_COLUMNS = ("category", "name", "start_ns", "dur_ns", "device", "stream", "step", "bytes", "corr", "tid",
                 "path")
WIRE_COLUMNS = ("category", "name", "start_delta_ns", "dur_ns", "device", "stream", "step", "bytes", "corr",
                "tid", "path", "attrs")

STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
_ADDR_RE = re.compile(r" at 0x[0-9a-fA-F]+")
_NCCL_KERNEL_RE = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")
# Names torch itself drops from prof.events() (torch/autograd/profiler_util.py:_filter_name).
_FILTERED_NAMES = frozenset({"[memory]", "[OutOfMemory]", "profiler::_record_function_enter",
                             "profiler::_record_function_enter_new", "profiler::_record_function_exit",
                             "aten::is_leaf", "aten::output_nr", "aten::_version"})
_RUNTIME_TYPES = frozenset({"cuda_runtime", "cuda_driver", "privateuse1_runtime", "privateuse1_driver",
                            "mtia_runtime", "xpu_runtime", "hip_runtime", "hip_driver"})
# Kineto activity types by side (others are resolved with device_type()).
_HOST_TYPES = frozenset({"cpu_op", "user_annotation", "cpu_instant_event", "python_function", "overhead"}
                        | _RUNTIME_TYPES)
_DEVICE_TYPES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "cuda_sync",
                           "concurrent_kernel"})
_DTYPE_BYTES = {"float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8, "float64": 8,
                "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "byte": 1, "uint8": 1,
                "char": 1, "int8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complexfloat": 8,
                "complexdouble": 16}
_COLLECTIVE_META = {"Collective name": "op", "Process Group Name": "pg", "Process Group Description": "pg_desc",
                    "Group size": "group_size", "dtype": "dtype", "In msg nelems": "in_nelems",
                    "Out msg nelems": "out_nelems", "Seq": "seq", "Rank": "peer_rank"}
_DAY_NS = 86_400 * 10**9


# --------------------------------------------------------------------------------------------
# Adapter: torch.profiler -> event dicts
# --------------------------------------------------------------------------------------------

def experimental_config() -> Any:
    """The ``experimental_config`` to pass to ``torch.profiler.profile`` so that GPU metadata (stream,
    bytes, grid/block, NCCL collective sizes) reaches :func:`extract_events`. None if unsupported."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(expose_kineto_event_metadata=True)
    except (ImportError, TypeError):
        return None


def detect_clock_offset_ns(sample_ns: int, wall_ns: int | None = None, mono_ns: int | None = None) -> int:
    """Offset to add to profiler timestamps to get host wall-clock ns since the epoch.

    ``sample_ns`` is a profiler timestamp taken about now (e.g. ``trace_start_ns()``). Within a day of
    ``time.time_ns()`` it is epoch-based: 0. Within a day of ``time.monotonic_ns()``: ``wall - mono``.
    Anything else raises ValueError (an unknown clock would store wrong times silently).
    """
    wall = time.time_ns() if wall_ns is None else wall_ns
    mono = time.monotonic_ns() if mono_ns is None else mono_ns
    if abs(sample_ns - wall) < _DAY_NS:
        return 0
    if abs(sample_ns - mono) < _DAY_NS:
        return wall - mono
    raise ValueError(f"profiler timestamp {sample_ns} is neither epoch ({wall}) nor monotonic ({mono}) time")


def _kineto_result(prof: Any) -> Any:
    """The ``_ProfilerResult`` of a stopped torch.profiler.profile, a legacy
    torch.autograd.profiler.profile, or the result itself; None if there is none."""
    for obj in (getattr(getattr(prof, "profiler", None), "kineto_results", None),
                getattr(prof, "kineto_results", None), prof):
        if obj is not None and callable(getattr(obj, "events", None)) and callable(
                getattr(obj, "trace_start_ns", None)):
            return obj
    return None


def _is_collective_cpu(name: str) -> bool:
    return (name.startswith(("c10d::", "gloo:", "nccl:")) or name == "record_param_comms")


def _parse_meta(e: Any) -> dict[str, Any] | None:
    """Kineto metadata of one event: ``metadata_json()`` is a JSON object body without braces."""
    try:
        s = e.metadata_json()
    except Exception:
        s = ""
    if s:
        try:
            obj = json.loads("{" + s + "}")
            if isinstance(obj, dict):
                return obj
        except ValueError:
            pass
    try:
        extra = e.extra_meta()
    except Exception:
        return None
    if not extra:
        return None
    out: dict[str, Any] = {}
    for k, v in dict(extra).items():
        try:
            out[k] = json.loads(v) if isinstance(v, str) else v
        except ValueError:
            out[k] = v
    return out


def _activity_type(e: Any, cpu: bool) -> str:
    at = e.activity_type()
    if isinstance(at, str):
        return at
    if e.is_python_function():
        return "python_function"
    if e.is_user_annotation():
        return "user_annotation" if cpu else "gpu_user_annotation"
    return "cpu_op" if cpu else "kernel"


def extract_events(prof: Any, *, clock_offset_ns: int | None = None,
                   trace_start_ns: int | None = None) -> list[dict[str, Any]]:
    """Plain event dicts (see the module docstring) from a stopped profiler.

    Accepts a ``torch.profiler.profile`` after ``stop()`` (or inside ``on_trace_ready``), a legacy
    ``torch.autograd.profiler.profile``, or their ``kineto_results``. Reads
    ``kineto_results.events()`` directly (no JSON export). Timestamps are mapped to host wall-clock
    ns: ``clock_offset_ns`` if given, else :func:`detect_clock_offset_ns` on the trace start.
    Python events carry ``py_id``/``py_parent`` (parent linkage, the call tree).

    Fallback: an object whose ``events()`` returns ``FunctionEvent``-like objects (``time_range`` in µs
    relative to the trace start) is accepted when ``trace_start_ns`` is given.

    Raises TypeError for objects that are not profilers, ValueError for a profiler with no results
    (not stopped yet, or ``trace_only=True``).
    """
    result = _kineto_result(prof)
    if result is None:
        events_fn = getattr(prof, "events", None)
        if not callable(events_fn):
            raise TypeError(f"extract_events needs a stopped torch.profiler.profile, got {type(prof).__name__}")
        try:
            fevents = events_fn()
        except Exception as exc:
            raise ValueError(f"profiler has no events ({type(exc).__name__}: {exc}); was it stopped?") from None
        if fevents is None:
            raise ValueError("profiler has no results; call stop() first (or use on_trace_ready)")
        if trace_start_ns is None:
            raise ValueError("FunctionEvent timestamps are relative to the trace start: pass trace_start_ns")
        return _from_function_events(fevents, trace_start_ns + (clock_offset_ns or 0))
    try:
        raw = result.events()
        start = result.trace_start_ns()
    except Exception as exc:
        raise ValueError(f"profiler results unreadable ({type(exc).__name__}: {exc})") from None
    offset = detect_clock_offset_ns(start) if clock_offset_ns is None else clock_offset_ns
    from torch._C._autograd import DeviceType

    cpu_type = DeviceType.CPU
    hidden = getattr(type(raw[0]), "is_hidden_event", None) if len(raw) else None
    out: list[dict[str, Any]] = []
    append = out.append
    for e in raw:
        name = e.name()
        if name in _FILTERED_NAMES:
            continue
        at = e.activity_type()
        if at == "python_function":
            append({"type": at, "name": name, "start_ns": e.start_ns() + offset, "dur_ns": e.duration_ns(),
                    "tid": e.device_resource_id(), "py_id": e.python_id(), "py_parent": e.python_parent_id()})
            continue
        if at in _HOST_TYPES:
            cpu = True
        elif at in _DEVICE_TYPES:
            cpu = False
        else:
            cpu = e.device_type() == cpu_type
            at = _activity_type(e, cpu)
        rec: dict[str, Any] = {"type": at, "name": name, "start_ns": e.start_ns() + offset, "dur_ns": e.duration_ns()}
        if cpu:
            if at == "cpu_op" and hidden is not None and hidden(e):
                continue
            rec["tid"] = e.device_resource_id()
            rec["corr"] = e.correlation_id()
            if _is_collective_cpu(name):
                rec["meta"] = _parse_meta(e)
                shapes = e.shapes()
                if shapes:
                    rec["shapes"] = [list(s) for s in shapes]
                    rec["dtypes"] = list(e.dtypes())
        else:
            rec["device"] = e.device_index()
            rec["stream"] = e.device_resource_id()
            rec["corr"] = e.correlation_id()
            rec["linked"] = e.linked_correlation_id()
            meta = _parse_meta(e)
            if meta:
                rec["meta"] = meta
                if isinstance(meta.get("stream"), int):
                    rec["stream"] = meta["stream"]
                if isinstance(meta.get("bytes"), int):
                    rec["bytes"] = meta["bytes"]
        append(rec)
    return out


def _from_function_events(fevents: Iterable[Any], base_ns: int) -> list[dict[str, Any]]:
    out = []
    for fe in fevents:
        at = getattr(fe, "activity_type", None)
        dev = getattr(fe, "device_type", None)
        cpu = dev is None or getattr(dev, "name", str(dev)).upper().endswith("CPU")
        if not isinstance(at, str):
            at = ("python_function" if getattr(fe, "is_python_function", False) else
                  "user_annotation" if getattr(fe, "is_user_annotation", False) else "cpu_op" if cpu else "kernel")
        start = base_ns + int(round(fe.time_range.start * 1000))
        rec: dict[str, Any] = {"type": at, "name": fe.name, "start_ns": start,
                               "dur_ns": int(round(fe.time_range.elapsed_us() * 1000)),
                               "corr": int(getattr(fe, "id", 0) or 0)}
        if cpu:
            rec["tid"] = int(getattr(fe, "device_resource_id", -1) or getattr(fe, "thread", -1))
            rec["py_id"] = int(getattr(fe, "python_id", -1) or -1) if at == "python_function" else -1
            rec["py_parent"] = int(getattr(fe, "python_parent_id", -1) or -1) if at == "python_function" else -1
        else:
            rec["device"] = int(getattr(fe, "device_index", 0))
            rec["stream"] = int(getattr(fe, "device_resource_id", -1))
            rec["linked"] = int(getattr(fe, "linked_correlation_id", 0) or 0)
        out.append(rec)
    return out


# --------------------------------------------------------------------------------------------
# Columnar conversion
# --------------------------------------------------------------------------------------------

def _op_name(raw: str) -> str:
    """Collective op names normalised across backends: all_reduce / allreduce_ / AllReduce -> allreduce."""
    return raw.replace("_", "").lower()


def _categorise(e: dict[str, Any]) -> tuple[int, dict[str, Any] | None, int]:
    """(category code, attrs, bytes) of one event dict."""
    at, name = e["type"], e["name"]
    meta = e.get("meta") or {}
    nbytes = int(e.get("bytes", 0) or 0)
    if at == "python_function":
        return PYTHON, None, 0
    if at == "cpu_op":
        if _is_collective_cpu(name):
            return COLLECTIVE, _collective_attrs(name, e, meta), nbytes or _collective_bytes(e, meta)
        return CPU_OP, None, nbytes
    if at == "user_annotation":
        if name.startswith(("gloo:", "nccl:")):
            return COLLECTIVE, _collective_attrs(name, e, meta), nbytes or _collective_bytes(e, meta)
        return ANNOTATION, None, 0
    if at == "kernel":
        if name.startswith("nccl"):
            return COLLECTIVE, _collective_attrs(name, e, meta), nbytes or _collective_bytes(e, meta)
        attrs = {k: meta[k] for k in ("grid", "block") if k in meta}
        return KERNEL, attrs or None, nbytes
    if at == "gpu_memcpy":
        kind = name[len("Memcpy "):].split(" ", 1)[0] if name.startswith("Memcpy ") else name
        return MEMCPY, {"kind": kind}, nbytes
    if at == "gpu_memset":
        return MEMSET, None, nbytes
    if at in _RUNTIME_TYPES:
        return RUNTIME, None, 0
    # gpu_user_annotation, cpu_instant_event, overhead, cuda_sync, ...: markers, not work.
    return ANNOTATION, ({"type": at} if at not in ("gpu_user_annotation",) else None), nbytes


def _collective_attrs(name: str, e: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    for k, a in _COLLECTIVE_META.items():
        v = meta.get(k)
        if v is not None and v != "":
            attrs[a] = v
    if "op" in attrs:
        attrs["op"] = _op_name(str(attrs["op"]))
    else:
        m = _NCCL_KERNEL_RE.match(name)
        if m:
            raw = m.group(1)
        elif ":" in name:
            raw = name.rsplit(":", 1)[1]
        else:
            raw = name
        attrs["op"] = _op_name(raw)
    if "in_nelems" not in attrs and e.get("shapes"):
        n = sum(int(np.prod(s)) for s in e["shapes"] if s)
        if n:
            attrs["in_nelems"] = n
    if "dtype" not in attrs and e.get("dtypes"):
        dt = [d for d in e["dtypes"] if d]
        if dt:
            attrs["dtype"] = dt[0]
    return attrs


def _collective_bytes(e: dict[str, Any], meta: dict[str, Any]) -> int:
    n = meta.get("In msg nelems")
    dtype = meta.get("dtype")
    if not isinstance(n, int) and e.get("shapes"):
        n = sum(int(np.prod(s)) for s in e["shapes"] if s)
        dtype = next((d for d in (e.get("dtypes") or []) if d), dtype)
    size = _DTYPE_BYTES.get(str(dtype).lower().replace("torch.", "")) if dtype else None
    return int(n) * size if isinstance(n, int) and size else 0


def to_columnar(events: Sequence[dict[str, Any]], window_id: str, first_step: int | None,
                *, step_bounds: Sequence[tuple[int, int, int]] | None = None) -> dict[str, Any]:
    """Event dicts -> one columnar window.

    Returns ``{"window_id", "first_step", "last_step", "start_ns", "end_ns", "categories", "names",
    "paths", "events"}`` where ``events`` holds equal-length columns: ``category`` (code into
    ``categories``), ``name`` (index into ``names``), ``start_ns``, ``dur_ns``, ``device`` (-1 on the host),
    ``stream`` (-1), ``step`` (-1 outside steps), ``bytes``, ``corr``, ``tid`` (system thread id, -1 on the
    device), ``path`` (python call-path id, -1 for other events): int64 numpy arrays sorted by start time;
    and ``attrs``: a list of small dicts or None (collectives: op/pg/group_size/dtype/in_nelems/...;
    memcpy: kind; kernels: grid/block when exposed).

    ``paths`` is the interned call-path table ``[[parent_path_id, name_idx], ...]`` (parent -1 at the
    root); a python event's name index is its own function, its path the chain up to the root.
    Python names lose object addresses (`` at 0x...``) so that paths intern across calls.

    Steps: ``step_bounds`` [(step, start_ns, end_ns), ...] if given (the tracer's own step records);
    else ``ProfilerStep#N`` annotations (present when the profiler has a schedule), numbered
    ``first_step + N - min(N)`` (or ``N`` when ``first_step`` is None). A host event gets the step whose
    interval contains its start; a GPU event gets the step of the CPU op that launched it
    (``linked``), else of its runtime call (same ``corr``), else by its own start time.
    Window bounds: the span of the steps if known, else of all events.
    """
    n = len(events)
    cat_l: list[int] = []
    dev_l: list[int] = []
    bytes_l: list[int] = []
    name_l: list[int] = []
    start_l: list[int] = []
    dur_l: list[int] = []
    stream_l: list[int] = []
    corr_l: list[int] = []
    tid_l: list[int] = []
    linked_l: list[int] = []
    attrs: list[dict[str, Any] | None] = []
    names: list[str] = []
    name_index: dict[str, int] = {}
    py_rows: list[int] = []
    i = -1
    try:
        for i, e in enumerate(events):
            nm = e["name"]
            if e["type"] == "python_function":
                c, a, b, d, tid_v = PYTHON, None, 0, -1, e.get("tid", -1)
                py_rows.append(i)
                if " at 0x" in nm:
                    nm = _ADDR_RE.sub("", nm)
            else:
                d = e.get("device", -1)
                c, a, b = _categorise(e)
                tid_v = -1 if d >= 0 else e.get("tid", -1)
            idx = name_index.get(nm)
            if idx is None:
                idx = name_index[nm] = len(names)
                names.append(nm)
            cat_l.append(c)
            dev_l.append(d)
            bytes_l.append(b)
            attrs.append(a)
            name_l.append(idx)
            start_l.append(e["start_ns"])
            dur_l.append(e.get("dur_ns", 0))
            stream_l.append(e.get("stream", -1))
            corr_l.append(e.get("corr", 0))
            tid_l.append(tid_v)
            linked_l.append(e.get("linked", 0))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"event {i} is not an event dict ({type(exc).__name__}: {exc}): "
                         f"{events[i]!r:.120}") from None

    def arr(values: list[int], name: str) -> np.ndarray:
        try:
            return np.array(values, dtype=np.int64)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"event column {name} holds a non-integer: {exc}") from None

    cat, dev, nbytes, name_ids = arr(cat_l, "category"), arr(dev_l, "device"), arr(bytes_l, "bytes"), arr(name_l, "name")
    start, dur, stream = arr(start_l, "start_ns"), np.maximum(arr(dur_l, "dur_ns"), 0), arr(stream_l, "stream")
    corr, tid, linked = arr(corr_l, "corr"), arr(tid_l, "tid"), arr(linked_l, "linked")

    # Python call paths.
    path = np.full(n, -1, dtype=np.int64)
    paths: list[list[int]] = []
    if py_rows:
        path_index: dict[tuple[int, int], int] = {}
        by_py: dict[int, int] = {}
        ids = [events[i].get("py_id", -1) for i in py_rows]
        py_order = py_rows if all(x < y for x, y in zip(ids, ids[1:], strict=False)) else [
            py_rows[k] for k in sorted(range(len(py_rows)), key=lambda k: (ids[k], events[py_rows[k]]["start_ns"]))]
        for i in py_order:
            e = events[i]
            parent = by_py.get(e.get("py_parent", -1), -1)
            key = (parent, int(name_ids[i]))
            pid = path_index.get(key)
            if pid is None:
                pid = path_index[key] = len(paths)
                paths.append([parent, int(name_ids[i])])
            path[i] = pid
            py_id = e.get("py_id", -1)
            if py_id is not None and py_id >= 0:
                by_py[py_id] = pid

    # Steps.
    if step_bounds:
        sb = sorted(((int(s), int(a), int(b)) for s, a, b in step_bounds), key=lambda t: t[1])
        s_num = np.array([s for s, _, _ in sb], dtype=np.int64)
        s_start = np.array([a for _, a, _ in sb], dtype=np.int64)
        s_end = np.array([b for _, _, b in sb], dtype=np.int64)
    else:
        marks = [(int(m.group(1)), int(start[i]), int(start[i] + dur[i])) for i in np.flatnonzero(cat == ANNOTATION)
                 if (m := STEP_RE.match(names[name_ids[i]]))]
        marks.sort(key=lambda t: t[1])
        base = min((m[0] for m in marks), default=0)
        s_num = np.array([(first_step + k - base) if first_step is not None else k for k, _, _ in marks],
                         dtype=np.int64)
        s_start = np.array([a for _, a, _ in marks], dtype=np.int64)
        s_end = np.array([b for _, _, b in marks], dtype=np.int64)
    step = np.full(n, -1, dtype=np.int64)
    if len(s_num):
        k = np.searchsorted(s_start, start, side="right") - 1
        ok = (k >= 0) & (start < s_end[np.maximum(k, 0)])
        step[ok] = s_num[k[ok]]
        gpu = dev >= 0
        if gpu.any():
            host = ~gpu
            for key_gpu, host_mask in ((linked, host & (cat != RUNTIME)), (corr, host & (cat == RUNTIME))):
                hc = corr[host_mask]
                if not len(hc):
                    continue
                hs = step[host_mask]
                o = np.argsort(hc, kind="stable")
                hc, hs = hc[o], hs[o]
                want = gpu & (key_gpu > 0)
                pos = np.minimum(np.searchsorted(hc, key_gpu[want]), len(hc) - 1)
                hit = (hc[pos] == key_gpu[want]) & (hs[pos] >= 0)
                rows = np.flatnonzero(want)[hit]
                step[rows] = hs[pos[hit]]
                gpu = gpu.copy()
                gpu[rows] = False  # resolved; the runtime pass only fills the rest

    # Sort by start time (stable: keeps the profiler's parent-before-child order on ties).
    order = np.lexsort((-dur, start)) if n else np.arange(0)
    arrays = {"category": cat, "name": name_ids, "start_ns": start, "dur_ns": dur, "device": dev, "stream": stream,
              "step": step, "bytes": nbytes, "corr": corr, "tid": tid, "path": path}
    cols: dict[str, Any] = {k: v[order] for k, v in arrays.items()}
    cols["attrs"] = [attrs[i] for i in order.tolist()]

    if len(s_num):
        w_start, w_end = int(s_start.min()), int(s_end.max())
        first, last = int(s_num.min()), int(s_num.max())
    else:
        w_start = int(start.min()) if n else 0
        w_end = int((start + dur).max()) if n else 0
        first = first_step if first_step is not None else -1
        last = first
    return {"window_id": window_id, "first_step": first, "last_step": last, "start_ns": w_start, "end_ns": w_end,
            "categories": list(CATEGORIES), "names": names, "paths": paths, "events": cols}


def path_strings(names: Sequence[str], paths: Sequence[Sequence[int]], ids: Iterable[int] | None = None,
                 sep: str = ";") -> dict[int, str]:
    """Call-path id -> ``"root;...;leaf"`` for ``ids`` (all paths if None). Raises ValueError on a
    malformed table (a cycle, an index out of range)."""
    out: dict[int, str] = {}
    want = range(len(paths)) if ids is None else ids
    for pid in want:
        if pid in out:
            continue
        chain: list[int] = []
        p = pid
        while p >= 0 and p not in out:
            if p >= len(paths) or len(chain) > len(paths):
                raise ValueError(f"call path {pid} is malformed (at {p})")
            chain.append(p)
            p = paths[p][0]
        prefix = out[p] if p >= 0 else None
        for q in reversed(chain):
            ni = paths[q][1]
            if not 0 <= ni < len(names):
                raise ValueError(f"call path {q} names index {ni}, table has {len(names)}")
            prefix = names[ni] if prefix is None else f"{prefix}{sep}{names[ni]}"
            out[q] = prefix
    return out


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------

def _cpu_self_time(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Self time of intervals on one thread: duration minus the parts of direct children inside it.

    ``start``/``end`` sorted by (start asc, end desc, parent-first tie break), all durations > 0. Depth of an
    interval = intervals open at its start; its parent = the latest earlier interval one level up.
    Exact for properly nested intervals; with improper overlaps a child counts only for its part
    inside the parent, and self time is clipped to [0, duration].
    """
    n = len(start)
    ords = np.arange(n)
    ended = np.searchsorted(np.sort(end), start, side="right")
    depth = ords - ended
    key = depth * n + ords
    sk = np.argsort(key, kind="stable")
    skey = key[sk]
    want = (depth - 1) * n + ords
    pos = np.searchsorted(skey, want, side="left") - 1
    has = (depth > 0) & (pos >= 0)
    cand = np.where(has, sk[np.maximum(pos, 0)], -1)
    has &= (cand >= 0) & (depth[np.maximum(cand, 0)] == depth - 1)
    children: np.ndarray = np.zeros(n, dtype=np.float64)
    if has.any():
        c = np.flatnonzero(has)
        p = cand[c]
        contrib = np.clip(np.minimum(end[c], end[p]) - start[c], 0, None)
        children = np.bincount(p, weights=contrib.astype(np.float64), minlength=n)
    return np.clip(end - start - np.rint(children).astype(np.int64), 0, None)


def _sole_time(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per interval, the time during which it is the only one of ``start``/``end`` running."""
    n = len(start)
    t = np.concatenate([start, end])
    delta = np.concatenate([np.ones(n, np.int64), -np.ones(n, np.int64)])
    sign_id = np.concatenate([np.arange(n, dtype=np.int64), -np.arange(n, dtype=np.int64)])
    o = np.argsort(t, kind="stable")
    t, count, idsum = t[o], np.cumsum(delta[o]), np.cumsum(sign_id[o])
    seg = np.diff(t)
    alone = (count[:-1] == 1) & (seg > 0)
    return np.bincount(idsum[:-1][alone], weights=seg[alone].astype(np.float64), minlength=n).round().astype(np.int64)


def _uncovered_time(start: np.ndarray, end: np.ndarray, cov_start: np.ndarray, cov_end: np.ndarray) -> np.ndarray:
    """Per interval [start, end), the time not covered by the union of the cover intervals."""
    if not len(cov_start):
        return end - start
    m = len(cov_start)
    t = np.concatenate([cov_start, cov_end])
    delta = np.concatenate([np.ones(m, np.int64), -np.ones(m, np.int64)])
    o = np.argsort(t, kind="stable")
    t, count = t[o], np.cumsum(delta[o])
    busy_seg = np.where(count[:-1] > 0, np.diff(t), 0)
    busy_cum = np.concatenate([[0], np.cumsum(busy_seg)])   # busy time in [t0, t[k]]

    def busy_until(x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(t, x, side="right") - 1
        kk = np.clip(k, 0, len(t) - 1)
        tail = np.where((k >= 0) & (k < len(t) - 1) & (count[np.minimum(kk, len(count) - 1)] > 0), x - t[kk], 0)
        return np.where(k < 0, 0, busy_cum[kk] + tail)

    return np.clip((end - start) - (busy_until(end) - busy_until(start)), 0, None)


def exclusive_times(col: dict[str, Any]) -> np.ndarray:
    """Exclusive ("not overlapped") ns of every event of a columnar window; see :func:`summarize`."""
    ev = col["events"]
    cat = np.asarray(ev["category"], dtype=np.int64)
    start = np.asarray(ev["start_ns"], dtype=np.int64)
    dur = np.asarray(ev["dur_ns"], dtype=np.int64)
    end = start + dur
    dev = np.asarray(ev["device"], dtype=np.int64)
    tid = np.asarray(ev["tid"], dtype=np.int64)
    out = np.zeros(len(cat), dtype=np.int64)
    host = dev < 0
    is_ann = cat == ANNOTATION
    # Host: self time within each thread's nesting (annotations excluded from the forest).
    nest = host & ~is_ann & (dur > 0)
    prio = np.select([cat == PYTHON, cat == COLLECTIVE, cat == CPU_OP], [0, 1, 2], 3)
    for t in np.unique(tid[nest]):
        idx = np.flatnonzero(nest & (tid == t))
        o = np.lexsort((prio[idx], -end[idx], start[idx]))
        idx = idx[o]
        out[idx] = _cpu_self_time(start[idx], end[idx])
    for t in np.unique(tid[host & is_ann]):
        a = np.flatnonzero(host & is_ann & (tid == t))
        c = np.flatnonzero(nest & (tid == t))
        out[a] = _uncovered_time(start[a], end[a], start[c], end[c])
    # Device: time when no other GPU work runs on the same device.
    work = ~host & np.isin(cat, GPU_WORK)
    for d in np.unique(dev[~host]):
        w = np.flatnonzero(work & (dev == d))
        if len(w):
            out[w] = _sole_time(start[w], end[w])
        a = np.flatnonzero(~host & ~np.isin(cat, GPU_WORK) & (dev == d))
        if len(a):
            out[a] = _uncovered_time(start[a], end[a], start[w], end[w])
    return out


SUMMARY_COLUMNS = ("category", "name", "count", "total_ns", "median_ns", "p95_ns", "max_ns", "exclusive_ns")


def summarize(col: dict[str, Any], *, python_min_frac: float = 0.0) -> dict[str, Any]:
    """Per-function summary of a columnar window, grouped by (category, name); python events are
    grouped by call path and named ``"root;...;leaf"``.

    Returns columns (lists) ``category`` (str), ``name`` (str), ``count``, ``total_ns`` (sum of
    durations), ``median_ns``, ``p95_ns`` (linear interpolation, numpy's default), ``max_ns``,
    ``exclusive_ns``; plus scalars ``window_ns`` (window wall length, ``end_ns - start_ns``) and
    ``python_paths_dropped``.

    ``exclusive_ns`` = the sum over the group's events of the time each runs while no other useful
    work overlaps it:

    - host-side events (cpu_op, python, runtime, host collectives): self time in the nesting of the
      same thread: duration minus the time of direct children on that thread (python frames, ops,
      runtime calls, collectives; annotations are not part of the nesting);
    - host annotations (``ProfilerStep#N``, record_function ranges): time during which nothing else
      is recorded on the same thread;
    - GPU work (kernels, memcpy, memset, NCCL kernels): time during which no other GPU work runs on
      the same device (any stream); GPU annotations: time with no GPU work on the device.

    ``bottleneck ratio = exclusive_ns / window_ns``. Python call paths whose total is below
    ``python_min_frac * window_ns`` are left out (counted in ``python_paths_dropped``); the kept set is
    closed under prefixes (a parent path's total >= its children's).
    """
    ev = col["events"]
    cat = np.asarray(ev["category"], dtype=np.int64)
    name = np.asarray(ev["name"], dtype=np.int64)
    path = np.asarray(ev["path"], dtype=np.int64)
    dur = np.asarray(ev["dur_ns"], dtype=np.int64)
    window_ns = int(col["end_ns"]) - int(col["start_ns"])
    empty: dict[str, Any] = {c: [] for c in SUMMARY_COLUMNS}
    if not len(cat):
        return {**empty, "window_ns": window_ns, "python_paths_dropped": 0}
    excl = exclusive_times(col)
    by_path = (cat == PYTHON) & (path >= 0)           # python without a path (odd input): by name
    key = (cat << 41) + (by_path.astype(np.int64) << 40) + np.where(by_path, path, name)
    o = np.lexsort((dur, key))
    k_s, d_s, x_s = key[o], dur[o], excl[o]
    first = np.concatenate([[True], k_s[1:] != k_s[:-1]])
    starts = np.flatnonzero(first)
    counts = np.diff(np.concatenate([starts, [len(k_s)]]))
    total = np.add.reduceat(d_s, starts)
    excl_sum = np.add.reduceat(x_s, starts)
    mx = d_s[starts + counts - 1]
    median = (d_s[starts + (counts - 1) // 2] + d_s[starts + counts // 2]) // 2
    pos = 0.95 * (counts - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.ceil(pos).astype(np.int64)
    vlo, vhi = d_s[starts + lo], d_s[starts + hi]
    p95 = np.rint(vlo + (vhi - vlo) * (pos - lo)).astype(np.int64)
    g_cat = k_s[starts] >> 41
    g_id = k_s[starts] & ((1 << 40) - 1)
    keep = np.ones(len(starts), dtype=bool)
    is_py = ((k_s[starts] >> 40) & 1) == 1
    dropped = 0
    if python_min_frac > 0 and is_py.any():
        small = is_py & (total < python_min_frac * max(window_ns, 1))
        dropped = int(small.sum())
        keep &= ~small
    names = col["names"]
    py_names = path_strings(names, col["paths"], g_id[is_py & keep].tolist())
    cats = list(col.get("categories") or CATEGORIES)
    return {
        "category": [cats[c] for c in g_cat[keep].tolist()],
        "name": [py_names[i] if p else names[i] for p, i in zip(is_py[keep].tolist(), g_id[keep].tolist(),
                                                                 strict=True)],
        "count": counts[keep].tolist(), "total_ns": total[keep].tolist(), "median_ns": median[keep].tolist(),
        "p95_ns": p95[keep].tolist(), "max_ns": mx[keep].tolist(), "exclusive_ns": excl_sum[keep].tolist(),
        "window_ns": window_ns, "python_paths_dropped": dropped,
    }


def summary_body(col: dict[str, Any], functions: dict[str, Any], *, events_sent: int, truncated: bool,
                 status: str = "done") -> dict[str, Any]:
    """The body of a ``summary`` message for this window (what storage/sink.py maps to
    ``function_summaries`` rows and the ``trace_windows`` row)."""
    return {"window_id": col["window_id"], "functions": functions, "first_step": int(col["first_step"]),
            "last_step": int(col["last_step"]), "start_ns": int(col["start_ns"]), "end_ns": int(col["end_ns"]),
            "events_total": len(col["events"]["category"]), "events_sent": int(events_sent),
            "truncated": bool(truncated), "status": status}


# --------------------------------------------------------------------------------------------
# Chunking under a byte budget
# --------------------------------------------------------------------------------------------

def _int_sizes(v: np.ndarray) -> np.ndarray:
    """msgpack encoded size of each int64."""
    return np.select(
        [(v >= -32) & (v <= 127), (v >= -128) & (v <= 255), (v >= -32768) & (v <= 65535),
         (v >= -(2**31)) & (v <= 2**32 - 1)], [1, 2, 3, 5], 9)


def _tiers(col: dict[str, Any]) -> np.ndarray:
    ev = col["events"]
    cat = np.asarray(ev["category"], dtype=np.int64)
    tier = np.select([cat == c for c in TIER_OF_CATEGORY], list(TIER_OF_CATEGORY.values()), 1)
    ann = np.flatnonzero(cat == ANNOTATION)
    if len(ann):
        names = col["names"]
        name = np.asarray(ev["name"], dtype=np.int64)
        step_mark = np.fromiter((names[i].startswith("ProfilerStep#") for i in name[ann].tolist()), dtype=bool,
                                count=len(ann))
        tier[ann[step_mark]] = 0
    return tier


def _chunk_body(col: dict[str, Any], rows: np.ndarray, attrs_all: list[Any]) -> dict[str, Any]:
    """A self-contained ``trace`` body for these rows (sorted by start): its own names, paths and
    tids tables, re-indexed."""
    ev = col["events"]
    names_all, paths_all = col["names"], col["paths"]
    name = np.asarray(ev["name"], dtype=np.int64)[rows]
    path = np.asarray(ev["path"], dtype=np.int64)[rows]
    # Paths used, closed under parents.
    used_paths: list[int] = []
    seen: set[int] = set()
    for p in np.unique(path[path >= 0]).tolist():
        while p >= 0 and p not in seen:
            seen.add(p)
            used_paths.append(p)
            p = paths_all[p][0]
    used_paths.sort()
    pmap = {p: i for i, p in enumerate(used_paths)}
    name_set = set(np.unique(name).tolist()) | {paths_all[p][1] for p in used_paths}
    used_names = sorted(name_set)
    nmap = np.full(len(names_all), -1, dtype=np.int64)
    nmap[used_names] = np.arange(len(used_names))
    new_paths = [[pmap[paths_all[p][0]] if paths_all[p][0] >= 0 else -1, int(nmap[paths_all[p][1]])]
                 for p in used_paths]
    tid = np.asarray(ev["tid"], dtype=np.int64)[rows]
    tids, tid_idx = np.unique(tid, return_inverse=True)
    start = np.asarray(ev["start_ns"], dtype=np.int64)[rows]
    t0 = int(start[0]) if len(start) else 0
    delta = np.diff(start, prepend=t0)
    remap = np.full(len(paths_all) + 1, -1, dtype=np.int64)   # last slot: path -1 stays -1
    remap[used_paths] = np.arange(len(used_paths))
    events = {
        "category": np.asarray(ev["category"], dtype=np.int64)[rows].tolist(),
        "name": nmap[name].tolist(),
        "start_delta_ns": delta.tolist(),
        "dur_ns": np.asarray(ev["dur_ns"], dtype=np.int64)[rows].tolist(),
        "device": np.asarray(ev["device"], dtype=np.int64)[rows].tolist(),
        "stream": np.asarray(ev["stream"], dtype=np.int64)[rows].tolist(),
        "step": np.asarray(ev["step"], dtype=np.int64)[rows].tolist(),
        "bytes": np.asarray(ev["bytes"], dtype=np.int64)[rows].tolist(),
        "corr": np.asarray(ev["corr"], dtype=np.int64)[rows].tolist(),
        "tid": tid_idx.astype(np.int64).tolist(),
        "path": remap[path].tolist(),
        "attrs": [attrs_all[i] for i in rows.tolist()],
    }
    return {"window_id": col["window_id"], "t0_ns": t0, "categories": list(col.get("categories") or CATEGORIES),
            "names": [names_all[i] for i in used_names], "paths": new_paths, "tids": tids.tolist(),
            "events": events}


def _packed_len(body: dict[str, Any]) -> int:
    return len(msgpack.packb(body, use_bin_type=True))


def _split(col: dict[str, Any], rows: np.ndarray, sizes: np.ndarray, attrs: list[Any],
           max_chunk_bytes: int, header: dict[str, Any], sizes_out: list[int]) -> list[dict[str, Any]]:
    """Cut ``rows`` (sorted by start) into bodies of at most ``max_chunk_bytes`` packed bytes
    (``header`` included; 8 bytes are reserved for the chunk index and count added afterwards).
    Appends each body's packed size bound (packed bytes + 8) to ``sizes_out``."""
    if not len(rows):
        return []
    target = max(1, int(max_chunk_bytes * 0.85))
    cum = np.cumsum(sizes)
    cuts = np.searchsorted(cum, np.arange(target, int(cum[-1]) + target, target), side="right")
    cuts = np.unique(np.clip(np.concatenate([[0], cuts, [len(rows)]]), 0, len(rows)))
    out: list[dict[str, Any]] = []
    stack = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a][::-1]
    while stack:
        a, b = stack.pop()
        body = {**_chunk_body(col, rows[a:b], attrs), **header}
        size = _packed_len(body)
        if b - a > 1 and size > max_chunk_bytes - 8:
            m = (a + b) // 2
            stack.extend([(m, b), (a, m)])
            continue
        sizes_out.append(size + 8)             # + the chunk index and count added afterwards (<= 8 bytes)
        out.append(body)
    return out


def chunk(col: dict[str, Any], byte_budget: int, max_chunk_bytes: int = 512_000
          ) -> tuple[list[dict[str, Any]], bool, int]:
    """Split a columnar window into ``trace`` message bodies. Returns (bodies, truncated, sent_events).

    Each body is self-contained (choice: tables in every chunk, restricted to what the chunk uses, so
    the sink converts any chunk alone, in any order, after a re-delivery or with a chunk lost)::

        {"window_id", "chunk": i, "chunks": n, "t0_ns": start of the chunk's first event,
         "categories": [...], "names": [...], "paths": [[parent, name_idx], ...], "tids": [...],
         "events": {"category", "name", "start_delta_ns" (from the previous event; the first from t0_ns),
                    "dur_ns", "device", "stream", "step", "bytes", "corr", "tid" (index into tids),
                    "path" (index into paths or -1), "attrs"},
         "events_total", "events_sent", "truncated", "dropped": {category: events left out}}

    Events are in start order. ``byte_budget`` bounds the sum of the packed bodies. When the window
    does not fit, whole tiers are left out in this order: python, cpu_op, runtime, annotations
    (``ProfilerStep#N`` marks are kept), then kernels/memcpy/memset/collectives; within the tier that
    partly fits, the longest events are kept. Every body then says ``truncated: True`` with the
    per-category drop counts. No body is larger than ``max_chunk_bytes`` unless a single event is.
    """
    if byte_budget <= 0 or max_chunk_bytes <= 0:
        raise ValueError("byte_budget and max_chunk_bytes must be positive")
    ev = col["events"]
    n = len(ev["category"])
    if n == 0:
        return [], False, 0
    attrs = list(ev["attrs"])
    start = np.asarray(ev["start_ns"], dtype=np.int64)
    # Estimated packed bytes per event: its ints, the start delta, 1 for the tid index, its attrs.
    sizes = sum(_int_sizes(np.asarray(ev[c], dtype=np.int64)) for c in EVENT_COLUMNS
                if c not in ("start_ns", "tid"))
    sizes = sizes + _int_sizes(np.diff(start, prepend=start[0])) + 2
    has_attrs = [i for i, a in enumerate(attrs) if a is not None]
    if has_attrs:
        sizes[has_attrs] += np.array([_packed_len(attrs[i]) - 1 for i in has_attrs], dtype=np.int64)
    tier = _tiers(col)
    dur = np.asarray(ev["dur_ns"], dtype=np.int64)
    cat = np.asarray(ev["category"], dtype=np.int64)
    prio = np.lexsort((-dur, tier))          # keep order: tier asc, then longest first
    cum_prio = np.cumsum(sizes[prio])

    first_step = int(col["first_step"])

    def build(rows: np.ndarray) -> tuple[list[dict[str, Any]], int]:
        kept = np.zeros(n, dtype=bool)
        kept[rows] = True
        dropped_counts = np.bincount(cat[~kept], minlength=len(CATEGORIES)).tolist()
        header = {"events_total": n, "events_sent": len(rows), "truncated": len(rows) < n,
                  "dropped": {CATEGORIES[c]: k for c, k in enumerate(dropped_counts) if k}, "first_step": first_step}
        packed: list[int] = []
        bodies = _split(col, rows, sizes[rows], attrs, max_chunk_bytes, header, packed)
        for i, body in enumerate(bodies):
            body["chunk"], body["chunks"] = i, len(bodies)
        return bodies, sum(packed)

    rows = np.arange(n)
    bodies, total = build(rows)
    if total > byte_budget:
        # Shrink the estimated event budget until the packed bodies fit; tables and the larger start
        # deltas of a thinned window make the estimate low, so correct multiplicatively.
        event_budget = int(cum_prio[-1]) * byte_budget / total
        for _ in range(12):
            k = int(np.searchsorted(cum_prio, event_budget, side="right"))
            rows = np.sort(prio[:k])
            bodies, total = build(rows)
            if total <= byte_budget:
                break
            event_budget *= 0.97 * byte_budget / total
        else:
            rows, bodies = rows[:0], []
    sent = len(rows)
    return bodies, sent < n, sent
