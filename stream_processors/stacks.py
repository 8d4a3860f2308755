"""Reading the Python stacks that heartbeats carry: the main thread, waiting in a collective, a signature."""

from __future__ import annotations

import zlib
from typing import Any

COLLECTIVE_MARKERS = ("torch/distributed/", "_rankscope_timed_collective", "_rankscope_timed_wait",
                      " all_reduce", " barrier", " all_gather", " broadcast", " reduce_scatter",
                      " all_to_all")


def main_stack(stacks: list[dict[str, Any]] | None) -> list[str]:
    """The main thread's frames (outermost first) of a heartbeat's stacks; [] when none."""
    if not stacks:
        return []
    for s in stacks:
        if s.get("thread") == "MainThread":
            return list(s.get("frames", []))
    return list(stacks[0].get("frames", []))


def waiting_in_collective(frames: list[str]) -> bool:
    """True when the innermost frames show a torch.distributed call (the rank waits for others)."""
    return any(any(m in f for m in COLLECTIVE_MARKERS) for f in frames[-6:])


def signature(frames: list[str]) -> str:
    """A stable short id of a stack (the same in every process): identical stacks share it."""
    return f"{zlib.crc32(chr(10).join(frames).encode()):08x}"
