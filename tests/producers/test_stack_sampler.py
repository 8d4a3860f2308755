"""The always-on stack sampler: real threads sampled in this process, folded into the ``profile``
body that the decoding boundary accepts, rankscope's own threads and frames left out."""

from __future__ import annotations

import os
import threading
import time

import msgpack
import pytest

from rankscope.producers.stack_sampler import StackFolder, StackSampler
from rankscope.protocol.envelope import Envelope, decode, encode
from rankscope.protocol.profile import MAX_ROWS, rows, validate


def spin_in_hot_function(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(200))


def sample(sampler: StackSampler, n: int) -> None:
    for _ in range(n):
        sampler.sample_once()
        time.sleep(0.002)


def test_a_busy_thread_shows_as_its_call_path_under_its_role_and_the_body_passes_the_boundary() -> None:
    sent: list[tuple[str, dict]] = []
    stop = threading.Event()
    trainer = threading.Thread(target=spin_in_hot_function, args=(stop,), name="trainer")
    worker = threading.Thread(target=spin_in_hot_function, args=(stop,), name="user-worker")
    own = threading.Thread(target=spin_in_hot_function, args=(stop,), name="rankscope-heartbeat")
    sampler = StackSampler(20.0, 10.0, lambda k, b, pid: sent.append((k, b)), lambda: trainer.ident, time.time_ns)
    for t in (trainer, worker, own):
        t.start()
    try:
        sample(sampler, 30)
    finally:
        stop.set()
        for t in (trainer, worker, own):
            t.join()
    sampler.flush()
    assert [k for k, _ in sent] == ["profile"]
    body = sent[0][1]
    env = decode(encode(Envelope("profile", "j", 0, "h", 1, 1, time.time_ns(), body)))
    got = rows(validate(env.body))
    assert body["ticks"] == 30
    label = f"producers/test_stack_sampler.py:{spin_in_hot_function.__code__.co_firstlineno} spin_in_hot_function"
    hot = [(role, n) for role, path, n in got if label in path.split(";")]
    # The training thread and the user's other thread, 30 samples each; the rankscope-named thread
    # running the same code never (the sampling thread, here the test's, neither).
    by_role: dict[str, int] = {}
    for role, n in hot:
        by_role[role] = by_role.get(role, 0) + n
    assert by_role == {"other": 30, "training": 30}, got
    assert sum(n for _, _, n in got) == 60
    assert not any("producers/stack_sampler.py" in p for _, p, _ in got)   # rankscope's own frames left out


def test_a_message_keeps_the_most_sampled_paths_within_its_byte_budget_and_counts_the_rest() -> None:
    folder = StackFolder()
    frames = []

    def make(i: int):   # a distinct code object (and call path) per i
        ns: dict = {}
        exec(compile(f"def fn_{i}():\n    import sys\n    return sys._getframe()\n", f"/user/mod_{i}.py", "exec"), ns)
        return ns[f"fn_{i}"]()

    for i in range(600):
        frames.append(make(i))
    for i, f in enumerate(frames):
        for _ in range(1 + i % 7):
            folder.add(3, f)
    total = folder.counts.total()
    body = folder.take(1, 10**10, 20.0, max_bytes=20480)
    assert body is not None and len(msgpack.packb(body)) <= 20480
    p = validate(body)
    assert 0 < len(p.path) <= MAX_ROWS
    kept = sorted(p.count, reverse=True)
    assert sum(p.count) + sum(p.other) == total           # nothing lost: the rest is "other"
    assert min(kept) >= max(1 + i % 7 for i in range(600)) - 6   # the most sampled paths come first
    assert folder.take(1, 2, 20.0, 20480) is None          # a fresh interval


def test_the_sampler_thread_sends_each_interval_and_the_rest_at_stop(tmp_path) -> None:
    sent: list[dict] = []
    sampler = StackSampler(200.0, 0.2, lambda k, b, pid: sent.append(b), lambda: None, time.time_ns,
                           cache_dir=str(tmp_path)).start()
    deadline = time.monotonic() + 60
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    while sampler.folder.ticks == 0 and time.monotonic() < deadline:   # something sampled since the last send
        time.sleep(0.005)
    with sampler._lock:
        before = len(sent)
    sampler.stop()
    assert before >= 2 and len(sent) in (before + 1, before + 2), sent   # the interval so far, at stop
    assert all(b["t0_ns"] <= b["t1_ns"] for b in sent)
    assert all(a["t1_ns"] == b["t0_ns"] for a, b in zip(sent, sent[1:], strict=False))   # intervals abut
    assert not any(t.name == "rankscope-profile" and t.is_alive() for t in threading.enumerate())


class SlowItems:
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        return decode_slowly(i)


