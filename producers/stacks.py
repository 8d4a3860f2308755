"""Compact Python stacks of every thread (the rank-local watchdog's evidence), user code only.

rankscope's own frames (the packages producers, rankscope, stream_processors, storage and
dashboard, except the example job rankscope/demo) are left out: a wrapper that stands for a
torch.distributed call (``_rankscope_timed_collective``, ``_rankscope_timed_wait``) becomes a
neutral ``torch.distributed <op>`` frame when torch's own frame does not follow it (``Work.wait``
has none: it is C++), so readers still see that the rank waits in a collective; every other own
frame is dropped. Threads that run only rankscope's code (its heartbeat, Kafka and sampler
threads) are left out too.
"""

from __future__ import annotations

import sys
import sysconfig
import threading
from typing import Any

from rankscope.own_frames import package_dirs

MAX_FRAMES = 48
#: Frames walked per thread before the user's innermost MAX_FRAMES are kept.
MAX_WALK = 4 * MAX_FRAMES
NEUTRAL_PREFIX = "torch.distributed "  # the same as stream_processors/stacks.py's
OWN_DIRS = tuple(str(d) + "/" for d in package_dirs().values())
USER_DIRS = (str(package_dirs()["rankscope"] / "demo") + "/",)   # the example job is the user's code
_STDLIB = tuple({sysconfig.get_paths()["stdlib"] + "/", sysconfig.get_paths()["platstdlib"] + "/"})


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


def is_own(filename: str) -> bool:
    """True for a file of rankscope's own code (not the example job)."""
    return filename.startswith(OWN_DIRS) and not filename.startswith(USER_DIRS)


def stands_for(frame: Any) -> str | None:
    """The torch.distributed call a rankscope wrapper frame stands for, or None for other own frames."""
    name = frame.f_code.co_name
    if name == "_rankscope_timed_wait":
        return "Work.wait"
    if name == "_rankscope_timed_collective":
        return "collective"   # torch's own frame of the call follows it in practice, and shows the name
    return None


def user_stack(frame: Any) -> tuple[list[str], bool]:
    """(labels outermost first, whether the thread is rankscope's own) of one thread's stack.

    A thread is rankscope's own when it runs rankscope's code and nothing but the stdlib besides.
    """
    raw: list[Any] = []
    f: Any = frame
    while f is not None and len(raw) < MAX_WALK:
        raw.append(f)
        f = f.f_back
    raw.reverse()
    out: list[str] = []
    user = own = False
    for i, f in enumerate(raw):
        filename = f.f_code.co_filename
        if not is_own(filename):
            out.append(frame_label(filename, f.f_lineno, f.f_code.co_name))
            user = user or not filename.startswith(_STDLIB)
            continue
        own = True
        op = stands_for(f)
        inner = raw[i + 1].f_code.co_filename if i + 1 < len(raw) else ""
        if op is not None and "torch/distributed/" not in inner:
            out.append(NEUTRAL_PREFIX + op)
    return out[-MAX_FRAMES:], own and not user


def all_thread_stacks(skip_thread_ids: set[int] | None = None) -> list[dict[str, Any]]:
    """Stacks of the user's Python threads, outermost frame first, at most MAX_FRAMES innermost frames."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for tid, frame in sys._current_frames().items():
        if skip_thread_ids and tid in skip_thread_ids:
            continue
        frames, ours = user_stack(frame)
        if ours and tid != main:
            continue   # a thread of rankscope's own
        out.append({"thread": names.get(tid, f"thread-{tid}"), "frames": frames})
    out.sort(key=lambda s: (s["thread"] != "MainThread", s["thread"]))
    return out
