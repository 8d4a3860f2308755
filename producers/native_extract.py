"""The C++ reader of stopped profilers (``producers/native/kineto_columns.cpp``), built once per
machine and torch version, and the vectorised categorisation on top of it.

Why: reading a window from Python costs one pybind call per accessor per event (~0.15-0.3 µs
each, ~2 µs per event, all of it holding the GIL while the training thread wants it). The C++
reader walks ``ProfilerResult::events()`` with the GIL released and returns packed columns; Python
then categorises once per distinct (activity type, name, host/device), not per event, and asks C++
for metadata, shapes and dtypes only of the rows that need them (collectives, device events).
:func:`extract_columns` returns exactly what :func:`rankscope.producers.trace_extract.extract_raw` returns
(the same rows, names in the same order, the same attrs), with numpy arrays for the column lists.

Building (``rankscope build-native``; ``make native`` runs it before test, demo and bench) compiles with
``torch.utils.cpp_extension`` (a C++17 compiler and ninja; ~1 min) into
``<cache_dir>/native/<key>/``, the key a hash of the source, torch and Python versions. A training
process never compiles: :func:`load_native` imports a built module or returns None and the tracer
logs one line and uses the Python reader.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import sys
from pathlib import Path
from typing import Any

from rankscope.producers.categories import (
    ANNOTATION,
    COLLECTIVE,
    CPU_OP,
    attrs_and_bytes,
    classify,
    is_collective_cpu,
)
from rankscope.producers.trace_extract import (
    ADDR_RE,
    DEVICE_TYPES,
    FILTERED_NAMES,
    HOST_TYPES,
    RawEvents,
    detect_clock_offset_ns,
    extract_raw,
    kineto_result,
    parse_meta,
)

log = logging.getLogger("rankscope.native")

SOURCE = Path(__file__).with_name("native") / "kineto_columns.cpp"
SOURCES = (SOURCE, SOURCE.with_name("window_math.h"))   # everything the build key covers
ABI = 3                      # bumped with the C++ module's ABI attribute when its outputs change

_DROP, _PY, _HOST, _DEV = 0, 1, 2, 3
_NONE, _COLL_HOST, _COLL_OTHER, _DEVICE = 0, 1, 2, 3     # which details a row needs


class NativeBuildError(RuntimeError):
    pass


def build_key() -> str:
    import torch

    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.read_bytes())
    h.update(f"{torch.__version__}|{sys.version}|{platform.machine()}|{ABI}".encode())
    return h.hexdigest()[:12]


def module_name(key: str) -> str:
    return f"rankscope_kineto_{key}"


def build_dir(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir).expanduser() / "native" / key


def build(cache_dir: str | Path, *, verbose: bool = False) -> Path:
    """Compile the reader into ``<cache_dir>/native/<key>/`` (a no-op when built); returns the module
    file. Raises NativeBuildError with the compiler's complaint."""
    from torch.utils.cpp_extension import load

    key = build_key()
    d = build_dir(cache_dir, key)
    so = d / f"{module_name(key)}.so"
    if so.exists():
        return so
    d.mkdir(parents=True, exist_ok=True)
    try:
        load(module_name(key), [str(SOURCE)], build_directory=str(d), extra_cflags=["-O2"],
             extra_include_paths=[str(SOURCE.parent)], verbose=verbose)
    except Exception as e:   # compiler missing, headers missing, ninja missing, ...
        raise NativeBuildError(f"building {SOURCE.name} failed: {type(e).__name__}: {str(e)[-2000:]}") from None
    if not so.exists():
        raise NativeBuildError(f"build finished but {so} is missing")
    return so


def load_native(cache_dir: str | Path) -> Any | None:
    """The built reader for this torch and Python, or None (not built, or it does not load)."""
    try:
        key = build_key()
    except Exception:
        return None
    so = build_dir(cache_dir, key) / f"{module_name(key)}.so"
    if not so.exists():
        return None
    try:
        import torch  # noqa: F401  (the module links against torch's libraries)

        from rankscope.producers.native_load import load_module

        return load_module(module_name(key), so, ABI)
    except Exception as e:
        log.warning("rankscope: native trace reader %s does not load (%s); using the Python reader", so, e)
        return None


