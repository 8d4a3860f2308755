"""What a rank sends on a hang or on request: its recent steps (``flight``) and PyTorch's Flight
Recorder dump (``fr_dump``, v2).

Bodies::

    flight:  {"steps": [...], "stacks": [{"thread": str, "frames": [str, ...]}, ...] | nil, "reason": str}
    fr_dump: {"request_id": str, "reason": str, "dump": str (the recorder's JSON form), "truncated": bool}
"""

from __future__ import annotations

from typing import Any

from rankscope.protocol.fields import field, list_or_none


def check_flight(body: dict[str, Any]) -> None:
    """Check a ``flight`` body."""
    field("flight", body, "steps", list)
    list_or_none("flight", body, "stacks")
    field("flight", body, "reason", str)


def check_fr_dump(body: dict[str, Any]) -> None:
    """Check an ``fr_dump`` body."""
    for name in ("request_id", "reason", "dump"):
        field("fr_dump", body, name, str)
    field("fr_dump", body, "truncated", bool)
