"""POST one JSON body to a webhook, retrying with backoff: the delivery step of ``rankscope alerts
--webhook``. Standard library only (urllib.request); the sender and the wait are injectable.

:func:`deliver`, for one body:

1. send it (``send(url, body, timeout_s)`` returns the HTTP status, raises OSError or
   http.client.HTTPException when no answer came);
2. a 2xx answer: ``delivered``;
3. another 4xx than 408 and 429, or a 1xx/3xx: ``rejected`` at once (the same body would fail again);
4. no answer, a 5xx, 408 or 429: wait ``policy.backoff_s(n)`` (doubling, capped) and send again, at
   most ``policy.attempts`` sends in all; then ``gave_up``;
5. a wait that returns True (the forwarder is stopping) ends it as ``stopped``: not delivered, not
   given up; the caller leaves its offset uncommitted so a restart reads it again.

Webhook URLs often carry their secret in the path (Slack's do): :func:`url_for_logs` keeps only
the scheme and host.
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

DELIVERED, REJECTED, GAVE_UP, STOPPED = "delivered", "rejected", "gave_up", "stopped"
RETRIED_STATUSES = frozenset({408, 429})

Sender = Callable[[str, bytes, float], int]     # (url, body, timeout_s) -> HTTP status
Wait = Callable[[float], bool]                  # wait this many seconds; True = stop now


@dataclass(frozen=True)
class RetryPolicy:
    """How hard one body is tried: ``attempts`` sends at most (the first included), waiting
    ``first_backoff_s`` after the first failure, twice as long after each next, at most
    ``max_backoff_s``; each send waits ``timeout_s`` for its answer."""

    attempts: int = 5
    first_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {self.attempts}")
        if not 0 <= self.first_backoff_s <= self.max_backoff_s:
            raise ValueError(f"backoff must satisfy 0 <= first ({self.first_backoff_s}) <= max ({self.max_backoff_s})")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")

    def backoff_s(self, failures: int) -> float:
        """The wait after the ``failures``-th failed send (1-based)."""
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** (failures - 1))

    def worst_case_s(self) -> float:
        """The longest one body can take: every send timing out, every backoff waited."""
        return self.attempts * self.timeout_s + sum(self.backoff_s(n) for n in range(1, self.attempts))


@dataclass(frozen=True)
class Delivery:
    outcome: str        # DELIVERED, REJECTED, GAVE_UP or STOPPED
    attempts: int       # sends made
    error: str = ""     # the last failure, for the log


def post_json(url: str, body: bytes, timeout_s: float) -> int:
    """POST ``body`` as application/json; the HTTP status of the answer (also of a 4xx or 5xx).
    Blocks up to about ``timeout_s``; raises OSError (URLError, timeouts, refused connections) or
    http.client.HTTPException when no answer came."""
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", "User-Agent": "rankscope"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as e:
        e.close()
        return int(e.code)


def sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return False


def deliver(url: str, body: bytes, policy: RetryPolicy, send: Sender = post_json, wait: Wait = sleep) -> Delivery:
    """Send ``body`` to ``url`` until it is delivered, rejected or given up (steps in the module
    docstring). Blocks at most ``policy.worst_case_s()``; never raises for a delivery failure."""
    error = ""
    for attempt in range(1, policy.attempts + 1):
        try:
            status = send(url, body, policy.timeout_s)
        except (OSError, http.client.HTTPException) as e:
            error = f"{type(e).__name__}: {e}"
        else:
            if 200 <= status < 300:
                return Delivery(DELIVERED, attempt)
            error = f"HTTP {status}"
            if status < 500 and status not in RETRIED_STATUSES:
                return Delivery(REJECTED, attempt, error)
        if attempt < policy.attempts and wait(policy.backoff_s(attempt)):
            return Delivery(STOPPED, attempt, error)
    return Delivery(GAVE_UP, policy.attempts, error)


def url_for_logs(url: str) -> str:
    """``https://hooks.slack.com/services/T0/B0/secret`` -> ``https://hooks.slack.com/...``."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}/..."