def extract_columns(native: Any, result: Any, *, clock_offset_ns: int | None = None) -> RawEvents:
    """The events of a ``_ProfilerResult`` (``prof.profiler.kineto_results``) as :class:`RawEvents`,
    read by the C++ module ``native``. Raises TypeError when ``result`` is not a profiler result."""
    import numpy as np

    try:
        c = native.read_columns(result)
    except (TypeError, RuntimeError) as e:   # pybind's cast error
        raise TypeError(f"not a torch profiler result: {type(result).__name__} ({e})") from None
    n = int(c["n"])
    out = RawEvents(detect_clock_offset_ns(int(c["trace_start_ns"])) if clock_offset_ns is None else clock_offset_ns)
    if not n:
        return out

    def col(key: str, dtype: Any) -> np.ndarray:
        return np.frombuffer(c[key], dtype=dtype)

    raw_names: list[str] = c["names"]
    type_names: list[str] = c["type_names"]
    k_names = len(raw_names)
    on_device = col("device_type", np.int8) != 0
    key = (col("type", np.uint8).astype(np.int64) * k_names + col("name", np.int32)) * 2 + on_device
    ukeys, inv = np.unique(key, return_inverse=True)
    inv = inv.reshape(-1)

    # One decision per distinct (type, name, side), mirroring extract_raw's per-event branches.
    m = len(ukeys)
    group = np.zeros(m, dtype=np.int8)
    cat = np.zeros(m, dtype=np.int64)
    drop_hidden = np.zeros(m, dtype=bool)
    detail = np.zeros(m, dtype=np.int8)
    final_name: list[str] = []
    kind: list[str] = []                       # activity type name per distinct key
    const_attrs: dict[int, dict[str, Any]] = {}
    for u, k in enumerate(ukeys.tolist()):
        dev = k & 1
        code, ni = divmod(k >> 1, k_names)
        at = type_names[code] if code < len(type_names) and type_names[code] else f"activity_{code}"
        name = raw_names[ni]
        kind.append(at)
        final_name.append(name)
        if at == "python_function":
            group[u] = _PY
            if " at 0x" in name:
                final_name[u] = ADDR_RE.sub("", name)
        elif name in FILTERED_NAMES:
            group[u] = _DROP
        elif at == "cpu_op" and not is_collective_cpu(name):
            group[u], cat[u], drop_hidden[u] = _HOST, CPU_OP, True
        elif at in HOST_TYPES:
            group[u] = _HOST
            cat[u] = c_ = classify(at, name)
            if c_ == COLLECTIVE:
                drop_hidden[u] = at == "cpu_op"
                detail[u] = _COLL_HOST
            elif c_ == ANNOTATION and at != "user_annotation":
                const_attrs[u] = {"type": at}
        elif at in DEVICE_TYPES or dev:
            group[u], cat[u], detail[u] = _DEV, classify(at, name), _DEVICE
        else:
            group[u] = _HOST
            cat[u] = c_ = classify(at, name)
            if c_ == COLLECTIVE:
                detail[u] = _COLL_OTHER
            else:
                attrs, _ = attrs_and_bytes(c_, at, name, None, None, None, 0)
                if attrs is not None:
                    const_attrs[u] = attrs

    g = group[inv]
    keep = g != _DROP
    hidden = (col("flags", np.uint8) & 1).astype(bool)
    keep &= ~(drop_hidden[inv] & hidden)

    # Names interned in order of first appearance among kept events, as extract_raw interns them.
    kept = np.flatnonzero(keep)
    first_u, first_at = np.unique(inv[kept], return_index=True)
    name_id = np.full(m, -1, dtype=np.int64)
    for u in first_u[np.argsort(first_at, kind="stable")].tolist():
        name_id[u] = out.intern(final_name[u])

    start, dur = col("start_ns", np.int64), col("dur_ns", np.int64)
    resource, corr = col("resource", np.int64), col("corr", np.int64)
    py_rows = kept[g[kept] == _PY]
    host_rows = kept[g[kept] == _HOST]
    dev_rows = kept[g[kept] == _DEV]

    u = inv[py_rows]
    out.py.update(name=name_id[u], start_ns=start[py_rows], dur_ns=dur[py_rows], tid=resource[py_rows],
                  py_id=col("py_id", np.int64)[py_rows], py_parent=col("py_parent", np.int64)[py_rows])
    u = inv[host_rows]
    host_bytes = np.zeros(len(host_rows), dtype=np.int64)
    out.host.update(category=cat[u], name=name_id[u], start_ns=start[host_rows], dur_ns=dur[host_rows],
                    tid=resource[host_rows], corr=corr[host_rows], bytes=host_bytes)
    u = inv[dev_rows]
    dev_bytes = np.zeros(len(dev_rows), dtype=np.int64)
    stream = resource[dev_rows].copy()
    out.dev.update(category=cat[u], name=name_id[u], start_ns=start[dev_rows], dur_ns=dur[dev_rows],
                   device=col("device_index", np.int32)[dev_rows].astype(np.int64), stream=stream,
                   corr=corr[dev_rows], linked=col("linked", np.int64)[dev_rows], bytes=dev_bytes)

    # Attrs: constant ones per distinct key, and the rows whose metadata C++ has to read.
    if const_attrs:
        for pos in np.flatnonzero(np.isin(inv[host_rows], list(const_attrs))).tolist():
            out.host_attrs[pos] = dict(const_attrs[int(inv[host_rows[pos]])])
    need_host = np.flatnonzero(detail[inv[host_rows]] != _NONE)
    need_dev = np.arange(len(dev_rows))
    rows = np.concatenate([host_rows[need_host], dev_rows]).tolist()
    if not rows:
        return out
    found = native.details(result, rows)
    for pos, (meta_json, extra, shapes, dtypes) in zip(need_host.tolist(), found[:len(need_host)], strict=True):
        uu = int(inv[host_rows[pos]])
        at, name, c_ = kind[uu], final_name[uu], int(cat[uu])
        meta = parse_meta(meta_json, extra)
        if detail[uu] == _COLL_HOST:
            attrs, nb = attrs_and_bytes(c_, at, name, meta, shapes or None, dtypes if shapes else None, 0)
            out.host_attrs[pos] = attrs         # None too, as extract_raw does
        else:
            attrs, nb = attrs_and_bytes(c_, at, name, meta, None, None, 0)
            if attrs is not None:
                out.host_attrs[pos] = attrs
        host_bytes[pos] = nb
    for pos, (meta_json, extra, _, _) in zip(need_dev.tolist(), found[len(need_host):], strict=True):
        uu = int(inv[dev_rows[pos]])
        meta = parse_meta(meta_json, extra)
        nb = 0
        if meta:
            if isinstance(meta.get("stream"), int):
                stream[pos] = meta["stream"]
            if isinstance(meta.get("bytes"), int):
                nb = meta["bytes"]
        attrs, nb = attrs_and_bytes(int(cat[uu]), kind[uu], final_name[uu], meta, None, None, nb)
        if attrs is not None:
            out.dev_attrs[pos] = attrs
        dev_bytes[pos] = nb
    return out


