"""Tracer unit tests with a recording transport and a manual clock (no Kafka)."""

from __future__ import annotations

import threading

from rankscope.clock import ManualClock
from rankscope.config import Settings
from rankscope.producers.thread_cpu import ThreadCpu
from rankscope.producers.tracer import Tracer
from rankscope.protocol.envelope import decode


class RecordingTransport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.sent_keys: list[tuple[str, bytes]] = []
        self.dropped = 0
        self.closed = False

    def send(self, topic: str, key: bytes, value: bytes) -> bool:
        self.sent.append(value)
        self.sent_keys.append((topic, key))
        return True

    def keys(self, topic_suffix: str = "steps") -> list[bytes]:
        return [k for t, k in self.sent_keys if t.endswith(topic_suffix)]

    def close(self, timeout_s: float) -> None:
        self.closed = True

    def messages(self):
        return [decode(v) for v in self.sent]


def make(clock: ManualClock, **kw) -> tuple[Tracer, RecordingTransport]:
    t = RecordingTransport()
    s = Settings(job_id="job1", rank=2, world_size=4, local_rank=2, heartbeat_s=60, stall_stack_min_s=3,
                 stall_stack_factor=3, **kw)
    return Tracer(s, clock=clock, transport=t, install_collective_timing=False, handle_signals=False), t


def test_steps_travel_in_beats_keyed_by_rank_and_exit_is_sent():
    clock = ManualClock()
    tracer, t = make(clock)
    for _ in range(5):
        clock.advance(0.01)
        tracer.step()
    tracer.close()
    msgs = t.messages()
    steps = [m for m in msgs if m.kind == "beat"]
    assert {m.kind for m in msgs} == {"beat", "exit"}
    assert steps[-1].body["hb_step"] == 4 and steps[-1].body["world_size"] == 4
    assert set(t.keys()) == {b"job1/2"}
    assert sum(len(m.body["step"]) for m in steps) == 5
    assert steps[0].body["step"] == [] and steps[0].body["hb_step"] == -1   # sent at start: the rank exists
    assert [s for m in steps for s in m.body["step"]][:2] == [0, 1]
    assert all(abs(e - s - 10_000_000) < 1000 for m in steps for s, e in zip(m.body["start_ns"], m.body["end_ns"], strict=True))
    assert msgs[-1].kind == "exit" and msgs[-1].body["reason"] == "completed" and msgs[-1].body["step"] == 4
    assert [m.seq for m in msgs] == sorted({m.seq for m in msgs})
    assert msgs[0].job == "job1" and msgs[0].rank == 2
    assert t.closed


def test_heartbeat_carries_stacks_only_when_the_step_is_overdue():
    clock = ManualClock()
    tracer, _ = make(clock)
    for _ in range(10):
        clock.advance(0.1)
        tracer.step()
    clock.advance(0.2)
    assert tracer.heartbeat_body()["stacks"] is None
    clock.advance(5.0)
    body = tracer.heartbeat_body()
    assert body["since_step_s"] >= 5.0
    threads = {s["thread"] for s in body["stacks"]}
    assert threading.current_thread().name in threads
    main = [s for s in body["stacks"] if s["thread"] == threading.current_thread().name][0]
    assert any("test_heartbeat_carries_stacks" in f for f in main["frames"])
    tracer.close()


def test_beats_carry_the_training_threads_cpu_time_and_run_queue_wait():
    clock = ManualClock()
    tracer, _ = make(clock)
    assert "cpu" not in tracer.heartbeat_body()      # no step yet: which thread trains is unknown
    tracer.close()

    tracer, t = make(clock)
    tracer.step()
    tracer.step()
    sum(i * i for i in range(300_000))
    cpu_ns, runq_ns = tracer.heartbeat_body()["cpu"]
    assert cpu_ns >= 1_000_000 and runq_ns >= 0       # this thread's CPU time since it started
    assert tracer.train_cpu.path.endswith(f"/task/{threading.get_native_id()}/schedstat")
    tracer.close()
    beats = [m for m in t.messages() if m.kind == "beat"]
    assert beats[-1].body["cpu"][0] >= cpu_ns


def test_a_missing_schedstat_leaves_one_log_line_and_no_cpu(tmp_path, caplog):
    reader = ThreadCpu(proc_root=str(tmp_path))
    assert reader.read() is None                     # nothing watched yet
    reader.watch(123)
    with caplog.at_level("INFO", logger="rankscope.producers.thread_cpu"):
        assert reader.read() is None and reader.read() is None
    assert len([r for r in caplog.records if "run-queue wait is not reported" in r.getMessage()]) == 1


