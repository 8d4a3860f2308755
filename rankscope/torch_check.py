"""The training image's own torch, checked once at run time.

rankscope does not declare torch: a dependency would let pip replace the image's build (NGC and
vendor images pin theirs). The rank side uses whatever ``import torch`` gives and says once, in
the log, when that version is outside the range the suite runs against. Nothing here raises: a
Tracer must never fail the training script.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

log = logging.getLogger(__name__)

# The torch releases the suite runs against: [first, last] by (major, minor).
TESTED_FIRST = (2, 13)
TESTED_LAST = (2, 15)

_CHECKED: dict[str, str | None] = {}
_LOCK = threading.Lock()


def parse_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string such as ``2.15.0+cu130`` or ``2.16.0a0``; None if unreadable."""
    m = re.match(r"\s*(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def version_problem(version: str) -> str | None:
    """A one-line message when ``version`` is outside the tested range or unreadable, else None."""
    parsed = parse_version(version)
    tested = f"{TESTED_FIRST[0]}.{TESTED_FIRST[1]} to {TESTED_LAST[0]}.{TESTED_LAST[1]}"
    if parsed is None:
        return f"rankscope: cannot read the torch version {version!r}; rankscope is tested with torch {tested}"
    if parsed < TESTED_FIRST:
        return (f"rankscope: torch {version} is older than the tested range ({tested}): collective timing and "
                f"trace windows may be incomplete; step records and heartbeats are unaffected")
    if parsed > TESTED_LAST:
        return (f"rankscope: torch {version} is newer than the tested range ({tested}): if trace windows or "
                f"collective timing misbehave, report it with this version")
    return None


def check_torch(torch: Any = None) -> str | None:
    """Check the imported torch once per process; log a warning when its version is outside the tested
    range. Returns the version string, or None when torch cannot be imported. Never raises."""
    with _LOCK:
        if "version" in _CHECKED:
            return _CHECKED["version"]
        version: str | None = None
        try:
            if torch is None:
                import torch
            version = str(getattr(torch, "__version__", ""))
        except Exception as e:
            log.info("rankscope: torch is not importable (%s): steps and heartbeats only", type(e).__name__)
        _CHECKED["version"] = version
    if version is not None:
        problem = version_problem(version)
        if problem:
            log.warning("%s", problem)
    return version