class WindowReader:
    """``reader(prof) -> RawEvents`` for the tracer's sender thread: the C++ reader when enabled and
    built (loaded at the first window, not at start-up), else the Python one, with one log line
    saying which."""

    def __init__(self, cache_dir: str | Path, enabled: bool = True) -> None:
        self._cache_dir, self._enabled = cache_dir, enabled
        self._native: Any = None
        self._loaded = False

    @property
    def native(self) -> Any:
        if not self._loaded:
            self._loaded = True
            if self._enabled:
                self._native = load_native(self._cache_dir)
                if self._native is None:
                    log.info("rankscope: C++ trace reader not built for this torch (run `rankscope build-native`); "
                             "reading trace windows in Python (~3.5x the reading cost)")
        return self._native

    def __call__(self, prof: Any) -> RawEvents:
        """Read a window's profiler; with the C++ reader its events are then freed off the GIL (the
        profiler is spent: only for profilers the tracer created)."""
        native = self.native
        if native is not None:
            try:
                raw = extract_raw(prof, native=native)
            except Exception as e:      # a reader bug must not cost windows: Python from now on
                log.warning("rankscope: C++ trace reader failed (%s: %s); reading trace windows in Python",
                            type(e).__name__, e)
                self._native = native = None
        if native is None:
            raw = extract_raw(prof)
        result = kineto_result(prof) if native is not None else None
        if result is not None:
            native.release_events(result)
        holder = getattr(prof, "profiler", None)
        if getattr(holder, "kineto_results", None) is not None:
            # Free what is left of the results now, on this thread, rather than whenever the garbage
            # collector reaches the profiler's reference cycles (possibly on the training thread).
            holder.kineto_results = None  # type: ignore[union-attr]
        return raw
