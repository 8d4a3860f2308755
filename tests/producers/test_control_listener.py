"""The rank's control listener: what it does with each kind of message on the control topic."""

from __future__ import annotations

import time
from typing import Any

import pytest

from rankscope.config import Settings
from rankscope.producers.control import ControlListener
from rankscope.protocol.envelope import Envelope, encode
from rankscope.topics import Topic
from tests.integration.helpers import wait_until


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


@pytest.mark.kafka
def test_a_command_sent_before_the_listener_is_positioned_is_read(fresh_topics: Settings) -> None:
    """A rank starved of CPU may position its consumer seconds after it started listening: a command
    produced in between is still read (a consumer assigned at the partition's end would miss it),
    and one produced before the rank started is not."""
    from confluent_kafka import Producer

    topic = Topic.CONTROL.name_for(fresh_topics)
    producer = Producer({"bootstrap.servers": fresh_topics.bootstrap})
    old = _env("control", {"command": "flight", "request_id": "before", "ranks": None, "args": {"reason": "x"}})
    producer.produce(topic, old, key=b"job1", timestamp=int(time.time() * 1000) - 60_000)
    producer.flush(10)
    handled: list[tuple[Any, ...]] = []
    listener = ControlListener(fresh_topics.bootstrap, topic, "job1", 0, handler=lambda *a: handled.append(a),
                               reject=lambda rid, why: None)
    producer.produce(topic, _env("control", {"command": "flight", "request_id": "meanwhile", "ranks": None,
                                             "args": {"reason": "x"}}), key=b"job1")
    assert producer.flush(10) == 0
    listener.start()                               # positioned only now
    try:
        wait_until(lambda: handled, 60, "the command sent before the listener was positioned")
        producer.produce(topic, _env("control", {"command": "flight", "request_id": "after", "ranks": None,
                                                 "args": {"reason": "x"}}), key=b"job1")
        producer.flush(10)
        wait_until(lambda: len(handled) >= 2, 60, "the command sent after")
    finally:
        listener.stop(10)
    assert [h[1] for h in handled] == ["meanwhile", "after"]
