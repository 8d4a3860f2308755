"""Step sources of the attach path, the attach rules, and the exception exit record (no broker)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rankscope.config import ConfigError, Settings
from rankscope.producers.attach import ATTACHED_PID, attach_env, boot_dir, should_attach
from rankscope.producers.step_hooks import OptimizerSteps, StepMarker
from rankscope.producers.tracer import Tracer
from rankscope.protocol.envelope import decode


class Recording:
    dropped = 0

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, _topic: str, _key: bytes, value: bytes) -> bool:
        self.sent.append(value)
        return True

    def close(self, timeout_s: float) -> None:
        pass

    def exits(self) -> list:
        return [m for m in map(decode, self.sent) if m.kind == "exit"]


def make_tracer() -> tuple[Tracer, Recording]:
    t = Recording()
    return Tracer(Settings(job_id="j", hw_sample_s=0, control_enabled=False, heartbeat_s=60, ddp_autodetect=False),
                  transport=t, install_collective_timing=False, handle_signals=False), t


def train(opts: list[torch.optim.Optimizer], models: list[torch.nn.Module], iterations: int) -> None:
    for _ in range(iterations):
        for m, o in zip(models, opts, strict=True):
            o.zero_grad()
            m(torch.randn(2, 4)).sum().backward()
            o.step()


def test_two_optimizers_make_one_step_per_iteration() -> None:
    steps: list[int] = []
    counter = OptimizerSteps(lambda: steps.append(1))
    assert counter.install()
    try:
        models = [torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)]
        opts: list[torch.optim.Optimizer] = [torch.optim.SGD(models[0].parameters(), lr=0.1),
                                             torch.optim.Adam(models[1].parameters(), lr=0.1)]
        train(opts, models, 5)
        assert len(steps) == 5
    finally:
        counter.remove()
    train(opts, models, 2)
    assert len(steps) == 5          # removed: no more steps


def test_a_new_optimizer_leads_once_the_first_is_gone() -> None:
    steps: list[int] = []
    counter = OptimizerSteps(lambda: steps.append(1))
    counter.install()
    try:
        model = torch.nn.Linear(4, 1)
        first = torch.optim.SGD(model.parameters(), lr=0.1)
        train([first], [model], 2)
        del first
        import gc

        gc.collect()
        train([torch.optim.SGD(model.parameters(), lr=0.1)], [model], 3)
        assert len(steps) == 5
    finally:
        counter.remove()


def test_optimizer_steps_end_tracer_steps() -> None:
    tracer, t = make_tracer()
    counter = OptimizerSteps(tracer.step)
    counter.install()
    try:
        model = torch.nn.Linear(4, 1)
        train([torch.optim.SGD(model.parameters(), lr=0.1)], [model], 3)
    finally:
        counter.remove()
    assert tracer.current_step == 2
    tracer.close()


@pytest.fixture
def marker_module(tmp_path: Path) -> str:
    name = "rankscope_marker_mod_for_test"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        def train_step(x):
            return x + 1

        class Loop:
            def step(self):
                return 2

            @staticmethod
            def fixed():
                return 3

        def loop(n):
            return [train_step(i) for i in range(n)]
    """))
    sys.path.insert(0, str(tmp_path))
    try:
        yield name
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def test_step_marker_wraps_a_function_when_its_module_is_imported(marker_module: str) -> None:
    import importlib

    steps: list[int] = []
    marker = StepMarker(f"{marker_module}:train_step", lambda: steps.append(1))
    marker.install()
    assert not marker.wrapped and marker_module not in sys.modules
    mod = importlib.import_module(marker_module)
    assert marker.wrapped
    assert mod.loop(4) == [1, 2, 3, 4]           # calls from inside the module count too
    assert len(steps) == 4
    marker.remove()


def test_step_marker_wraps_methods_of_an_imported_module(marker_module: str) -> None:
    import importlib

    mod = importlib.import_module(marker_module)
    steps: list[int] = []
    StepMarker(f"{marker_module}:Loop.step", lambda: steps.append(1)).install()
    StepMarker(f"{marker_module}:Loop.fixed", lambda: steps.append(2)).install()
    assert mod.Loop().step() == 2 and mod.Loop.fixed() == 3 and mod.Loop().fixed() == 3
    assert steps == [1, 2, 2]


def test_a_bad_step_marker_is_refused_by_the_settings() -> None:
    with pytest.raises(ConfigError, match="step_marker"):
        Settings(step_marker="train_step")
    assert Settings(step_marker="pkg.loop:Trainer.step").step_marker == "pkg.loop:Trainer.step"


