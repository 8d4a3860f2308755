"""Compact Python stacks of every thread (the rank-local watchdog's evidence)."""

from __future__ import annotations

import sys
import threading
from typing import Any

MAX_FRAMES = 48


def frame_label(filename: str, lineno: int, func: str) -> str:
    short = filename
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            short = filename.split(marker, 1)[1]
            break
    else:
        parts = filename.rsplit("/", 2)
        short = "/".join(parts[-2:]) if len(parts) >= 2 else filename
    return f"{short}:{lineno} {func}"


def all_thread_stacks(skip_thread_ids: set[int] | None = None) -> list[dict[str, Any]]:
    """Stacks of all Python threads, outermost frame first, at most MAX_FRAMES innermost frames."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for tid, frame in sys._current_frames().items():
        if skip_thread_ids and tid in skip_thread_ids:
            continue
        frames = []
        f: Any = frame
        while f is not None and len(frames) < MAX_FRAMES:
            frames.append(frame_label(f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
            f = f.f_back
        frames.reverse()
        out.append({"thread": names.get(tid, f"thread-{tid}"), "frames": frames})
    out.sort(key=lambda s: (s["thread"] != "MainThread", s["thread"]))
    return out
