"""Event categories of a trace window and how a profiler event is put in one (the names, the
collective rules and element sizes are rankscope/taxonomy.py's, shared with the offline reader).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from rankscope.taxonomy import CATEGORIES, RUNTIME_TYPES, dtype_bytes, is_collective_name, is_comm_kernel

CAT = {c: i for i, c in enumerate(CATEGORIES)}
KERNEL, MEMCPY, MEMSET, RUNTIME, CPU_OP, COLLECTIVE, PYTHON, ANNOTATION = range(len(CATEGORIES))
# Device-side categories that count as useful GPU work for exclusive time.
GPU_WORK = (KERNEL, MEMCPY, MEMSET, COLLECTIVE)

_NCCL_KERNEL_RE = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")
_COLLECTIVE_META = {"Collective name": "op", "Process Group Name": "pg", "Process Group Description": "pg_desc",
                    "Group size": "group_size", "dtype": "dtype", "In msg nelems": "in_nelems",
                    "Out msg nelems": "out_nelems", "Seq": "seq", "Rank": "peer_rank"}


def is_collective_cpu(name: str) -> bool:
    return is_collective_name(name)


def classify(activity_type: str, name: str) -> int:
    """Category code of one event from its Kineto activity type and name."""
    at = activity_type
    if at == "cpu_op":
        return COLLECTIVE if is_collective_cpu(name) else CPU_OP
    if at == "python_function":
        return PYTHON
    if at == "user_annotation":
        return COLLECTIVE if is_collective_name(name) else ANNOTATION
    if at == "kernel":
        return COLLECTIVE if is_comm_kernel(name) else KERNEL
    if at == "gpu_memcpy":
        return MEMCPY
    if at == "gpu_memset":
        return MEMSET
    if at in RUNTIME_TYPES:
        return RUNTIME
    # gpu_user_annotation, cpu_instant_event, overhead, cuda_sync, ...: markers, not work.
    return ANNOTATION


def attrs_and_bytes(category: int, activity_type: str, name: str, meta: dict[str, Any] | None,
                    shapes: Sequence[Sequence[int]] | None, dtypes: Sequence[str] | None,
                    nbytes: int) -> tuple[dict[str, Any] | None, int]:
    """(attrs, bytes) of one event of ``category``: collectives get op/pg/group_size/dtype/in_nelems/...
    and their message size, memcpy its kind, kernels grid/block when exposed, odd annotation types
    their type."""
    meta = meta or {}
    if category == COLLECTIVE:
        return _collective_attrs(name, meta, shapes, dtypes), nbytes or _collective_bytes(meta, shapes, dtypes)
    if category == KERNEL:
        attrs: dict[str, Any] = {k: meta[k] for k in ("grid", "block") if k in meta}
        return attrs or None, nbytes
    if category == MEMCPY:
        kind = name[len("Memcpy "):].split(" ", 1)[0] if name.startswith("Memcpy ") else name
        return {"kind": kind}, nbytes
    if category in (MEMSET, CPU_OP):
        return None, nbytes
    if category == ANNOTATION and activity_type not in ("user_annotation", "gpu_user_annotation"):
        return {"type": activity_type}, nbytes
    if category == ANNOTATION and activity_type == "gpu_user_annotation":
        return None, nbytes
    return None, 0


def _op_name(raw: str) -> str:
    """Collective op names normalised across backends: all_reduce / allreduce_ / AllReduce -> allreduce."""
    return raw.replace("_", "").lower()


def _nelems(shapes: Sequence[Sequence[int]] | None) -> int:
    total = 0
    for s in shapes or ():
        if s:
            k = 1
            for d in s:
                k *= int(d)
            total += k
    return total


def _collective_attrs(name: str, meta: dict[str, Any], shapes: Sequence[Sequence[int]] | None,
                      dtypes: Sequence[str] | None) -> dict[str, Any]:
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
    if "in_nelems" not in attrs and shapes:
        n = _nelems(shapes)
        if n:
            attrs["in_nelems"] = n
    if "dtype" not in attrs and dtypes:
        dt = [d for d in dtypes if d]
        if dt:
            attrs["dtype"] = dt[0]
    return attrs


def _collective_bytes(meta: dict[str, Any], shapes: Sequence[Sequence[int]] | None,
                      dtypes: Sequence[str] | None) -> int:
    n = meta.get("In msg nelems")
    dtype = meta.get("dtype")
    if not isinstance(n, int) and shapes:
        n = _nelems(shapes)
        dtype = next((d for d in (dtypes or []) if d), dtype)
    size = dtype_bytes(dtype) if dtype else None
    return int(n) * size if isinstance(n, int) and size else 0