def test_only_ranks_that_no_attached_ancestor_made_are_attached() -> None:
    on = {"RANKSCOPE_ATTACH": "1"}
    assert not should_attach({}, 10)
    assert not should_attach(on, 10)                                   # the torchrun launcher: no RANK
    assert should_attach({**on, "RANK": "3"}, 10)
    assert should_attach({**on, "RANKSCOPE_RANK": "0"}, 10)             # another launcher, rank set by hand
    assert not should_attach({**on, "RANK": "3", ATTACHED_PID: "9"}, 10)   # a spawned DataLoader worker
    assert should_attach({**on, "RANK": "3", ATTACHED_PID: "10"}, 10)      # the rank itself, re-exec'd
    env = attach_env({"PYTHONPATH": "/a:/b"})
    assert env["PYTHONPATH"].split(":") == [boot_dir(), "/a", "/b"]
    assert (Path(boot_dir()) / "sitecustomize.py").is_file()


def failing_step() -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_an_exception_exit_carries_its_type_and_frames() -> None:
    tracer, t = make_tracer()
    tracer.step()
    with pytest.raises(RuntimeError), tracer:
        failing_step()
    (exit_,) = t.exits()
    body = exit_.body
    assert body["reason"] == "exception" and body["step"] == 0
    assert body["detail"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert body["exc_type"] == "RuntimeError"
    assert body["frames"][0].endswith("test_an_exception_exit_carries_its_type_and_frames")
    assert body["frames"][-1].endswith("failing_step") and "test_step_hooks.py:" in body["frames"][-1]


class StepFailed(Exception):
    pass


def test_the_excepthook_records_a_qualified_type_and_at_most_48_frames() -> None:
    def deep(n: int) -> None:
        if n == 0:
            raise StepFailed("boom")
        deep(n - 1)

    tracer, t = make_tracer()
    seen: list[type] = []
    tracer._prev_excepthook = lambda et, e, tb: seen.append(et)
    try:
        deep(100)
    except StepFailed:
        tracer._excepthook(*sys.exc_info())
    (exit_,) = t.exits()
    assert exit_.body["exc_type"] == f"{__name__}.StepFailed"
    assert len(exit_.body["frames"]) == 48
    assert all(f.endswith(" deep") for f in exit_.body["frames"])   # the innermost frames are kept
    assert seen == [StepFailed]


def test_a_normal_exit_has_no_exception_fields() -> None:
    tracer, t = make_tracer()
    tracer.close()
    (exit_,) = t.exits()
    assert exit_.body["reason"] == "completed" and "exc_type" not in exit_.body and "frames" not in exit_.body


def test_startup_before_the_first_step_is_not_a_step_nor_a_stall() -> None:
    from rankscope.clock import ManualClock

    clock = ManualClock()
    t = Recording()
    tracer = Tracer(Settings(job_id="j", hw_sample_s=0, control_enabled=False, heartbeat_s=60, ddp_autodetect=False,
                             stall_stack_min_s=3), clock=clock, transport=t, install_collective_timing=False,
                    handle_signals=False)
    tracer.defer_first_step()
    clock.advance(30.0)                      # imports, rendezvous, checkpoint loading
    body = tracer.heartbeat_body()
    assert body["step"] == -1 and body["since_step_s"] == 0.0 and body["stacks"] is None
    tracer.step()                            # the first optimizer step ends step 0, without a record
    assert tracer.current_step == 0
    clock.advance(0.5)
    tracer.step()
    clock.advance(4.0)
    body = tracer.heartbeat_body()
    assert body["step"] == 1 and body["since_step_s"] == 4.0 and body["stacks"]
    tracer.close()
    beats = [m for m in map(decode, t.sent) if m.kind == "beat"]
    starts = [s for m in beats for s in m.body["start_ns"]]
    ends = [e for m in beats for e in m.body["end_ns"]]
    assert [s for m in beats for s in m.body["step"]] == [1]
    assert ends[0] - starts[0] == 500_000_000


def _python(code: str, env: dict[str, str]) -> str:
    import os
    import subprocess

    base = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_") and k not in ("RANK", "PYTHONPATH")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_boot_hook_attaches_a_rank_only_and_runs_the_sitecustomize_it_hides(tmp_path: Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import os\nos.environ['HIDDEN_SITECUSTOMIZE_RAN'] = '1'\n")
    env = {**attach_env({"PYTHONPATH": str(hidden)}), "RANKSCOPE_BOOTSTRAP_SERVERS": "127.0.0.1:1",
           "RANKSCOPE_CONTROL_ENABLED": "false", "RANKSCOPE_HW_SAMPLE_S": "0", "RANKSCOPE_FLUSH_TIMEOUT_S": "0.5"}
    probe = ("import os, sys, rankscope.producers.attach as a; t = a._attached.get('tracer'); "
             "print(os.environ.get('HIDDEN_SITECUSTOMIZE_RAN'), t is not None, "
             "os.environ.get('RANKSCOPE_ATTACHED_PID') == str(os.getpid()), 'torch' in sys.modules)")
    assert _python(probe, {**env, "RANK": "0", "WORLD_SIZE": "1"}) == "1 True True True"
    assert _python(probe, env) == "1 False False False"                       # a launcher: no RANK
    assert _python(probe, {**env, "RANK": "0", "RANKSCOPE_ATTACHED_PID": "1"}) == "1 False False False"
    assert _python(probe, {**env, "RANK": "0", "RANKSCOPE_ATTACH": "0"}) == "1 False False False"
