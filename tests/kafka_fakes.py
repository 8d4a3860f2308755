"""A polled Kafka message for unit tests: the accessors of confluent-kafka's ``Message``."""

from __future__ import annotations

from typing import Any


class Message:
    def __init__(self, topic: str = "t", partition: int = 0, offset: int = 0, value: Any = b"", ts_ms: int = 0,
                 error: Any = None) -> None:
        self._t, self._p, self._o, self._v, self._ts, self._e = topic, partition, offset, value, ts_ms, error

    def topic(self) -> str:
        return self._t

    def partition(self) -> int:
        return self._p

    def offset(self) -> int:
        return self._o

    def value(self) -> Any:
        return self._v

    def error(self) -> Any:
        return self._e

    def timestamp(self) -> tuple[int, int]:
        return (1, self._ts) if self._ts else (0, -1)
