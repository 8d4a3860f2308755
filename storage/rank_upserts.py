"""Which rows of the ``ranks`` table a batch writes: the sink's throttle of rank progress.

A 10,000-rank job moves every rank's last step and last seen every second, so writing every rank a
batch touched would cost 10,000 rows whatever the batch's size. A rank whose identity changed (host,
process, world size, local rank, exit: the batch's ``urgent_ranks``) is written with the batch that
saw it; a rank that only progressed is deferred and written at most every ``every_s`` seconds, or
when the sink closes or loses its partitions (``everything``). Pure: time comes in as ``now``.
"""

from __future__ import annotations

from collections.abc import Set

RankKey = tuple[str, int]


class RankUpserts:
    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.deferred: set[RankKey] = set()      # progressed, not yet written
        self.written_at = float("-inf")

    def due(self, now: float) -> bool:
        """True when deferred progress is due to be written."""
        return now - self.written_at >= self.every_s

    def waiting(self, now: float) -> bool:
        """True when progress is deferred and due: worth a write even with no new message."""
        return bool(self.deferred) and self.due(now)

    def plan(self, ranks: Set[RankKey], urgent: Set[RankKey], now: float,
             everything: bool = False) -> tuple[list[RankKey], bool]:
        """The keys to write for a batch that touched ``ranks`` (``urgent`` of them changed more
        than progress), sorted, and whether this write clears the deferred ones."""
        due = everything or self.due(now)
        keys = (ranks | self.deferred) if due else urgent
        return sorted(keys), due

    def written(self, ranks: Set[RankKey], keys: list[RankKey], due: bool, now: float) -> None:
        """The planned ``keys`` are in the store."""
        if due:
            self.deferred.clear()
            self.written_at = now
        else:
            self.deferred |= ranks
            self.deferred -= set(keys)
