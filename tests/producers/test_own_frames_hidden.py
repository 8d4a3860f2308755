"""No frame of rankscope's own code in the user's stacks, stack groups or flame graphs.

Real threads blocked inside rankscope's real wrappers (producers/collectives.py), read with the
watchdog's own stack reader; the processors' reading of older stacks; the flame graph's folding.
"""

from __future__ import annotations

import threading

import pandas as pd

from rankscope.dashboard import flame
from rankscope.own_frames import is_own_frame
from rankscope.producers import collectives
from rankscope.producers.stacks import all_thread_stacks, is_own
from rankscope.stream_processors.stacks import main_stack, user_frames, waiting_in_collective


def user_code_waits_in_a_collective(release: threading.Event, entered: threading.Event) -> None:
    def fake_torch_collective() -> None:   # stands for torch's C++ call: no torch frame follows
        entered.set()
        release.wait(60)

    collectives._wrap(fake_torch_collective)()


def test_a_thread_blocked_in_a_wrapper_shows_user_frames_and_a_neutral_collective_frame() -> None:
    release, entered = threading.Event(), threading.Event()
    t = threading.Thread(target=user_code_waits_in_a_collective, args=(release, entered), name="user-train")
    t.start()
    try:
        assert entered.wait(30)
        stacks = {s["thread"]: s["frames"] for s in all_thread_stacks()}
    finally:
        release.set()
        t.join(30)
    frames = stacks["user-train"]
    assert not [f for f in frames if is_own_frame(f) or "collectives.py" in f], frames
    assert any(f.endswith(" user_code_waits_in_a_collective") for f in frames), frames
    assert "torch.distributed collective" in frames
    assert any(f.endswith(" fake_torch_collective") for f in frames)
    assert waiting_in_collective(user_frames(frames))
    for s in stacks.values():   # no thread shows rankscope's code, whoever runs it
        assert not [f for f in s if is_own_frame(f)], s


def test_rankscopes_own_threads_are_left_out_and_the_main_thread_stays() -> None:
    mine, users = threading.Event(), threading.Event()
    # Only rankscope's code and the stdlib: the wrapper waits in threading.Event.wait.
    own = threading.Thread(target=collectives._wrap(mine.wait), args=(60,), name="rankscope-like")

    def user_loop() -> None:
        users.wait(60)

    user = threading.Thread(target=user_loop, name="user-loader")
    own.start()
    user.start()
    try:
        names = wait_for_threads({"user-loader"})
    finally:
        mine.set()
        users.set()
        own.join(30)
        user.join(30)
    assert "MainThread" in names and "user-loader" in names
    assert "rankscope-like" not in names


def wait_for_threads(expected: set[str]) -> list[str]:
    """Thread names of all_thread_stacks once ``expected`` are among them (threads start asynchronously)."""
    import time

    deadline = time.monotonic() + 30
    while True:
        names = [s["thread"] for s in all_thread_stacks()]
        if expected <= set(names) or time.monotonic() > deadline:
            return names
        time.sleep(0.05)


def test_processors_drop_wrapper_frames_of_older_stacks_and_keep_the_wait() -> None:
    old = ["train.py:10 <module>", "train.py:42 train",
           "producers/collectives.py:50 _rankscope_timed_collective",
           "torch/distributed/c10d_logger.py:81 wrapper"]
    assert user_frames(old) == ["train.py:10 <module>", "train.py:42 train",
                                "torch/distributed/c10d_logger.py:81 wrapper"]
    wait = ["train.py:10 <module>", "train.py:50 train", "producers/collectives.py:104 _rankscope_timed_wait"]
    assert user_frames(wait) == ["train.py:10 <module>", "train.py:50 train", "torch.distributed Work.wait"]
    assert waiting_in_collective(user_frames(wait)) and waiting_in_collective(user_frames(old))
    assert main_stack([{"thread": "MainThread", "frames": wait}])[-1] == "torch.distributed Work.wait"
    assert not waiting_in_collective(user_frames(["train.py:20 hang_forever",
                                                  "producers/step_hooks.py:120 _rankscope_step_marker"]))


def test_own_frame_names_in_every_form() -> None:
    for name in ("producers/collectives.py(54): _rankscope_timed_collective", "/opt/x/producers/tracer.py(9): step",
                 "producers/tracer.py:9 step", "_rankscope_step_marker", "/srv/cli/__init__.py(3): main"):
        assert is_own_frame(name), name
    for name in ("train.py(3): main", "/src/rankscope/demo/train.py(40): train_step", "storage/io.py(1): load",
                 "torch/nn/modules/module.py(1501): _call_impl", "forward"):
        assert not is_own_frame(name), name
    assert is_own(collectives.__file__) and not is_own(__file__)


def ev(name: str, start: int, dur: int) -> dict:
    return {"rank": 0, "name": name, "start_ns": start, "dur_ns": dur, "attrs": {"tid": 1}, "stream": -1}


def test_flame_graph_folds_rankscope_frames_into_the_users_call() -> None:
    events = pd.DataFrame([
        ev("train.py(10): main", 0, 1000),
        ev("train.py(40): train_step", 0, 1000),
        ev("producers/tracer.py(200): step", 0, 100),                                  # the step hook
        ev("train.py(42): sync_grads", 200, 800),
        ev("producers/collectives.py(54): _rankscope_timed_collective", 210, 790),    # wrapper
        ev("torch/distributed/distributed_c10d.py(2806): all_reduce", 220, 780),
    ])
    tree = flame.call_tree(events)
    for path in tree["path"]:
        assert not [n for n in path if is_own_frame(n)], path
    node = {tuple(p[1:]): (t, s, c) for p, t, s, c in zip(tree["path"], tree["total_ns"], tree["self_ns"],
                                                          tree["calls"], strict=True)}
    step = ("train.py(10): main", "train.py(40): train_step")
    sync = (*step, "train.py(42): sync_grads")
    assert node[(*sync, "torch/distributed/distributed_c10d.py(2806): all_reduce")] == (780, 780, 1)
    assert node[sync] == (800, 20, 1)            # its own 10 ns + the wrapper's 10 ns
    assert node[step] == (1000, 200, 1)          # its own 100 ns + the step hook's 100 ns, one call
    assert node[()][0] == 1000                   # nothing lost
    lay = flame.icicle(tree)
    assert not [n for n in lay["name"] if is_own_frame(n)]
