"""Dead letters: input that failed validation, kept with the reason (JSON on the deadletter topic).

Every service that consumes input routes what it cannot decode here and counts it; it never stops.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

MAX_PAYLOAD_BYTES = 4096


@dataclass(frozen=True)
class DeadLetter:
    ts_ns: int
    source_topic: str
    partition: int
    offset: int
    stage: str          # which service rejected it: "sink", "processors", "control"
    reason: str         # short code, e.g. not_msgpack, unknown_version, bad_body
    detail: str
    payload_b64: str    # the first MAX_PAYLOAD_BYTES of the payload
    schema_version: int = 1

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> DeadLetter:
        obj = json.loads(data)
        if obj.get("schema_version") != 1:
            raise ValueError(f"unknown deadletter schema_version {obj.get('schema_version')!r}")
        return cls(**obj)

    @classmethod
    def make(cls, *, ts_ns: int, source_topic: str, partition: int, offset: int, stage: str,
             reason: str, detail: str, payload: bytes | None) -> DeadLetter:
        raw = (payload or b"")[:MAX_PAYLOAD_BYTES]
        return cls(ts_ns=ts_ns, source_topic=source_topic, partition=partition, offset=offset, stage=stage,
                   reason=reason, detail=detail[:1000], payload_b64=base64.b64encode(raw).decode())


class DeadLetterCounter:
    """Thread-safe counts of dead letters by (stage, reason), for logs, metrics and tests."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def add(self, stage: str, reason: str) -> None:
        with self._lock:
            self._counts[(stage, reason)] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {f"{s}:{r}": n for (s, r), n in self._counts.items()}

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())
