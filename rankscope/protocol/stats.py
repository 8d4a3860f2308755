"""``stats``: the processors' per-rank step statistics, one message per job per period.

Body::

    {"ranks": [{...}, ...]}
"""

from __future__ import annotations

from typing import Any

from rankscope.protocol.fields import field


def check_stats(body: dict[str, Any]) -> None:
    """Check a ``stats`` body's fields."""
    field("stats", body, "ranks", list)