def decode_slowly(i: int) -> int:
    """0.1 s of this thread's CPU: on a starved machine it lasts longer, and the sampler (a thread of
    the same process, waking at its rate while the process runs) sees about as many samples of it."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.1:
        pass
    return i


def test_forked_dataloader_workers_are_sampled_and_sent_by_the_parent_under_their_pids(tmp_path) -> None:
    from torch.utils.data import DataLoader

    from rankscope.producers import stack_walk

    stack_walk.build(tmp_path)      # as `rankscope build-native` leaves it: loaded at start, inherited by the workers
    sent: list[tuple[dict, int | None]] = []
    sampler = StackSampler(50.0, 0.3, lambda k, b, pid: sent.append((b, pid)), lambda: None, time.time_ns,
                           workers=True, cache_dir=str(tmp_path)).start()
    try:
        got = [int(x) for x in DataLoader(SlowItems(), batch_size=None, num_workers=2,
                                          multiprocessing_context="fork")]
        deadline = time.monotonic() + 60     # the workers' last intervals, sent as they exit
        while time.monotonic() < deadline and len({pid for _, pid in sent if pid is not None}) < 2:
            time.sleep(0.05)
    finally:
        sampler.stop()
    assert sorted(got) == list(range(12))
    workers = [(b, pid) for b, pid in sent if pid is not None]
    assert len({pid for _, pid in workers}) == 2 and all(pid != os.getpid() for _, pid in workers)
    seen = [(role, path, n) for b, _ in workers for role, path, n in rows(validate(b))]
    slow = sum(n for role, path, n in seen if role == "dataloader" and path.endswith(" decode_slowly"))
    assert slow >= 10, seen                   # ~0.6 s of it in each worker, at 50 Hz
    assert not any("decode_slowly" in path for b, pid in sent if pid is None for _, path, _ in rows(validate(b)))


def test_the_c_walker_sees_what_a_python_walk_sees_and_skips_what_it_is_told(tmp_path) -> None:
    """producers/native/stack_walk.c walks every other thread while holding the GIL: the same code
    objects, innermost first, as f_back gives; rankscope's own threads are left out by ident."""
    from rankscope.producers import stack_walk

    stack_walk.build(tmp_path)
    walker = stack_walk.load(tmp_path)
    assert walker is not None and walker.ABI == stack_walk.ABI
    stop = threading.Event()
    busy = threading.Thread(target=spin_in_hot_function, args=(stop,), daemon=True)
    busy.start()
    try:
        time.sleep(0.05)
        sampled = walker.sample(set())
        assert all(ids == tuple(id(c) for c in codes) for _, codes, ids in sampled)   # each stack's key
        got = {tid: codes for tid, codes, _ in sampled}
        import sys

        frame = sys._current_frames()[busy.ident]
        python: list = []
        while frame is not None:
            python.append(frame.f_code)
            frame = frame.f_back
        assert [c.co_name for c in got[busy.ident]][-3:] == [c.co_name for c in python][-3:]
        assert "spin_in_hot_function" in [c.co_name for c in got[busy.ident]]
        assert threading.get_ident() not in got                 # the calling (sampler) thread
        assert busy.ident not in {tid for tid, _, _ in walker.sample({busy.ident})}
        with pytest.raises(TypeError):
            walker.sample([busy.ident])
    finally:
        stop.set()
        busy.join()


def test_the_sampler_with_the_c_walker_folds_the_same_call_paths(tmp_path) -> None:
    from rankscope.producers import stack_walk

    sent: list = []
    stop = threading.Event()
    trainer = threading.Thread(target=spin_in_hot_function, args=(stop,), daemon=True)
    trainer.start()
    sampler = StackSampler(20.0, 10.0, lambda k, b, pid: sent.append((k, b)), lambda: trainer.ident, time.time_ns,
                           cache_dir=str(tmp_path))
    try:
        assert sampler._find_walker() and sampler.walker is not None
        assert sampler.walker is stack_walk.load(tmp_path) or sampler.walker.ABI == stack_walk.ABI
        sample(sampler, 30)
    finally:
        stop.set()
        trainer.join()
    sampler.flush()
    [(kind, body)] = sent
    got = rows(validate(body))
    label = f"producers/test_stack_sampler.py:{spin_in_hot_function.__code__.co_firstlineno} spin_in_hot_function"
    assert sum(n for role, path, n in got if role == "training" and label in path.split(";")) == 30, got


def test_without_the_c_walker_sampling_is_off_and_says_why(caplog) -> None:
    sampler = StackSampler(20.0, 10.0, lambda k, b, pid: None, lambda: None, time.time_ns)
    with caplog.at_level("WARNING", logger="rankscope.profile"):
        assert not sampler._find_walker()
    assert "stack sampling off: the C stack walker is not built" in caplog.text


def test_the_c_walker_survives_threads_that_come_and_go_beside_profiler_windows(tmp_path) -> None:
    """The torture that crashed a Python walk of the stacks (SIGSEGV in f_back, CPython 3.11, within
    seconds in each of four runs here): threads started and ended all the time, deep recursion
    through torch ops and generators, torch.profiler windows with Python stacks opening and closing,
    and a sampler at 500 Hz. With the C walker the process samples to the end and exits cleanly."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "stack_walk_torture.py"
    out = subprocess.run([sys.executable, "-X", "faulthandler", str(script), "c", "10", str(tmp_path), "20", "500"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("survived")][-1]
    fields = dict(kv.split("=") for kv in line.split()[2:])
    assert int(fields["samples"]) > 500 and int(fields["windows"]) > 20, line
