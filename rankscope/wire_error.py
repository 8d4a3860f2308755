"""The error every decoder of the wire raises (rankscope/wire.py re-exports it): its own module, so
that the validators wire.py calls (rankscope/protocol/collectives.py) raise it without importing
wire.py back."""

from __future__ import annotations


class WireError(ValueError):
    """A message could not be decoded or failed validation. ``reason`` is a short code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
