"""The event taxonomy of a PyTorch profiler trace, shared by the ranks' trace windows
(producers/categories.py) and the offline reader (offline/kineto_table.py):
category names, which host events are collectives, the runtime activity types and element sizes.

Category names and wire codes (``trace_events.category``; code = index in :data:`CATEGORIES`):
kernel, memcpy, memset, runtime (cuda/hip/xpu runtime and driver calls), cpu_op, collective,
python (python_function), annotation. The offline reader adds ``other`` for activity types it
does not know.

Where the two readers differ, on purpose: a GPU communication kernel (``nccl*``) is ``collective``
on the ranks, whose reports put communication in its own section, and ``kernel`` offline, as HTA
counts it (its kernel type tells communication apart there).
"""

from __future__ import annotations

import re

CATEGORIES: tuple[str, ...] = ("kernel", "memcpy", "memset", "runtime", "cpu_op", "collective", "python",
                               "annotation")
GPU_WORK: tuple[str, ...] = ("kernel", "memcpy", "memset")     # device work besides communication

RUNTIME_TYPES = frozenset({"cuda_runtime", "cuda_driver", "privateuse1_runtime", "privateuse1_driver",
                           "mtia_runtime", "xpu_runtime", "hip_runtime", "hip_driver"})

# Host events that are collectives: c10d and functional-collective ops, ProcessGroup methods,
# record_param_comms, and backend annotations such as ``nccl:all_reduce`` or ``gloo:broadcast``.
COLLECTIVE_NAME_RE = re.compile(
    r"^(record_param_comms$|c10d::|c10d_functional::|_c10d_functional::|ProcessGroup\w*::|"
    r"(nccl|rccl|gloo|mpi|ucc|xccl|hccl):)"
)


def is_collective_name(name: str) -> bool:
    """Is a host event (cpu_op or user annotation) of this name a collective?"""
    return COLLECTIVE_NAME_RE.match(name) is not None


def is_comm_kernel(name: str) -> bool:
    """Is a GPU kernel of this name a collective library's (NCCL, RCCL: both name theirs ``nccl*``)?"""
    return name.startswith("nccl")


DTYPE_BYTES = {"float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8, "float64": 8,
               "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "byte": 1, "uint8": 1,
               "char": 1, "int8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complexfloat": 8,
               "complexdouble": 16}


def dtype_bytes(dtype: object) -> int | None:
    """Bytes per element of a profiler dtype name (``float``, ``c10::BFloat16``, ``torch.int64``); None
    when unknown."""
    name = str(dtype).lower()
    for prefix in ("c10::", "torch."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return DTYPE_BYTES.get(name)
