"""``hw``: a rank's hardware samples, columnar.

Body::

    {"ts_ns": [int, ...], "device": [int, ...], "metrics": {name: [number | nil, ...], ...}}
"""

from __future__ import annotations

from typing import Any

from rankscope.protocol.fields import missing, wrong_type


def check_hw(body: dict[str, Any]) -> None:
    """Check an ``hw`` body's fields."""
    try:
        ts_ns, device, metrics = body["ts_ns"], body["device"], body["metrics"]
    except KeyError as e:
        raise missing("hw", e) from None
    if type(ts_ns) is not list:
        raise wrong_type("hw.ts_ns", ts_ns)
    if type(device) is not list:
        raise wrong_type("hw.device", device)
    if type(metrics) is not dict:
        raise wrong_type("hw.metrics", metrics)
