"""``shard`` (v2): the processors' own per-partition job summary (stream_processors/shard_summary.py).

Body::

    {"shard": int, "ts_ns": int, "agg": {...}, "rows": [...], "stacks": {...}}
"""

from __future__ import annotations

from typing import Any

from rankscope.protocol.fields import field


def check_shard(body: dict[str, Any]) -> None:
    """Check a ``shard`` body's fields."""
    field("shard", body, "shard", int)
    field("shard", body, "ts_ns", int)
    field("shard", body, "agg", dict)
    field("shard", body, "rows", list)
    field("shard", body, "stacks", dict)