def test_tracer_never_raises_even_with_a_broken_transport():
    class Broken:
        dropped = 0
        sends = 0

        def send(self, *a):
            self.sends += 1
            raise RuntimeError("boom")

        def close(self, timeout_s):
            raise RuntimeError("boom")

    broken = Broken()
    # No sampler threads: every send is the training thread's or close()'s.
    tracer = Tracer(Settings(job_id="j", heartbeat_s=60, hw_sample_s=0, profile_hz=0), transport=broken,
                    install_collective_timing=False, handle_signals=False)
    for _ in range(100):
        tracer.step()
    assert tracer.current_step == 99     # training went on, and the tracer still counts its steps
    assert broken.sends >= 1 and tracer.dropped == broken.sends   # the first beat, counted as dropped
    tracer.close()                       # the last beat fails too, and close still returns
    assert broken.sends >= 2 and tracer.dropped == broken.sends


def test_no_broker_does_not_block_or_raise():
    # Nothing listens on this port: construction, steps and close return promptly.
    tracer = Tracer(Settings(job_id="j", bootstrap_servers="127.0.0.1:1", heartbeat_s=0.2, flush_timeout_s=0.5),
                    install_collective_timing=False, handle_signals=False)
    for _ in range(1000):
        tracer.step()
    tracer.close()
    assert tracer.current_step == 999


class SlowProfilerStart:
    """A window controller whose profiler start takes ``seconds`` of the (manual) clock."""

    def __init__(self, tracer: Tracer, clock: ManualClock, seconds: float) -> None:
        self.tracer, self.clock, self.seconds = tracer, clock, seconds
        self.armed = True
        self.seen_during: list[float] = []

    def on_step(self, completed_step: int) -> None:
        self.clock.advance(self.seconds / 2)
        self.seen_during.append(self.tracer.heartbeat_body()["since_step_s"])
        self.clock.advance(self.seconds / 2)
        self.armed = False

    def drain(self, timeout_s: float) -> None:
        pass


def test_the_profilers_start_is_tool_time_not_time_without_a_step():
    clock = ManualClock()
    tracer, t = make(clock)
    real_windows = tracer.windows
    tracer.windows = slow = SlowProfilerStart(tracer, clock, 40.0)
    clock.advance(0.01)
    tracer.step()                      # step 0 ends; the window's profiler takes 40 s to start
    assert slow.seen_during == [0.0]   # no hang while the tool starts the profiler
    assert tracer.heartbeat_body()["since_step_s"] == 0.0
    clock.advance(0.01)
    tracer.step()                      # step 1 does not carry the profiler's 40 s
    tracer.windows = real_windows
    tracer.close()
    rows = [(s, e - a) for m in t.messages() if m.kind == "beat"
            for s, a, e in zip(m.body["step"], m.body["start_ns"], m.body["end_ns"], strict=True)]
    assert [s for s, _ in rows] == [0, 1] and all(abs(d - 10_000_000) < 1000 for _, d in rows), rows


def test_a_profiler_start_that_never_returns_is_a_stall_after_the_pause_limit():
    from rankscope.producers.tracer import TOOL_PAUSE_MAX_S

    clock = ManualClock()
    tracer, _ = make(clock)
    tracer._tool_since_ns = clock.wall_ns()
    clock.advance(TOOL_PAUSE_MAX_S + 15)
    assert tracer.heartbeat_body()["since_step_s"] == 15.0
    tracer._tool_since_ns = 0
    tracer.close()


def test_a_sigterm_during_the_exception_exit_record_waits_for_it():
    """The launcher SIGTERMs the ranks when one dies; a rank sending the exit record of its own
    exception (a peer's connection reset) then still gets it out, and dies of the SIGTERM after."""
    clock = ManualClock()
    tracer, t = make(clock)
    tracer.step()
    events: list[str] = []
    drain = tracer.windows.drain

    def drain_then_sigterm(timeout_s: float) -> None:
        drain(timeout_s)
        tracer._on_sigterm(15, None)       # the signal handler runs on the closing main thread
        events.append("sigterm handled")

    tracer.windows.drain = drain_then_sigterm
    tracer._die_of_sigterm = lambda: events.append(f"died after {[m.kind for m in t.messages()][-1]}")
    try:
        raise RuntimeError("Connection reset by peer")
    except RuntimeError as e:
        tracer.close_on_exception(type(e), e, e.__traceback__)
    exits = [m for m in t.messages() if m.kind == "exit"]
    assert len(exits) == 1 and exits[0].body["reason"] == "exception", exits
    assert "Connection reset by peer" in exits[0].body["detail"]
    assert events == ["sigterm handled", "died after exit"]


def test_a_sigterm_after_close_dies_at_once():
    clock = ManualClock()
    tracer, t = make(clock)
    tracer.close()
    died: list[bool] = []
    tracer._die_of_sigterm = lambda: died.append(True)
    tracer._on_sigterm(15, None)
    assert died == [True] and [m.body["reason"] for m in t.messages() if m.kind == "exit"] == ["completed"]
