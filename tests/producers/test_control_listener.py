"""The rank's control listener: what it does with each kind of message on the control topic."""

from __future__ import annotations

from typing import Any

from rankscope.producers.control import ControlListener
from rankscope.wire import Envelope, encode


def _listener() -> tuple[ControlListener, list[tuple[Any, ...]], list[tuple[str, str]]]:
    handled: list[tuple[Any, ...]] = []
    rejected: list[tuple[str, str]] = []
    listener = ControlListener("127.0.0.1:1", "t.control", "job1", 0, handler=lambda *a: handled.append(a),
                               reject=lambda rid, why: rejected.append((rid, why)), consumer=object())
    return listener, handled, rejected


def _env(kind: str, body: dict[str, Any], job: str = "job1") -> bytes:
    return encode(Envelope(kind=kind, job=job, rank=1, host="h", pid=1, seq=1, sent_ns=5, body=body))


def test_replies_of_older_ranks_are_not_commands() -> None:
    """Before the replies topic, ranks sent acks and flight records to the control topic, and every
    rank of the job answered each flight record with a 'rejected' ack: N^2 acks in a hang."""
    listener, handled, rejected = _listener()
    listener.handle_payload(_env("flight", {"steps": [[1, 0, 5, 0]], "stacks": None, "reason": "hang",
                                            "request_id": "flight-a1"}))
    listener.handle_payload(_env("ack", {"request_id": "tw1", "status": "accepted", "detail": ""}))
    assert handled == [] and rejected == [] and listener.rejected == 0


def test_commands_are_handled_and_bad_ones_rejected() -> None:
    listener, handled, rejected = _listener()
    listener.handle_payload(_env("control", {"command": "flight", "request_id": "f1", "ranks": None,
                                             "args": {"reason": "hang"}}))
    listener.handle_payload(_env("control", {"command": "reboot", "request_id": "r1", "ranks": None, "args": {}}))
    assert [h[:2] for h in handled] == [("flight", "f1")]
    assert [r[0] for r in rejected] == ["r1"] and listener.rejected == 1
