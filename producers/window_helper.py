"""A helper process per rank that converts trace windows, so that the rank's GIL is not held for it.

Why: after the C++ reader (which releases the GIL) a window still needs columns, call paths,
exclusive times, a per-function summary and packed chunks: ~2.5 µs of numpy and Python per event
on the sender thread, and every millisecond of it holding the GIL is a millisecond the training
thread may wait (DDP lockstep then makes every rank wait). The helper does that work in its own
interpreter, at a lower CPU priority (``trace_helper_nice``), and hands the finished message bodies
back; the rank only packs the raw columns into one pipe write and produces the bodies it gets
back (librdkafka, off the GIL). Measured on a 2-rank DDP job: the rank's thread spends 5.7 instead
of 10.9 ms per window, the helper 10 ms more, so it is off by default (setting ``trace_helper``) and
pays only where a Python-bound training thread has idle cores beside it.

Protocol (the helper's stdin/stdout, private to one rank and its child): frames of a 4-byte
little-endian length and a msgpack map. Request ``{"v": 1, "id", "window_id", "first_step",
"budget", "status", "raw": pack_raw(...)}``; answer ``{"v": 1, "id", "ok": true, "traces",
"summary", "sent", "truncated"}`` or ``{"v": 1, "id", "ok": false, "error"}``. A bad request gets
an error answer and the helper keeps serving; EOF on stdin (the rank exited or died) ends it.

Failure handling on the rank (:class:`HelperProcess`): a helper that cannot start, dies, answers
garbage or takes longer than ``timeout_s`` is stopped, logged once, and the window (and every
later one) is converted on the sender thread instead: a window is never lost to the helper.
"""

from __future__ import annotations

import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import msgpack

from producers.trace_extract import RawEvents
from producers.trace_window import ConvertedWindow, convert_window

log = logging.getLogger("rankscope.trace")

PROTOCOL = 1
MAX_FRAME = 1 << 30
_LEN = struct.Struct("<I")


class ProtocolError(ValueError):
    pass


# --------------------------------------------------------------------------------------------
# RawEvents on the pipe
# --------------------------------------------------------------------------------------------

def pack_raw(raw: RawEvents) -> dict[str, Any]:
    import numpy as np

    def group(g: dict[str, Any]) -> dict[str, bytes]:
        return {c: np.asarray(v, dtype=np.int64).tobytes() for c, v in g.items()}

    return {"offset_ns": int(raw.offset_ns), "names": raw.names, "py": group(raw.py), "host": group(raw.host),
            "dev": group(raw.dev), "host_attrs": [[k, a] for k, a in raw.host_attrs.items()],
            "dev_attrs": [[k, a] for k, a in raw.dev_attrs.items()]}


def unpack_raw(d: Any) -> RawEvents:
    """Inverse of :func:`pack_raw`; raises ProtocolError on anything malformed."""
    import numpy as np

    if not isinstance(d, dict):
        raise ProtocolError(f"raw is {type(d).__name__}, not a map")
    names, offset = d.get("names"), d.get("offset_ns")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or not isinstance(offset, int):
        raise ProtocolError("raw needs names (list of str) and offset_ns (int)")
    out = RawEvents(offset)
    out.names = names
    out.name_index = {n: i for i, n in enumerate(names)}
    for key, columns, attrs_key in (("py", RawEvents.PY, None), ("host", RawEvents.HOST, "host_attrs"),
                                    ("dev", RawEvents.DEV, "dev_attrs")):
        g = d.get(key)
        if not isinstance(g, dict) or set(g) != set(columns):
            raise ProtocolError(f"raw.{key} must have exactly the columns {columns}")
        arrays = {}
        for c in columns:
            b = g[c]
            if not isinstance(b, bytes) or len(b) % 8:
                raise ProtocolError(f"raw.{key}.{c} is not packed int64")
            arrays[c] = np.frombuffer(b, dtype=np.int64)
        lengths = {len(a) for a in arrays.values()}
        if len(lengths) != 1:
            raise ProtocolError(f"raw.{key} columns differ in length: {sorted(lengths)}")
        getattr(out, key).update(arrays)
        names_col = arrays["name"]
        if len(names_col) and (names_col.min() < 0 or names_col.max() >= len(names)):
            raise ProtocolError(f"raw.{key}.name indexes outside the {len(names)} names")
        if attrs_key is not None:
            pairs = d.get(attrs_key)
            n = lengths.pop()
            if not isinstance(pairs, list) or not all(
                    isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and 0 <= p[0] < n
                    and (p[1] is None or isinstance(p[1], dict)) for p in pairs):
                raise ProtocolError(f"raw.{attrs_key} must be [[row, attrs map or nil], ...] within the group")
            getattr(out, attrs_key).update((r, a) for r, a in pairs)
    return out


