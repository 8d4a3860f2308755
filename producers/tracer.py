"""The rank-side tracer: ``tracer.step()`` marks step boundaries (PerfTracker's model).

Usage::

    from rankscope import Tracer
    tracer = Tracer()            # rank, world size and job id from the torchrun environment
    for batch in loader:
        train_step(batch)
        tracer.step()

Contract:
- Construction and every method never raise into training code and never block on the network;
  with no broker the tracer logs one warning and training goes on.
- ``step()`` costs a few microseconds: it appends a record to a list. A background thread sends
  one ``beat`` every ``heartbeat_s``: the step records since the last one and the heartbeat,
  keyed by job/rank so a job spreads over partitions; once the current step runs much longer
  than usual (``stall_stack_factor`` x recent median, at least ``stall_stack_min_s``) heartbeats
  carry the stacks of every thread.
- At exit (normal end, exception, SIGTERM) a final ``exit`` record says how the process ended.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import signal
import statistics
import sys
import threading
import traceback
from typing import Any

from rankscope.clock import SYSTEM_CLOCK, Clock
from rankscope.config import Settings, unknown_env
from rankscope.kafka_client import client_conf
from rankscope.own_frames import is_own_frame
from rankscope.producers.collective_log import (
    CollectiveLog,
    bounded_dump,
    enable_recorder,
    full_dump_json,
    read_period_s,
)
from rankscope.producers.collectives import CommTimer, install, uninstall
from rankscope.producers.control import ControlListener
from rankscope.producers.ddp import DdpWatcher, mark_reducer_wait
from rankscope.producers.hw import HardwareSampler
from rankscope.producers.identity import RankIdentity, resolve_identity
from rankscope.producers.native_extract import WindowReader
from rankscope.producers.stack_sampler import StackSampler
from rankscope.producers.stacks import MAX_FRAMES, all_thread_stacks, frame_label
from rankscope.producers.thread_cpu import ThreadCpu
from rankscope.producers.trace_window import WindowController
from rankscope.producers.transport import Transport
from rankscope.producers.untraced import leave_profiler
from rankscope.protocol.envelope import Envelope, encode
from rankscope.protocol.envelope import rank_key as steps_key
from rankscope.topics import Topic

log = logging.getLogger("rankscope.tracer")

TOOL_PAUSE_MAX_S = 120.0   # profiler start/stop longer than this counts as time without a step again


class Tracer:
    def __init__(self, settings: Settings | None = None, *, clock: Clock | None = None,
                 transport: Any = None, install_collective_timing: bool = True,
                 handle_signals: bool = True, **overrides: Any) -> None:
        self._ok = False
        self._closed = False
        self._close_done = False
        self._sigterm_pending = False   # a SIGTERM that came while the exit record was on its way
        try:
            self._init(settings, clock, transport, install_collective_timing, handle_signals, overrides)
            self._ok = True
        except Exception as e:  # never fail the training script
            log.warning("rankscope: tracer disabled: %s: %s", type(e).__name__, e)

    def _init(self, settings: Settings | None, clock: Clock | None, transport: Any,
              install_collective_timing: bool, handle_signals: bool, overrides: dict[str, Any]) -> None:
        if settings is None:
            for warning in unknown_env():
                log.warning("rankscope: %s", warning)
        self.settings = settings or Settings.from_env(**overrides)
        self.clock = clock or SYSTEM_CLOCK
        self.identity: RankIdentity = resolve_identity(self.settings)
        self._steps_topic = Topic.STEPS.name_for(self.settings)
        self._key = self.identity.job.encode()
        self._rank_key = steps_key(self.identity.job, self.identity.rank)
        self.transport = transport or Transport(
            self.settings.bootstrap, queue_max=self.settings.queue_max, producer_config=client_conf(self.settings),
            compression=self.settings.producer_compression, client_id=f"rankscope-{self.identity.job}-{self.identity.rank}")
        self._seq = 0
        self._send_failures = 0
        self._seq_lock = threading.Lock()
        self._control_topic = Topic.CONTROL.name_for(self.settings)
        self._replies_topic = Topic.REPLIES.name_for(self.settings)
        rank_key = f"{self.identity.job}/{self.identity.rank}".encode()
        self.train_cpu = ThreadCpu()      # the training thread's CPU time and run-queue wait, in beats and windows
        self.windows = WindowController(
            send_trace=lambda kind, body: self._send_to(Topic.TRACES.name_for(self.settings), rank_key, kind, body),
            send_summary=lambda kind, body: self._send_to(Topic.SUMMARIES.name_for(self.settings), self._key, kind, body),
            ack=self._ack, byte_budget=self.settings.trace_byte_budget, wall_ns=self.clock.wall_ns,
            on_window=self._on_window,
            read_window=WindowReader(self.settings.cache_dir, self.settings.native_reader),
            thread_cpu=self.train_cpu.read)
        self._flight: collections.deque[tuple[int, int, int, int]] = collections.deque(maxlen=self.settings.flight_steps)
        self.control: ControlListener | None = None
        if self.settings.control_enabled and transport is None:
            self.control = ControlListener(client_conf(self.settings), self._control_topic, self.identity.job,
                                           self.identity.rank, handler=self._on_control,
                                           reject=lambda rid, why: self._ack(rid, "rejected", why)).start()
        self._step = -1                      # last completed step
        self._tool_since_ns = 0              # set while the profiler starts or stops (tool time)
        self._in_startup = False             # defer_first_step(): the next step() ends step 0, unrecorded
        self._step_start_ns = self.clock.wall_ns()
        self._pending: list[tuple[int, int, int, int]] = []
        self._recent: collections.deque[int] = collections.deque(maxlen=32)
        self._comm = CommTimer()
        if install_collective_timing:
            install(self._comm)
        self._collectives = self._collective_log()
        # DDP models made before or after this tracer get the last-gradient mark (producers/ddp.py).
        self._ddp = DdpWatcher(self._comm)
        if self.settings.ddp_autodetect:
            self._ddp.start()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="rankscope-heartbeat", daemon=True)
        # Hardware sampler (producers/hw.py): its own thread, HW topic, key "job/rank".
        self.hw_sampler: HardwareSampler | None = None
        if self.settings.hw_sample_s > 0:
            hw_topic = Topic.HW.name_for(self.settings)
            try:
                self.hw_sampler = HardwareSampler(
                    self.settings, self.identity,
                    lambda kind, body: self._send_to(hw_topic, rank_key, kind, body), self.clock).start()
            except Exception as e:
                log.warning("rankscope: hardware sampling off: %s: %s", type(e).__name__, e)
        # Stack sampling (producers/stack_sampler.py, with profile_hz > 0): its own thread, PROFILES topic.
        self._train_ident: int | None = None
        self.stack_sampler: StackSampler | None = None
        self._profiles_topic = Topic.PROFILES.name_for(self.settings)
        if self.settings.profile_hz > 0:
            self.stack_sampler = StackSampler(self.settings.profile_hz, self.settings.profile_s, self._send_profile,
                                              lambda: self._train_ident, self.clock.wall_ns,
                                              workers=transport is None, cache_dir=self.settings.cache_dir).start()
        atexit.register(self._atexit)
        self._prev_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        if handle_signals and threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                    signal.signal(signal.SIGTERM, self._on_sigterm)
            except (ValueError, OSError):
                pass
        # Time without a step counts from here, and a first beat goes out now: a rank killed in its
        # first second is still known to exist.
        self._step_start_ns = self.clock.wall_ns()
        try:
            self._send_beat()
        except Exception as e:   # a transport that fails now may work later: the heartbeats go on
            log.debug("first beat failed: %s", e)
        self._thread.start()
        if self._collectives is not None:
            threading.Thread(target=self._collective_loop, name="rankscope-collectives", daemon=True).start()

    # Public API -------------------------------------------------------------------------------
    @property
    def current_step(self) -> int:
        """The last completed step (-1 before the first ``step()``)."""
        return self._step

    @property
    def dropped(self) -> int:
        """Messages lost: those the transport dropped, and those whose send raised."""
        return int(getattr(self.transport, "dropped", 0)) + self._send_failures if self._ok else 0

    def step(self) -> None:
        """Mark the end of the current step and the start of the next. Never raises."""
        if not self._ok:
            return
        try:
            now = self.clock.wall_ns()
            if self._in_startup:      # step 0 ends here; its start is unknown, so it has no record
                self._in_startup = False
                self._step = 0
                self._step_start_ns = now
                self._comm.take()
                self._comm.ddp_ready_ns = 0
                return
            start = self._step_start_ns
            comm = self._comm.take()
            ready = self._comm.ddp_ready_ns
            if ready and start < ready <= now:
                comm = max(comm, now - ready)  # DDP: busy until the last bucket was ready
                self._comm.ddp_ready_ns = 0
            self._step += 1
            if self._step <= 1:
                self._train_ident = threading.get_ident()
                self.train_cpu.watch(threading.get_native_id())
            rec = (self._step, start, now, min(comm, now - start))
            self._pending.append(rec)
            self._flight.append(rec)
            self._recent.append(now - start)
            self._step_start_ns = now
            if self.windows.armed:
                # Starting or stopping the profiler is the tool's time, not the step's: heartbeats
                # do not count it as time without a step (for at most TOOL_PAUSE_MAX_S), and the
                # next step starts when it returns.
                self._tool_since_ns = now
                try:
                    self.windows.on_step(self._step)
                finally:
                    self._tool_since_ns = 0
                    self._step_start_ns = self.clock.wall_ns()
        except Exception:
            pass

    def defer_first_step(self) -> None:
        """Treat the time until the next ``step()`` as start-up: that call ends step 0 without a step
        record (where start-up ends and step 0 begins is unknown), so step numbers still count the
        script's iterations from 0. Until then heartbeats report no time since a step (start-up is
        never taken for a hang) and carry no stacks. The attach path uses it: an unmodified script's
        first optimizer step comes after its imports, rendezvous, checkpoint loading and first iteration."""
        if self._ok:
            self._in_startup = True

    def watch_ddp(self, model: Any) -> None:
        """Under DDP, record when this rank's backward pass produced its last gradient (its busy time).

        DDP models are found by themselves (``ddp_autodetect``); this call is for a model the
        detection cannot see, or with ``ddp_autodetect`` off. A model is marked once however often
        it is watched."""
        if self._ok:
            self._ddp.watch(model)

    def close(self, reason: str = "completed", detail: str = "", *, exc_type: str = "",
              frames: list[str] | None = None) -> None:
        """Send the exit record and flush (bounded by ``flush_timeout_s``). Idempotent.

        ``exc_type`` and ``frames`` ("file:line func", outermost first) describe the exception an
        ``exception`` exit died of."""
        if not self._ok or self._closed:
            return
        self._closed = True
        try:
            self._stop.set()
            if self.control is not None:
                self.control.stop()       # its thread ends after its current poll (< 0.5 s)
            self.windows.drain(self.settings.flush_timeout_s / 2)
            if self.hw_sampler is not None:
                self.hw_sampler.stop()
            if self.stack_sampler is not None:
                self.stack_sampler.stop()
            if self._collectives is not None and not self._collectives.off_reason:
                # The collectives since the last read, on a thread of its own: a dump can wait on a
                # failing process group's locks, and the exit record must not.
                last = threading.Thread(target=self._collectives.collect, name="rankscope-collectives", daemon=True)
                last.start()
                last.join(1.0)
            self._send_beat()
            body: dict[str, Any] = {"step": self._step, "reason": reason, "detail": detail[:2000]}
            if exc_type:
                body["exc_type"] = exc_type[:200]
            if frames:
                body["frames"] = [f[:500] for f in frames[-MAX_FRAMES:]]
            self._send("exit", body)
            self.transport.close(self.settings.flush_timeout_s)
            uninstall(self._comm)
            self._ddp.close()
            if self.control is not None:
                self.control.stop(timeout_s=1.0)   # its consumer closed: no threads or connections left
            # A closed tracer is not kept alive by the interpreter's hooks (a job may make another).
            atexit.unregister(self._atexit)
            if sys.excepthook == self._excepthook:
                sys.excepthook = self._prev_excepthook
        except Exception:
            pass
        finally:
            self._close_done = True
        if self._sigterm_pending:
            self._die_of_sigterm()

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close("completed")
        else:
            self.close_on_exception(exc_type, exc, tb)

    def close_on_exception(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Close with an ``exception`` exit record: the one-line message as ``detail``, the exception's
        type and its traceback frames. Never raises."""
        try:
            detail = "".join(traceback.format_exception_only(exc_type, exc)).strip()
            name = getattr(exc_type, "__qualname__", None) or str(exc_type)
            module = getattr(exc_type, "__module__", "builtins")
            full = name if module in ("builtins", "__main__", None) else f"{module}.{name}"
            frames = [label for f in traceback.extract_tb(tb, limit=-MAX_FRAMES)
                      if not is_own_frame(label := frame_label(f.filename, f.lineno or 0, f.name))]
        except Exception:
            detail, full, frames = "exception", "", []
        self.close("exception", detail, exc_type=full, frames=frames)

    # Background -------------------------------------------------------------------------------
    def _collective_log(self) -> CollectiveLog | None:
        """Size the Flight Recorder's ring (unless the user configured it) and make its reader; None
        with ``coll_ring`` 0. A process group made before this tracer keeps PyTorch's default ring
        (2,000 entries), too costly to read every few seconds: no collective records then."""
        if self.settings.coll_ring <= 0:
            return None
        dist = sys.modules.get("torch.distributed")
        made_before = bool(dist is not None and dist.is_available() and dist.is_initialized())
        set_now = enable_recorder(os.environ, self.settings.coll_ring, self.settings.coll_timing)
        reader = CollectiveLog(self.identity.world_size)
        if made_before and set_now:
            reader.turn_off("the process group was made before the tracer, with PyTorch's default ring of 2,000 "
                            "entries, too costly to read every few seconds; make the Tracer first, use "
                            "`rankscope run`, or set TORCH_FR_BUFFER_SIZE")
        return reader

    def _send_profile(self, kind: str, body: dict[str, Any], pid: int | None) -> None:
        """A profile of this process, or of a DataLoader worker (``pid``), on the PROFILES topic."""
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
        env = Envelope(kind=kind, job=self.identity.job, rank=self.identity.rank, host=self.identity.host,
                       pid=self.identity.pid if pid is None else pid, seq=seq, sent_ns=self.clock.wall_ns(), body=body)
        self._transport_send(self._profiles_topic, self._rank_key, encode(env))

    def _send(self, kind: str, body: dict[str, Any]) -> None:
        self._send_to(self._steps_topic, self._rank_key, kind, body)

    def _send_to(self, topic: str, key: bytes, kind: str, body: dict[str, Any]) -> None:
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
        env = Envelope(kind=kind, job=self.identity.job, rank=self.identity.rank, host=self.identity.host,
                       pid=self.identity.pid, seq=seq, sent_ns=self.clock.wall_ns(), body=body)
        self._transport_send(topic, key, encode(env))

    def _transport_send(self, topic: str, key: bytes, value: bytes) -> None:
        """Hand a message to the transport; one whose send raises is counted as dropped (``dropped``)."""
        try:
            self.transport.send(topic, key, value)
        except Exception as e:
            with self._seq_lock:
                self._send_failures += 1
                first = self._send_failures == 1
            if first:
                log.warning("rankscope: a send failed (%s: %s); failed sends are counted as dropped",
                            type(e).__name__, e)

    def _ack(self, request_id: str, status: str, detail: str, **extra: Any) -> None:
        self._send_to(self._replies_topic, self._key, "ack",
                      {"request_id": request_id, "status": status, "detail": detail, **extra})

    def _on_control(self, command: str, request_id: str, args: dict[str, Any], ranks: list[int] | None,
                    sent_ns: int) -> None:
        if command == "flight":
            reason = str(args.get("reason", "requested"))
            self.send_flight_record(request_id, reason=reason)
            if self._collectives is not None and not self._collectives.off_reason:
                # Dumping waits for the recorder's and process groups' locks: not on the listener's thread.
                threading.Thread(target=self.send_collective_dump, args=(request_id, reason),
                                 name="rankscope-fr-dump", daemon=True).start()
        else:
            self.windows.handle(command, request_id, args, ranks, sent_ns)

    def send_flight_record(self, request_id: str = "", reason: str = "requested") -> None:
        """Send the flight recorder: the last ``flight_steps`` step records and every thread's stack."""
        steps = [list(r) for r in list(self._flight)]
        self._send_to(self._replies_topic, self._key, "flight",
                      {"steps": steps, "stacks": all_thread_stacks(skip_thread_ids={threading.get_ident()}),
                       "reason": reason, "request_id": request_id})
        if request_id:
            self._ack(request_id, "done", f"step history: {len(steps)} steps")

    def send_collective_dump(self, request_id: str = "", reason: str = "requested") -> None:
        """Send PyTorch's Flight Recorder dump (every collective the ring holds, as its JSON) on the
        replies topic (kind ``fr_dump``). Never raises."""
        try:
            text = full_dump_json()
        except Exception as e:
            log.info("rankscope: no Flight Recorder dump: %s: %s", type(e).__name__, e)
            return
        dump, truncated = bounded_dump(text)
        self._send_to(self._replies_topic, self._key, "fr_dump",
                      {"request_id": request_id, "reason": reason, "dump": dump, "truncated": truncated})

    def _on_window(self, active: bool) -> None:
        sampler = getattr(self, "hw_sampler", None)
        if sampler is not None:
            try:
                sampler.set_fast(active)
            except Exception:
                pass
        stacks = getattr(self, "stack_sampler", None)
        if stacks is not None:
            stacks.paused = active

    def _send_beat(self) -> None:
        batch, self._pending = self._pending, []
        hb = self.heartbeat_body()
        body = {"step": [r[0] for r in batch], "start_ns": [r[1] for r in batch],
                "end_ns": [r[2] for r in batch], "comm_ns": [r[3] for r in batch], "hb_step": hb.pop("step"), **hb}
        coll = self._collectives.take() if self._collectives is not None else None
        if coll:
            body["coll"] = coll
        self._send("beat", body)

    def heartbeat_body(self) -> dict[str, Any]:
        now = self.clock.wall_ns()
        tool = self._tool_since_ns
        if self._in_startup:
            since = 0.0
        elif tool:
            since = max(0.0, (now - tool) / 1e9 - TOOL_PAUSE_MAX_S)
        else:
            since = (now - self._step_start_ns) / 1e9
        stacks = None
        if self._recent:
            typical = statistics.median(self._recent) / 1e9
        else:
            typical = 0.0
        if since > max(self.settings.stall_stack_min_s, self.settings.stall_stack_factor * typical):
            stacks = all_thread_stacks(skip_thread_ids={self._thread.ident or 0})
            if self._comm.ddp_ready_ns > self._step_start_ns:
                mark_reducer_wait(stacks, MAX_FRAMES)
        body: dict[str, Any] = {"step": self._step, "since_step_s": round(since, 3), "dropped": self.dropped,
                                "world_size": self.identity.world_size, "local_rank": self.identity.local_rank,
                                "stacks": stacks}
        cpu = self.train_cpu.read()
        if cpu is not None:
            body["cpu"] = list(cpu)
        return body

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            leave_profiler()
            try:
                self._send_beat()
            except Exception as e:  # keep the thread alive whatever happens
                log.debug("heartbeat failed: %s", e)

    def _collective_loop(self) -> None:
        """Read the recorder at each multiple of ``coll_read_s`` of wall time: every rank then reads
        at about the same moment, so their rings hold about the same collectives, however fast they
        come (a ring holds the newest ``coll_ring``)."""
        log_ = self._collectives
        period = read_period_s(os.environ, self.settings.coll_ring, self.settings.coll_read_s)
        while log_ is not None and not log_.off_reason:
            now_s = self.clock.wall_ns() / 1e9
            if self._stop.wait((int(now_s / period) + 1) * period - now_s):
                return
            log_.collect()

    def _atexit(self) -> None:
        self.close("completed" if self._step >= 0 else "atexit")

    def _excepthook(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close_on_exception(exc_type, exc, tb)
        finally:
            self._prev_excepthook(exc_type, exc, tb)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """Send a ``signal`` exit record, then die of SIGTERM. A SIGTERM that interrupts a close under
        way (the launcher stopping the ranks while this one sends the exit record of its exception)
        lets that close finish first, then dies: the record says what this rank died of."""
        if self._closed and not self._close_done:
            self._sigterm_pending = True
            return
        self.close("signal", "SIGTERM")
        self._die_of_sigterm()

    @staticmethod
    def _die_of_sigterm() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
