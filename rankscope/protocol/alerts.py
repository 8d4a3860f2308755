"""Alerts: the JSON documents published on the alerts topic (schema documented in README).

One incident has one ``alert_id``; every change publishes the whole alert again with a higher
``version`` and ``status`` ``open`` -> ``update``* -> ``resolved``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

ALERT_SCHEMA_VERSION = 1
ALERT_KINDS = frozenset({"hang", "dead_rank", "slow_rank", "abnormal_worker", "rank_failed", "collective_mismatch"})
ALERT_STATUSES = frozenset({"open", "update", "resolved"})


@dataclass(frozen=True)
class StackGroup:
    """Identical stacks merged across ranks. ``frames`` outermost first, as "file:line func".
    ``ranks`` lists at most 32 of them; ``count`` is how many ranks share the stack."""

    ranks: list[int]
    thread: str
    frames: list[str]
    waiting_in_collective: bool
    count: int = 0


MAX_RANKS = 256          # culprit ranks an alert names (``ranks``; the schema's maxItems)
MAX_DETAIL_RANKS = 64    # ranks a rank list or map in ``details`` holds


@dataclass(frozen=True)
class Alert:
    alert_id: str
    job: str
    kind: str
    status: str
    severity: str
    ranks: list[int]           # culprit ranks
    step: int                  # step the incident concerns (last completed step of the culprits)
    opened_ns: int
    updated_ns: int
    version: int
    summary: str
    resolved_ns: int = 0
    lost_rank_seconds: float = 0.0
    stack_groups: list[StackGroup] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    schema_version: int = ALERT_SCHEMA_VERSION

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Alert:
        """Parse and validate. Raises ValueError with the reason."""
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"alert is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError("alert is not an object")
        if obj.get("schema_version") != ALERT_SCHEMA_VERSION:
            raise ValueError(f"unknown alert schema_version {obj.get('schema_version')!r}")
        if obj.get("kind") not in ALERT_KINDS or obj.get("status") not in ALERT_STATUSES:
            raise ValueError(f"bad alert kind/status {obj.get('kind')!r}/{obj.get('status')!r}")
        try:
            groups = [StackGroup(**g) for g in obj.pop("stack_groups", [])]
            return cls(stack_groups=groups, **obj)
        except TypeError as e:
            raise ValueError(f"bad alert fields: {e}") from None