def read_frame(stream: IO[bytes]) -> bytes | None:
    head = stream.read(4)
    if not head:
        return None
    if len(head) < 4:
        raise ProtocolError("truncated frame header")
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes is over the {MAX_FRAME}-byte limit")
    data = stream.read(n)
    if len(data) < n:
        raise ProtocolError(f"truncated frame: {len(data)} of {n} bytes")
    return bytes(data)


def write_frame(stream: IO[bytes], payload: bytes) -> None:
    stream.write(_LEN.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def serve_request(frame: bytes) -> dict[str, Any]:
    """One request frame -> its answer map (never raises)."""
    rid: Any = None
    try:
        req = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        if not isinstance(req, dict):
            raise ProtocolError(f"request is {type(req).__name__}, not a map")
        rid = req.get("id")
        if req.get("v") != PROTOCOL:
            raise ProtocolError(f"unknown protocol version {req.get('v')!r} (this helper speaks {PROTOCOL})")
        window_id, first_step, budget, status = (req.get(k) for k in ("window_id", "first_step", "budget", "status"))
        if not (isinstance(window_id, str) and isinstance(first_step, int) and isinstance(budget, int)
                and budget > 0 and isinstance(status, str)):
            raise ProtocolError("request needs window_id (str), first_step (int), budget (int > 0), status (str)")
        out = convert_window(unpack_raw(req.get("raw")), window_id, first_step, budget, status)
    except Exception as e:
        return {"v": PROTOCOL, "id": rid, "ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"v": PROTOCOL, "id": rid, "ok": True, "traces": out.traces, "summary": out.summary, "sent": out.sent,
            "truncated": out.truncated}


def main(argv: list[str] | None = None) -> int:
    """The helper process: serve requests from stdin until EOF."""
    args = sys.argv[1:] if argv is None else argv
    if args:
        try:
            os.nice(int(args[0]))
        except (ValueError, OSError):
            pass
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr          # nothing but frames on the pipe
    while True:
        try:
            frame = read_frame(stdin)
        except ProtocolError as e:
            print(f"rankscope window helper: {e}; exiting", file=sys.stderr)
            return 1
        if frame is None:
            return 0
        write_frame(stdout, msgpack.packb(serve_request(frame), use_bin_type=True))


# --------------------------------------------------------------------------------------------
# The rank's side
# --------------------------------------------------------------------------------------------

class HelperProcess:
    """The rank's handle on its helper. ``convert`` returns None whenever the helper is unusable,
    and the caller converts in-thread; after the first failure the helper is not used again."""

    def __init__(self, nice: int = 10, timeout_s: float = 60.0, python: str = sys.executable) -> None:
        self.nice, self.timeout_s, self.python = nice, timeout_s, python
        self.started = False
        self.failed: str | None = None
        self.windows_converted = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._next_id = 0
        self.last_cpu_s: dict[str, float] = {}   # the rank's CPU seconds per part of the last exchange

    def start(self) -> bool:
        with self._lock:
            if self.started:
                return self._proc is not None
            self.started = True
            root = str(Path(__file__).resolve().parent.parent)
            env = dict(os.environ)
            env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            try:
                self._proc = subprocess.Popen([self.python, "-m", "producers.window_helper", str(self.nice)],
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=root,
                                              close_fds=True)
            except Exception as e:          # OSError, or a bad executable / environment
                self._fail(f"cannot start: {e}")
                return False
            return True

    def _fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            log.warning("rankscope: trace window helper %s; converting windows on the sender thread", why)
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.kill()
                proc.wait(5)
            except Exception:
                pass

    def convert(self, raw: RawEvents, window_id: str, first_step: int, budget: int,
                status: str) -> ConvertedWindow | None:
        if not self.started:
            self.start()
        proc = self._proc
        if proc is None or self.failed is not None:
            return None
        assert proc.stdin is not None and proc.stdout is not None
        self._next_id += 1
        rid = self._next_id
        c0 = time.thread_time()
        try:
            payload = msgpack.packb({"v": PROTOCOL, "id": rid, "window_id": window_id, "first_step": first_step,
                                     "budget": budget, "status": status, "raw": pack_raw(raw)}, use_bin_type=True)
        except Exception as e:      # this window does not pack (odd attrs?): convert it in-thread
            log.debug("rankscope: window %s not sent to the helper: %s", window_id, e)
            return None
        try:
            c1 = time.thread_time()
            write_frame(proc.stdin, payload)
            c2 = time.thread_time()
            answer = self._read_answer(proc.stdout, time.monotonic() + self.timeout_s)
            c3 = time.thread_time()
            self.last_cpu_s = {"pack": c1 - c0, "write": c2 - c1, "read_unpack": c3 - c2}
        except Exception as e:      # broken pipe, exited, timed out, garbage on the pipe
            self._fail(f"failed ({type(e).__name__}: {e})")
            return None
        if not isinstance(answer, dict) or answer.get("v") != PROTOCOL or answer.get("id") != rid:
            self._fail("answered out of protocol")
            return None
        if not answer.get("ok"):
            # The helper is fine; this window is not (it would fail in-thread too, with the same error).
            raise ValueError(f"window {window_id} could not be converted: {answer.get('error')}")
        traces, summary, sent, truncated = (answer.get(k) for k in ("traces", "summary", "sent", "truncated"))
        if not (isinstance(traces, list) and isinstance(summary, dict) and isinstance(sent, int)
                and isinstance(truncated, int)):
            self._fail("answered a malformed window")
            return None
        self.windows_converted += 1
        return ConvertedWindow(traces, summary, sent, truncated, by_helper=True)

    def _read_answer(self, stream: IO[bytes], deadline: float) -> Any:
        fd = stream.fileno()
        buf = bytearray()
        need = 4
        while len(buf) < need:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"no answer within {self.timeout_s:g} s")
            chunk = os.read(fd, max(need - len(buf), 1 << 16))
            if not chunk:
                raise OSError("helper exited")
            buf += chunk
            if need == 4 and len(buf) >= 4:
                (n,) = _LEN.unpack_from(buf)
                if n > MAX_FRAME:
                    raise ValueError(f"answer frame of {n} bytes")
                need = 4 + n
        if len(buf) != need:
            raise ValueError("helper wrote more than one answer")
        return msgpack.unpackb(bytes(buf[4:]), raw=False, strict_map_key=False)

    def cpu_seconds(self) -> float:
        """CPU (user + system) the helper process has used so far (0 when not running)."""
        proc = self._proc
        if proc is None:
            return 0.0
        try:
            import psutil

            t = psutil.Process(proc.pid).cpu_times()
            return float(t.user + t.system)
        except Exception:
            return 0.0

    def rss_bytes(self) -> int:
        """Resident memory of the helper process (0 when not running)."""
        proc = self._proc
        if proc is None:
            return 0
        try:
            import psutil

            return int(psutil.Process(proc.pid).memory_info().rss)
        except Exception:
            return 0

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(5)
        except Exception:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
