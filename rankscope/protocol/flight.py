"""What a rank sends on a hang or on request: its recent steps (``flight``) and PyTorch's Flight
Recorder dump (``fr_dump``, v2).

Bodies::

    flight:  {"steps": [[int, ...], ...] (Int64 values), "stacks": [{"thread": str, "frames": [str, ...]}, ...] | nil,
              "reason": str}
    fr_dump: {"request_id": str, "reason": str, "dump": str, "truncated": bool}

An ``fr_dump``'s ``dump`` is the recorder's JSON form: an object with an ``entries`` list
(:func:`dump_of` parses it; decode leaves it a string).
"""

from __future__ import annotations

import json
from typing import Any

from rankscope.protocol.errors import bad_body
from rankscope.protocol.fields import field, int_list, list_or_none


def check_flight(body: dict[str, Any]) -> None:
    """Check a ``flight`` body."""
    for row in field("flight", body, "steps", list):
        int_list(row, "flight.steps[]")
    list_or_none("flight", body, "stacks")
    field("flight", body, "reason", str)


def check_fr_dump(body: dict[str, Any]) -> None:
    """Check an ``fr_dump`` body."""
    for name in ("request_id", "reason", "dump"):
        field("fr_dump", body, name, str)
    field("fr_dump", body, "truncated", bool)


def dump_of(body: dict[str, Any]) -> dict[str, Any]:
    """The parsed ``dump`` of a decoded ``fr_dump`` body: an object with an ``entries`` list."""
    try:
        dump = json.loads(body["dump"])
    except ValueError as e:
        raise bad_body(f"fr_dump.dump is not JSON: {e}") from None
    if type(dump) is not dict or type(dump.get("entries")) is not list:
        raise bad_body("fr_dump.dump has no entries list")
    return dump
