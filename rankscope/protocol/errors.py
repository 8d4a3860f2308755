"""The error every check of the wire raises."""

from __future__ import annotations


class WireError(ValueError):
    """A message could not be decoded or failed validation. ``reason`` is a short code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def bad_body(detail: str) -> WireError:
    """The error of a body that does not match its kind: reason ``bad_body``, ``detail`` naming the field."""
    return WireError("bad_body", detail)
