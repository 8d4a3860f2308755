"""Commands to the ranks (``control``) and the ranks' answers (``ack``).

Bodies::

    control: {"command": str, "request_id": str, "ranks": [int, ...] | nil (nil: every rank), "args": {...}}
    ack:     {"request_id": str, "status": str, "detail": str}

The ``trace`` command's arguments are declared in rankscope/protocol/trace.py.
"""

from __future__ import annotations

from typing import Any

from rankscope.protocol.fields import field, list_or_none


def check_control(body: dict[str, Any]) -> None:
    """Check a ``control`` body."""
    field("control", body, "command", str)
    field("control", body, "request_id", str)
    list_or_none("control", body, "ranks")
    field("control", body, "args", dict)


def check_ack(body: dict[str, Any]) -> None:
    """Check an ``ack`` body."""
    for name in ("request_id", "status", "detail"):
        field("ack", body, name, str)
