"""When the sink writes the ``ranks`` table (storage/sink.py): a rank's new process, host, world size
or exit with the batch that saw it; progress alone at most every ``sink_ranks_s``, also when no
message follows; the rest on close. Small fakes for the consumer and the store, a manual clock."""

from __future__ import annotations

from typing import Any

from rankscope.clock import ManualClock
from rankscope.config import Settings
from rankscope.protocol.envelope import Envelope, encode
from rankscope.storage.sink import Sink
from rankscope.topics import Topic
from tests.kafka_fakes import Message

JOB = "ranks-upsert"


class FakeConsumer:
    def __init__(self) -> None:
        self.queue: list[Message] = []
        self.commits: list[Any] = []

    def subscribe(self, topics: list[str], **_: Any) -> None:
        pass

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        out, self.queue = self.queue[:num_messages], self.queue[num_messages:]
        return out

    def commit(self, offsets: list[Any], asynchronous: bool) -> None:
        self.commits.append(offsets)

    def assignment(self) -> list[Any]:
        return []

    def close(self) -> None:
        pass


class FakeProducer:
    def produce(self, *a: Any, **kw: Any) -> None:
        pass

    def poll(self, timeout: float) -> int:
        return 0

    def flush(self, timeout: float) -> int:
        return 0


class FakeStore:
    database = "rankscope"

    def __init__(self) -> None:
        self.inserts: list[tuple[str, dict[str, list[Any]]]] = []

    def insert_columns(self, table: str, columns: dict[str, list[Any]],
                       arrow_types: dict[str, str] | None = None) -> int:
        n = len(next(iter(columns.values()))) if columns else 0
        if n:
            self.inserts.append((table, columns))
        return n

    def query_rows(self, sql: str, parameters: Any = None) -> list[tuple]:
        return []

    def ranks_written(self) -> list[list[tuple[int, int, int, str]]]:
        return [list(zip(c["rank"], c["pid"], c["last_step"], c["exit_reason"], strict=True))
                for t, c in self.inserts if t == "ranks"]


def beat(rank: int, pid: int, step: int, sent_ns: int) -> bytes:
    body = {"step": [step], "start_ns": [sent_ns - 900], "end_ns": [sent_ns - 100], "comm_ns": [0], "hb_step": step,
            "since_step_s": 0.0, "dropped": 0, "world_size": 2, "local_rank": rank, "stacks": None}
    return encode(Envelope(kind="beat", job=JOB, rank=rank, host="h", pid=pid, seq=step + 1, sent_ns=sent_ns,
                           body=body, v=2))


def exit_msg(rank: int, pid: int, step: int, sent_ns: int) -> bytes:
    return encode(Envelope(kind="exit", job=JOB, rank=rank, host="h", pid=pid, seq=10_000, sent_ns=sent_ns,
                           body={"step": step, "reason": "completed", "detail": ""}, v=2))


def test_progress_is_written_every_sink_ranks_s_and_changes_at_once() -> None:
    settings = Settings(sink_batch_s=0.5, sink_ranks_s=2.0, topic_prefix="t.")
    clock, consumer, store = ManualClock(), FakeConsumer(), FakeStore()
    sink = Sink(settings, store, clock, consumer=consumer, producer=FakeProducer())  # type: ignore[arg-type]
    steps = Topic.STEPS.name_for(settings)
    offset = 0

    def tick(*values: bytes) -> list[list[tuple[int, int, int, str]]]:
        """Deliver ``values``, let the batch age out, and return the ranks rows written meanwhile."""
        nonlocal offset
        before = len(store.ranks_written())
        for v in values:
            consumer.queue.append(Message(steps, 0, offset, v))
            offset += 1
        sink.poll_once(0)
        clock.advance(0.6)
        sink.poll_once(0)
        return store.ranks_written()[before:]

    t = clock.wall_ns()
    # New ranks: written with their batch.
    assert tick(beat(0, 100, 0, t), beat(1, 101, 0, t)) == [[(0, 100, 0, ""), (1, 101, 0, "")]]
    # Progress only: deferred (0.6 s and 1.2 s after the last write).
    assert tick(beat(0, 100, 1, t + 1), beat(1, 101, 1, t + 1)) == []
    # Rank 1 restarted (a new pid): that rank at once, rank 0's progress still waits.
    assert tick(beat(0, 100, 2, t + 2), beat(1, 201, 0, t + 2)) == [[(1, 201, 0, "")]]
    # 1.8 s: nothing new and not yet due; 2.4 s: the deferred progress is written without a message.
    assert tick() == []
    assert tick() == [[(0, 100, 2, "")]]   # rank 1 has not progressed since it was written
    # An exit is written with its batch; the other rank's later progress waits for close().
    assert tick(beat(0, 100, 3, t + 3), exit_msg(1, 201, 0, t + 3)) == [[(1, 201, 0, "completed")]]
    sink.close()
    assert store.ranks_written()[-1] == [(0, 100, 3, "")]
    assert all(c for c in consumer.commits)   # every committed batch had offsets
