"""Reading the Python stacks that heartbeats carry: the main thread, waiting in a collective, a signature.

Stacks show the user's code only. Producers drop rankscope's own frames before sending
(producers/stacks.py) and put a neutral ``torch.distributed <op>`` frame where a rankscope wrapper
stood in for a torch.distributed call; :func:`user_frames` does the same for stacks that still
carry wrapper frames, so alerts, stack groups and signatures never show them. The neutral frame
keeps what the wrapper told: the rank waits in a collective.
"""

from __future__ import annotations

import zlib
from typing import Any

#: Frame label of a torch.distributed call whose own Python frame is missing (a wrapper stood for it).
NEUTRAL_PREFIX = "torch.distributed "
COLLECTIVE_MARKERS = ("torch/distributed/", NEUTRAL_PREFIX, "_rankscope_timed_collective", "_rankscope_timed_wait",
                      " all_reduce", " barrier", " all_gather", " broadcast", " reduce_scatter",
                      " all_to_all")
#: rankscope wrapper function -> the torch.distributed call it stands for
STANDS_FOR = {"_rankscope_timed_wait": "Work.wait", "_rankscope_timed_collective": "collective"}
OWN_FUNCTION_PREFIX = "_rankscope_"


def main_stack(stacks: list[dict[str, Any]] | None) -> list[str]:
    """The main thread's user frames (outermost first) of a heartbeat's stacks; [] when none."""
    if not stacks:
        return []
    for s in stacks:
        if s.get("thread") == "MainThread":
            return user_frames(list(s.get("frames", [])))
    return user_frames(list(stacks[0].get("frames", [])))


def user_frames(frames: list[str]) -> list[str]:
    """``frames`` without rankscope's wrapper frames (``<file>:<line> _rankscope_*``).

    A wrapper that stood for a torch.distributed call becomes ``torch.distributed <op>`` unless the
    next inner frame is torch.distributed's own; other ``_rankscope_*`` frames are dropped.
    """
    out: list[str] = []
    for i, f in enumerate(frames):
        func = f.rsplit(" ", 1)[-1]
        if not func.startswith(OWN_FUNCTION_PREFIX):
            out.append(f)
            continue
        inner = frames[i + 1] if i + 1 < len(frames) else ""
        if func in STANDS_FOR and "torch/distributed/" not in inner and not inner.startswith(NEUTRAL_PREFIX):
            out.append(NEUTRAL_PREFIX + STANDS_FOR[func])
    return out


def waiting_in_collective(frames: list[str]) -> bool:
    """True when the innermost frames show a torch.distributed call (the rank waits for others)."""
    return any(any(m in f for m in COLLECTIVE_MARKERS) for f in frames[-6:])


def signature(frames: list[str]) -> str:
    """A stable short id of a stack (the same in every process): identical stacks share it."""
    return f"{zlib.crc32(chr(10).join(frames).encode()):08x}"
