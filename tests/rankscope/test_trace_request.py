"""One trace command for every sender: the CLI and the dashboard send the same control message
(same bounds, same start step, same period) for the same request and the same job progress."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import uuid

import pytest
from confluent_kafka import Producer

from rankscope.cli.commands.trace import request_from_args
from rankscope.config import Settings
from rankscope.dashboard import control
from rankscope.protocol.envelope import Envelope, decode, encode
from rankscope.protocol.trace import MAX_BYTE_BUDGET, MAX_EVERY_S, MAX_STEPS, CommandError, parse_command
from rankscope.topics import Topic
from rankscope.trace_request import Plan, TraceRequest, control_body, encode_request, plan
from rankscope.trace_start import START_LEAD_NS
from tests.integration.helpers import REPO, TopicReader, child_env, wait_until

STEP_NS = 100 * 10**9    # a slow step time: a few seconds between the two senders change no plan


def cli_args(**kw) -> argparse.Namespace:
    base = {"job": "j", "ranks": "", "steps": 3, "every": "", "every_steps": 0, "continuous": False, "stop": False,
            "shapes": False, "no_stack": False, "byte_budget": 0}
    return argparse.Namespace(**{**base, **kw})


def progress(now_ns: int, ranks: int = 4) -> list[dict]:
    return [{"rank": r, "step": 100 + r, "ts_ns": now_ns, "median_step_ns": STEP_NS} for r in range(ranks)]


@pytest.mark.parametrize("flags, request_kw", [
    ({}, {}),
    ({"every": "10m", "ranks": "0-1,3"}, {"mode": "every_s", "every_s": 600.0, "ranks": [0, 1, 3]}),
    ({"every_steps": 50, "steps": 5}, {"mode": "every_steps", "every_steps": 50, "steps": 5}),
    ({"continuous": True, "shapes": True, "no_stack": True}, {"mode": "continuous", "with_shapes": True,
                                                              "with_stack": False}),
    ({"stop": True, "ranks": "2"}, {"stop": True, "ranks": [2]}),
])
def test_cli_flags_and_dashboard_fields_make_the_same_message(flags, request_kw):
    now = time.time_ns()
    cli = request_from_args(cli_args(**flags))
    dash = TraceRequest(job="j", request_id=cli.request_id, **request_kw)
    assert cli == dash
    assert encode_request(cli, plan(cli, progress(now), now), now_ns=now) == \
        encode_request(dash, plan(dash, progress(now), now), now_ns=now)


@pytest.mark.parametrize("request_kw", [
    {}, {"mode": "every_s", "every_s": 600.0, "ranks": [0, 3]}, {"mode": "every_steps", "every_steps": 50, "steps": 5},
    {"mode": "continuous", "with_shapes": True, "with_stack": False, "byte_budget": 1 << 20},
    {"steps": MAX_STEPS, "mode": "every_s", "every_s": float(MAX_EVERY_S), "byte_budget": MAX_BYTE_BUDGET},
])
def test_what_senders_send_is_what_ranks_run(request_kw):
    # One contract (rankscope/protocol/trace.py): a request within its bounds is a command every
    # rank accepts, with the same steps, period, start step and options.
    now = time.time_ns()
    req = TraceRequest(job="j", **request_kw)
    p = plan(req, progress(now), now)
    body = control_body(req, p)
    cmd = parse_command(body["request_id"], body["args"], body["ranks"], now)
    assert (cmd.request_id, cmd.steps, cmd.ranks, cmd.with_shapes, cmd.with_stack, cmd.byte_budget) == \
        (req.request_id, req.steps, req.ranks, req.with_shapes, req.with_stack, req.byte_budget)
    assert cmd.start_step == p.start_step and cmd.start_at_ns == now + START_LEAD_NS
    assert cmd.continuous == (req.mode == "continuous")
    assert cmd.every_steps == (p.period_steps if req.mode == "every_s" else req.every_steps)
    # Past a bound, the sender refuses what the rank would refuse.
    for over in ({"steps": MAX_STEPS + 1}, {"byte_budget": MAX_BYTE_BUDGET + 1}):
        with pytest.raises(ValueError):
            TraceRequest(job="j", **over)
        with pytest.raises(CommandError):
            parse_command("r", over, None, now)


def test_plan_starts_every_rank_at_one_step_and_turns_a_time_period_into_steps():
    now = time.time_ns()
    req = TraceRequest(job="j", mode="every_s", every_s=600.0)
    p = plan(req, progress(now), now)
    assert p == Plan(start_step=103 + 1 + 2, period_steps=6)   # furthest rank + 1 + margin; 600 s / 100 s
    args = control_body(req, p)["args"]
    assert args["start_step"] == 106 and args["lead_ns"] == START_LEAD_NS and args["every_steps"] == 6
    assert "every_s" not in args
    assert plan(req, [], now) == Plan() and control_body(req, Plan())["args"]["every_s"] == 600.0
    assert plan(TraceRequest(job="j", stop=True), progress(now), now) == Plan()


@pytest.mark.parametrize("flags, msg", [
    ({"steps": 0}, "steps must be in"),
    ({"every_steps": 2, "steps": 5}, "must be >= --steps"),
    ({"every": "soon"}, "bad duration"),
    ({"ranks": "3-x"}, "bad rank range"),
])
def test_bad_flags_are_refused_with_the_shared_bounds(flags, msg):
    with pytest.raises(ValueError, match=msg):
        request_from_args(cli_args(**flags))


@pytest.mark.kafka
def test_dashboard_and_cli_send_the_same_trace_command_to_a_running_job(fresh_topics: Settings) -> None:
    job = f"same-{uuid.uuid4().hex[:6]}"
    now = time.time_ns()
    rows = [{"rank": r["rank"], "ts_ns": r["ts_ns"], "step": r["step"], "window_steps": 20,
             "median_step_ns": r["median_step_ns"], "p95_step_ns": r["median_step_ns"], "median_busy_ns": 1,
             "median_comm_ns": 1, "busy_z": 0.0, "state": "running"} for r in progress(now)]
    producer = Producer({"bootstrap.servers": fresh_topics.bootstrap})
    producer.produce(Topic.STATS.name_for(fresh_topics), key=job.encode(),
                     value=encode(Envelope("stats", job, -1, "proc", 1, 1, now, {"ranks": rows})))
    assert producer.flush(10) == 0
    control_reader = TopicReader(fresh_topics, Topic.CONTROL)
    try:
        cli = subprocess.run([sys.executable, "-m", "rankscope", "trace", "--job", job, "--steps", "3",
                              "--every", "10m", "--timeout", "1"], env=child_env(fresh_topics), cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert "sent to job" in cli.stdout, cli.stdout + cli.stderr          # no rank answers: rc 2 after 1 s
        control.request_window(fresh_topics, control.TraceRequest(job=job, steps=3, mode="every_s", every_s=600),
                               wait_s=1)

        def both_sent() -> list[Envelope]:
            control_reader.poll(0.5)
            sent = [e for e in map(decode, control_reader.values) if e.job == job]
            return sent if len(sent) == 2 else []
        cli_msg, dash_msg = wait_until(both_sent, 60, "both control messages")
        assert (cli_msg.host, dash_msg.host) == ("cli", "dashboard")
        assert cli_msg.body["args"] == dash_msg.body["args"]
        assert cli_msg.body["args"]["start_step"] == 106 and cli_msg.body["args"]["every_steps"] == 6
        assert cli_msg.body["ranks"] == dash_msg.body["ranks"] is None
    finally:
        control_reader.close()


def test_a_request_to_ranks_that_do_not_step_gets_a_note_saying_why() -> None:
    from rankscope.trace_request import stalled_note

    states = {0: "waiting", 1: "hung", 2: "running", 3: "exited:signal"}
    note = stalled_note("j", states, [0, 1, 2, 3])
    assert note is not None and note.startswith("job j is not stepping (ranks [1] hung; ranks [0] without a step)")
    assert "`rankscope alerts --job j`" in note
    assert stalled_note("j", states, [2, 3]) is None              # the addressed ranks step (or are gone)
    assert stalled_note("j", {0: "waiting"}, [0]) == stalled_note("j", {0: "waiting", 5: "hung"}, [0])
    assert stalled_note("j", {}, [0]) is None and stalled_note("j", {0: "newer-state"}, [0]) is None
    # The processors publish no stats while no rank steps: the time since each rank's last step says it.
    running = {0: "running", 1: "running"}
    idle = stalled_note("j", running, [0, 1], idle_s={0: 42.0, 1: 40.5}, min_idle_s=10)
    assert idle is not None and idle.startswith("job j is not stepping (ranks [0, 1] without a step for 40 s or more)")
    assert stalled_note("j", running, [0, 1], idle_s={0: 9.0, 1: 0.1}, min_idle_s=10) is None
