"""torch.profiler -> the events of one window as column lists (the only torch-facing code).

:func:`extract_raw` reads ``kineto_results.events()`` directly (no JSON export) into a
:class:`RawEvents`: three groups of plain lists (python frames, other host events, device events),
each with only the columns that group has, categorised on the way. No per-event dict or object is
built: reading a KinetoEvent costs ~0.15-0.3 µs per accessor call, so the loop calls each accessor
it needs once and appends to lists; :func:`rankscope.producers.trace_events.to_columnar` turns the groups
into numpy columns.

Event dicts (:meth:`RawEvents.add`; what the offline Kineto-JSON reader produces)::

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

GPU metadata (stream, memcpy bytes, grid/block, NCCL collective fields) is only exposed to Python
when the profiler runs with ``experimental_config=experimental_config()`` (``expose_kineto_event_metadata``);
without it GPU streams still come from ``device_resource_id`` but bytes and collective sizes are 0.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from typing import Any

from rankscope.producers.categories import (
    ANNOTATION,
    COLLECTIVE,
    CPU_OP,
    RUNTIME_TYPES,
    attrs_and_bytes,
    classify,
    is_collective_cpu,
)
from rankscope.producers.trace_function_events import from_function_events, legacy_start_ns

ADDR_RE = re.compile(r" at 0x[0-9a-fA-F]+")
# Names torch itself drops from prof.events() (torch/autograd/profiler_util.py:_filter_name).
FILTERED_NAMES = frozenset({"[memory]", "[OutOfMemory]", "profiler::_record_function_enter",
                            "profiler::_record_function_enter_new", "profiler::_record_function_exit",
                            "aten::is_leaf", "aten::output_nr", "aten::_version"})
# Kineto activity types by side (others are resolved with device_type()).
HOST_TYPES = frozenset({"cpu_op", "user_annotation", "cpu_instant_event", "python_function", "overhead"}
                        | RUNTIME_TYPES)
DEVICE_TYPES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "cuda_sync",
                           "concurrent_kernel"})
_DAY_NS = 86_400 * 10**9



# The entry functions of the tracer's threads (producers/*.py), as the profiler names python frames.
OWN_THREAD_ENTRY = re.compile(r"(^|/)producers/(?:(?:transport|control|hw)\.py\(\d+\): _run|tracer\.py\(\d+\): "
                              r"_heartbeat_loop|trace_window\.py\(\d+\): _work_loop)$")


def frame_parents(ids: Any, parents: Any) -> Any:
    """Per python frame, the row of its parent frame or -1: the frame whose ``py_id`` is its
    ``py_parent`` and is lower than its own id (the profiler numbers frames in call order; anything
    else counts as a root, so garbage cannot make a cycle). int64 numpy arrays in and out."""
    import numpy as np

    if not len(ids):
        return np.zeros(0, dtype=np.int64)
    o = np.argsort(ids, kind="stable")
    sid = ids[o]
    pos = np.minimum(np.searchsorted(sid, parents), len(ids) - 1)
    return np.where((parents >= 0) & (sid[pos] == parents) & (parents < ids), o[pos], -1)


class RawEvents:
    """The events of one window, as column lists in three groups.

    ``py``: python frames (``name``, ``start_ns``, ``dur_ns``, ``tid``, ``py_id``, ``py_parent``);
    ``host``: other host events (``category``, ``name``, ``start_ns``, ``dur_ns``, ``tid``, ``corr``,
    ``bytes``); ``dev``: device events (``category``, ``name``, ``start_ns``, ``dur_ns``, ``device``,
    ``stream``, ``corr``, ``linked``, ``bytes``). ``name`` indexes ``names`` (python names without
    object addresses, so that call paths intern across calls); ``host_attrs``/``dev_attrs`` map a
    group row to its attrs (collectives, memcpy kind, kernel grid/block). ``offset_ns`` is added to
    every start when the columns are built.
    """

    PY = ("name", "start_ns", "dur_ns", "tid", "py_id", "py_parent")
    HOST = ("category", "name", "start_ns", "dur_ns", "tid", "corr", "bytes")
    DEV = ("category", "name", "start_ns", "dur_ns", "device", "stream", "corr", "linked", "bytes")

    def __init__(self, offset_ns: int = 0) -> None:
        self.names: list[str] = []
        self.name_index: dict[str, int] = {}
        # Column lists (int64 numpy arrays when read by the C++ reader).
        self.py: dict[str, Any] = {c: [] for c in self.PY}
        self.host: dict[str, Any] = {c: [] for c in self.HOST}
        self.dev: dict[str, Any] = {c: [] for c in self.DEV}
        self.host_attrs: dict[int, dict[str, Any] | None] = {}
        self.dev_attrs: dict[int, dict[str, Any] | None] = {}
        self.offset_ns = offset_ns

    def __len__(self) -> int:
        return len(self.py["name"]) + len(self.host["name"]) + len(self.dev["name"])

    def without_threads(self, tids: set[int]) -> tuple[RawEvents, int]:
        """These events less those of the tracer's own threads, and how many were left out: host and
        python events on threads ``tids``, and python frames under a tracer thread's entry function
        wherever the profiler put them (it files the stacks that are open when it starts under the
        thread that starts it). Device events stay. Returns ``self`` when nothing matches."""
        import numpy as np

        py_tid = np.asarray(self.py["tid"], dtype=np.int64)
        keep_py = ~np.isin(py_tid, list(tids))
        entry = [i for i, n in enumerate(self.names) if "producers/" in n and OWN_THREAD_ENTRY.search(n)]
        if entry and len(py_tid):
            own = np.isin(np.asarray(self.py["name"], dtype=np.int64), entry)
            if own.any():       # and every frame below one (a parent has a lower id: see _call_paths)
                parent = frame_parents(np.asarray(self.py["py_id"], dtype=np.int64),
                                       np.asarray(self.py["py_parent"], dtype=np.int64))
                while True:
                    grown = own | ((parent >= 0) & own[np.maximum(parent, 0)])
                    if (grown == own).all():
                        break
                    own = grown
                # And the threading.py frames that started those threads.
                boot = np.isin(np.asarray(self.py["name"], dtype=np.int64),
                               [i for i, n in enumerate(self.names) if n.startswith("threading.py(")])
                up = parent[own & (parent >= 0)]
                while len(up):
                    up = up[boot[up] & ~own[up]]
                    own[up] = True
                    up = parent[up][parent[up] >= 0]
                keep_py &= ~own
        keep_host = ~np.isin(np.asarray(self.host["tid"], dtype=np.int64), list(tids))
        dropped = int((~keep_py).sum() + (~keep_host).sum())
        if not dropped:
            return self, 0
        out = RawEvents(self.offset_ns)
        out.names, out.name_index, out.dev, out.dev_attrs = self.names, self.name_index, self.dev, self.dev_attrs
        out.py = {c: np.asarray(v, dtype=np.int64)[keep_py] for c, v in self.py.items()}
        out.host = {c: np.asarray(v, dtype=np.int64)[keep_host] for c, v in self.host.items()}
        new_row = np.cumsum(keep_host) - 1
        out.host_attrs = {int(new_row[r]): a for r, a in self.host_attrs.items() if keep_host[r]}
        return out, dropped

    def intern(self, name: str) -> int:
        i = self.name_index.get(name)
        if i is None:
            i = self.name_index[name] = len(self.names)
            self.names.append(name)
        return i

    def add(self, e: dict[str, Any]) -> None:
        """Append one event dict (see the module docstring). Raises KeyError/TypeError/AttributeError
        on a dict without the required keys."""
        at, name = e["type"], e["name"]
        if at == "python_function":
            if " at 0x" in name:
                name = ADDR_RE.sub("", name)
            py = self.py
            py["name"].append(self.intern(name))
            py["start_ns"].append(e["start_ns"])
            py["dur_ns"].append(e.get("dur_ns", 0))
            py["tid"].append(e.get("tid", -1))
            py["py_id"].append(e.get("py_id", -1))
            py["py_parent"].append(e.get("py_parent", -1))
            return
        cat = classify(at, name)
        device = e.get("device", -1)
        attrs, nbytes = attrs_and_bytes(cat, at, name, e.get("meta"), e.get("shapes"), e.get("dtypes"),
                                        int(e.get("bytes", 0) or 0))
        if device >= 0:
            g = self.dev
            if attrs is not None:
                self.dev_attrs[len(g["name"])] = attrs
            g["device"].append(device)
            g["stream"].append(e.get("stream", -1))
            g["linked"].append(e.get("linked", 0))
        else:
            g = self.host
            if attrs is not None:
                self.host_attrs[len(g["name"])] = attrs
            g["tid"].append(e.get("tid", -1))
        g["category"].append(cat)
        g["name"].append(self.intern(name))
        g["start_ns"].append(e["start_ns"])
        g["dur_ns"].append(e.get("dur_ns", 0))
        g["corr"].append(e.get("corr", 0))
        g["bytes"].append(nbytes)

    @classmethod
    def from_dicts(cls, events: Iterable[dict[str, Any]]) -> RawEvents:
        """Raises ValueError naming the first event that is not an event dict."""
        raw = cls()
        i = -1
        e: Any = None
        try:
            for i, e in enumerate(events):  # noqa: B007  (i names the bad event)
                raw.add(e)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"event {i} is not an event dict ({type(exc).__name__}: {exc}): {e!r:.120}") from None
        return raw


# --------------------------------------------------------------------------------------------
# Reading a stopped profiler
# --------------------------------------------------------------------------------------------

def experimental_config() -> Any:
    """The ``experimental_config`` to pass to ``torch.profiler.profile`` so that GPU metadata (stream,
    bytes, grid/block, NCCL collective sizes) reaches :func:`extract_raw`. None if unsupported."""
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


def kineto_result(prof: Any) -> Any:
    """The ``_ProfilerResult`` of a stopped torch.profiler.profile, a legacy
    torch.autograd.profiler.profile, or the result itself; None if there is none."""
    for obj in (getattr(getattr(prof, "profiler", None), "kineto_results", None),
                getattr(prof, "kineto_results", None), prof):
        if obj is not None and callable(getattr(obj, "events", None)) and callable(
                getattr(obj, "trace_start_ns", None)):
            return obj
    return None


def _parse_meta(e: Any) -> dict[str, Any] | None:
    """Kineto metadata of one event (see :func:`parse_meta`)."""
    try:
        s = e.metadata_json()
    except Exception:
        s = ""
    meta = parse_meta(s, None) if s else None
    if meta is not None:
        return meta
    try:
        extra = e.extra_meta()
    except Exception:
        return None
    return parse_meta("", extra)


def parse_meta(metadata_json: str, extra_meta: Any) -> dict[str, Any] | None:
    """Kineto metadata: ``metadata_json()`` is a JSON object body without braces; when it is empty or
    not an object, ``extra_meta()`` (a str -> str map, values JSON-decoded where they parse)."""
    if metadata_json:
        try:
            obj = json.loads("{" + metadata_json + "}")
            if isinstance(obj, dict):
                return obj
        except ValueError:
            pass
    if not extra_meta:
        return None
    out: dict[str, Any] = {}
    for k, v in dict(extra_meta).items():
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


def _results(prof: Any, clock_offset_ns: int | None) -> tuple[Any, int]:
    """(KinetoEvent list or None, clock offset); raises as documented on :func:`extract_raw`."""
    result = kineto_result(prof)
    if result is None:
        if not callable(getattr(prof, "events", None)):
            raise TypeError(f"extract_raw needs a stopped torch.profiler.profile, got {type(prof).__name__}")
        return None, 0
    try:
        raw = result.events()
        start = result.trace_start_ns()
    except Exception as exc:
        raise ValueError(f"profiler results unreadable ({type(exc).__name__}: {exc})") from None
    return raw, detect_clock_offset_ns(start) if clock_offset_ns is None else clock_offset_ns


def extract_raw(prof: Any, *, clock_offset_ns: int | None = None, trace_start_ns: int | None = None,
                native: Any = None) -> RawEvents:
    """The events of a stopped profiler as :class:`RawEvents`.

    Accepts a ``torch.profiler.profile`` after ``stop()`` (or inside ``on_trace_ready``), a legacy
    ``torch.autograd.profiler.profile``, or their ``kineto_results``. Timestamps are mapped to host
    wall-clock ns: ``clock_offset_ns`` if given, else :func:`detect_clock_offset_ns` on the trace
    start. Python frames carry ``py_id``/``py_parent`` (the call tree).

    Fallback: an object whose ``events()`` returns ``FunctionEvent``-like objects (``time_range`` in µs
    relative to the trace start) is accepted when ``trace_start_ns`` is given.

    ``native``: the C++ reader (:func:`rankscope.producers.native_extract.load_native`); when given, a Kineto
    result is read by it (same output, several times faster, without holding the GIL).

    Raises TypeError for objects that are not profilers, ValueError for a profiler with no results
    (not stopped yet, or ``trace_only=True``).
    """
    if native is not None:
        result = kineto_result(prof)
        if result is not None:
            from rankscope.producers.native_extract import extract_columns

            return extract_columns(native, result, clock_offset_ns=clock_offset_ns)
    events, offset = _results(prof, clock_offset_ns)
    if events is not None and len(events) and not hasattr(type(events[0]), "activity_type"):
        events, trace_start_ns, clock_offset_ns = None, legacy_start_ns(kineto_result(prof)), offset
    if events is None:
        try:
            fevents = prof.events()
        except Exception as exc:
            raise ValueError(f"profiler has no events ({type(exc).__name__}: {exc}); was it stopped?") from None
        if fevents is None:
            raise ValueError("profiler has no results; call stop() first (or use on_trace_ready)")
        if trace_start_ns is None:
            raise ValueError("FunctionEvent timestamps are relative to the trace start: pass trace_start_ns")
        return RawEvents.from_dicts(from_function_events(fevents, trace_start_ns + (clock_offset_ns or 0)))
    out = RawEvents(offset)
    if not len(events):
        return out
    from torch._C._autograd import DeviceType

    cpu_type = DeviceType.CPU
    ke = type(events[0])
    name_of, type_of, start_of, dur_of = ke.name, ke.activity_type, ke.start_ns, ke.duration_ns
    rid_of, corr_of, pyid_of, pyparent_of = ke.device_resource_id, ke.correlation_id, ke.python_id, ke.python_parent_id
    hidden = getattr(ke, "is_hidden_event", None)
    index, names = out.name_index, out.names
    py, host = out.py, out.host
    p_name, p_start, p_dur, p_tid, p_id, p_parent = (py[c].append for c in RawEvents.PY)
    h_cat, h_name, h_start, h_dur, h_tid, h_corr, h_bytes = (host[c].append for c in RawEvents.HOST)
    host_rows = host["name"]
    for e in events:
        name = name_of(e)
        at = type_of(e)
        if at == "python_function":
            if " at 0x" in name:
                name = ADDR_RE.sub("", name)
            i = index.get(name)
            if i is None:
                i = index[name] = len(names)
                names.append(name)
            p_name(i)
            p_start(start_of(e))
            p_dur(dur_of(e))
            p_tid(rid_of(e))
            p_id(pyid_of(e))
            p_parent(pyparent_of(e))
            continue
        if name in FILTERED_NAMES:
            continue
        if at == "cpu_op" and not is_collective_cpu(name):
            if hidden is not None and hidden(e):
                continue
            cat, nbytes = CPU_OP, 0
        elif at in HOST_TYPES:
            cat = classify(at, name)
            nbytes = 0
            if cat == COLLECTIVE:
                if at == "cpu_op" and hidden is not None and hidden(e):
                    continue
                shapes = e.shapes()
                attrs, nbytes = attrs_and_bytes(cat, at, name, _parse_meta(e), [list(s) for s in shapes] or None,
                                                list(e.dtypes()) if shapes else None, 0)
                out.host_attrs[len(host_rows)] = attrs
            elif cat == ANNOTATION and at not in ("user_annotation",):
                out.host_attrs[len(host_rows)] = {"type": at}
        elif at in DEVICE_TYPES or e.device_type() != cpu_type:
            _add_device(out, e, _activity_type(e, False) if at not in DEVICE_TYPES else at, name)
            continue
        else:
            at = _activity_type(e, True)
            cat = classify(at, name)
            attrs, nbytes = attrs_and_bytes(cat, at, name, _parse_meta(e) if cat == COLLECTIVE else None, None, None, 0)
            if attrs is not None:
                out.host_attrs[len(host_rows)] = attrs
        i = index.get(name)
        if i is None:
            i = index[name] = len(names)
            names.append(name)
        h_cat(cat)
        h_name(i)
        h_start(start_of(e))
        h_dur(dur_of(e))
        h_tid(rid_of(e))
        h_corr(corr_of(e))
        h_bytes(nbytes)
    return out


def _add_device(out: RawEvents, e: Any, at: str, name: str) -> None:
    """One device-side event (kernel, memcpy/memset, GPU annotation, ...)."""
    meta = _parse_meta(e)
    stream = e.device_resource_id()
    nbytes = 0
    if meta:
        if isinstance(meta.get("stream"), int):
            stream = meta["stream"]
        if isinstance(meta.get("bytes"), int):
            nbytes = meta["bytes"]
    cat = classify(at, name)
    attrs, nbytes = attrs_and_bytes(cat, at, name, meta, None, None, nbytes)
    g = out.dev
    if attrs is not None:
        out.dev_attrs[len(g["name"])] = attrs
    g["category"].append(cat)
    g["name"].append(out.intern(name))
    g["start_ns"].append(e.start_ns())
    g["dur_ns"].append(e.duration_ns())
    g["device"].append(e.device_index())
    g["stream"].append(stream)
    g["corr"].append(e.correlation_id())
    g["linked"].append(e.linked_correlation_id())
    g["bytes"].append(nbytes)
