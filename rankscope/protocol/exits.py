"""``exit``: a rank's process ending, sent once by its atexit hook, signal handler or exception hook.

Body::

    {"step": int, "reason": "completed" | "exception" | "signal" | "atexit", "detail": str,
     "exc_type": str,            # optional, "exception" exits
     "frames": [str, ...]}       # optional: the traceback, "file:line func", outermost first
"""

from __future__ import annotations

from typing import Any

from rankscope.protocol.errors import bad_body
from rankscope.protocol.fields import field

EXIT_REASONS = frozenset({"completed", "exception", "signal", "atexit"})


def check_exit(body: dict[str, Any]) -> None:
    """Check an ``exit`` body."""
    field("exit", body, "step", int)
    reason = field("exit", body, "reason", str)
    field("exit", body, "detail", str)
    if reason not in EXIT_REASONS:
        raise bad_body(f"exit.reason {reason!r} not in {sorted(EXIT_REASONS)}")
    if type(body.get("exc_type", "")) is not str:
        raise bad_body("exit.exc_type is not a string")
    frames = body.get("frames", [])
    if not (type(frames) is list and all(type(f) is str for f in frames)):
        raise bad_body("exit.frames must be a list of strings")
