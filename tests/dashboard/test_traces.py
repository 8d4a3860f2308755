"""Trace windows: queries, flame graph data, request messages, and the page."""

from __future__ import annotations

import pandas as pd
import pytest
import sample_data as sd
from pagetest import drawn_svgs, open_page, page_text

from rankscope.dashboard import control, flame
from rankscope.dashboard import queries as q
from rankscope.protocol.envelope import decode
from rankscope.protocol.trace import parse_command
from rankscope.trace_request import encode_request

S, MS = sd.S, sd.MS


# queries ------------------------------------------------------------------------------------------------

@pytest.mark.clickhouse
def test_trace_windows_merged_over_ranks(store):
    df = q.trace_windows(store, sd.HANG_JOB)
    assert list(df.columns) == q.WINDOWS_COLUMNS
    assert list(df["window_id"]) == [sd.WINDOW_ID, sd.OLD_WINDOW_ID]  # newest first
    w = df.iloc[0]
    assert w["ranks"] == [0, 1, 2, 3] and w["status"] == "complete" and w["request_id"] == "tw0001abcd"
    assert (w["first_step"], w["last_step"], w["steps"]) == (50, 52, 3)
    assert w["events"] == 4 * 24 and w["truncated_ranks"] == 1 and w["duration_s"] == pytest.approx(0.3)
    assert df.iloc[1]["status"] == "stopped" and df.iloc[1]["ranks"] == [1]
    assert q.trace_windows(store, sd.OK_JOB).empty


@pytest.mark.clickhouse
def test_trace_window_ranks_and_events(store):
    ranks = q.trace_window_ranks(store, sd.HANG_JOB, sd.WINDOW_ID)
    assert list(ranks.columns) == q.WINDOW_RANKS_COLUMNS
    assert list(ranks["rank"]) == [0, 1, 2, 3] and list(ranks["truncated"]) == [False, False, True, False]
    assert list(ranks["thread_cpu_s"])[:3] == [0.2, 0.2, 0.2] and list(ranks["cpu_wait_share"])[:3] == [0.2, 0.333, 0.429]
    assert ranks[["thread_cpu_s", "cpu_wait_share"]].iloc[3].isna().all()    # a rank that does not send them
    ev = q.trace_events(store, sd.HANG_JOB, sd.WINDOW_ID)
    assert list(ev.columns) == q.EVENT_COLUMNS and len(ev) == 96
    assert set(ev["category"]) == {"python", "cpu_op", "kernel", "collective"}
    assert ev.loc[ev["category"] == "python", "attrs"].iloc[0] == {"tid": "1234"}
    py3 = q.trace_events(store, sd.HANG_JOB, sd.WINDOW_ID, ranks=[3], categories=["python"])
    assert set(py3["rank"]) == {3} and set(py3["name"]) == {"main", "train_step", "forward", "backward", "loss"}
    assert len(q.trace_events(store, sd.HANG_JOB, sd.WINDOW_ID, limit=10)) == 10
    assert q.window_event_ranks(store, sd.HANG_JOB, sd.WINDOW_ID) == [0, 1, 2, 3]
    assert q.window_event_ranks(store, sd.HANG_JOB, sd.OLD_WINDOW_ID) == []


@pytest.mark.clickhouse
def test_empty_trace_frames(empty_store):
    assert list(q.trace_windows(empty_store, "j").columns) == q.WINDOWS_COLUMNS
    assert list(q.trace_window_ranks(empty_store, "j", "w").columns) == q.WINDOW_RANKS_COLUMNS
    assert list(q.trace_events(empty_store, "j", "w").columns) == q.EVENT_COLUMNS


# flame ----------------------------------------------------------------------------------------------------

def _py(rows: list[tuple]) -> pd.DataFrame:
    return pd.DataFrame([{"rank": r, "name": n, "start_ns": s * MS, "dur_ns": d * MS, "stream": -1,
                          "attrs": {"tid": str(t)}} for r, t, n, s, d in rows])


def _by_path(tree: pd.DataFrame) -> dict[tuple, dict]:
    return {r["path"]: r for r in tree.to_dict("records")}


def test_call_paths_from_nesting_and_from_names():
    nested = _py([(0, 1, "main", 0, 100), (0, 1, "step", 5, 90), (0, 1, "fwd", 10, 30), (0, 1, "bwd", 50, 40),
                  (0, 1, "fwd", 100, 10),                      # starts when main ends: a new top-level call
                  (0, 2, "loader", 20, 50)])                   # another thread: its own stack
    paths = flame.call_paths(nested)
    assert list(paths["path"]) == [("main",), ("main", "step"), ("main", "step", "fwd"), ("main", "step", "bwd"),
                                   ("fwd",), ("loader",)]
    assert list(paths["self_ns"] // MS) == [10, 20, 30, 40, 10, 50]
    named = _py([(0, 1, "main;step;fwd", 10, 30), (0, 1, "main;step", 5, 90), (0, 1, "inner", 12, 5)])
    got = dict(zip(flame.call_paths(named)["path"], flame.call_paths(named)["self_ns"] // MS, strict=True))
    assert got == {("main", "step"): 60, ("main", "step", "fwd"): 25, ("main", "step", "fwd", "inner"): 5}
    assert flame.call_paths(nested.iloc[:0]).empty


def test_call_tree_totals_and_self_time():
    events = pd.concat([
        _py([(0, 1, "main", 0, 100), (0, 1, "step", 5, 90), (0, 1, "fwd", 10, 30)]),
        _py([(1, 1, "main;step;fwd", 10, 40), (1, 1, "main;step;bwd", 50, 20)]),  # callers not recorded
    ], ignore_index=True)
    tree = _by_path(flame.call_tree(events))
    assert tree[("all",)]["total_ns"] == 100 * MS + 60 * MS
    assert tree[("all", "main", "step")]["total_ns"] == 90 * MS + 60 * MS
    assert tree[("all", "main", "step", "fwd")]["total_ns"] == 70 * MS
    assert tree[("all", "main", "step")]["self_ns"] == 150 * MS - 90 * MS
    assert tree[("all", "main", "step", "fwd")]["calls"] == 2


def test_icicle_layout_nests_and_prunes():
    events = _py([(0, 1, "main", 0, 100), (0, 1, "big", 0, 60), (0, 1, "small", 60, 30), (0, 1, "tiny", 95, 0.05)])
    ice = flame.icicle(flame.call_tree(events), min_share=0.01).set_index("name")
    assert list(ice.columns) == [c for c in flame.ICICLE_COLUMNS if c != "name"]
    assert (ice.loc["all", "x0"], ice.loc["all", "x1"]) == (0, 100)
    assert (ice.loc["big", "x0"], ice.loc["big", "x1"]) == (0, 60)          # largest callee first
    assert (ice.loc["small", "x0"], ice.loc["small", "x1"]) == (60, 90)
    assert ice.loc["big", "depth"] == 2 and ice.loc["main", "self_ms"] == pytest.approx(9.95)
    assert "tiny" not in ice.index                                          # under 1 %
    assert ice.loc["main", "label"] == "main"
    assert flame.icicle(flame.call_tree(events.iloc[:0])).empty
    wide = _py([(0, 1, f"f{i}", i, 1) for i in range(50)])
    assert len(flame.icicle(flame.call_tree(wide), min_share=0, max_nodes=10)) <= 10


@pytest.mark.clickhouse
def test_flame_from_sample_window_mixes_both_name_styles(store):
    ev = q.trace_events(store, sd.HANG_JOB, sd.WINDOW_ID, categories=["python"])
    tree = _by_path(flame.call_tree(ev))
    fwd = ("all", "main", "train_step", sd.PY_FUNCTION)
    assert tree[fwd]["calls"] == 12 and tree[fwd]["total_ns"] == 12 * 35 * MS
    assert tree[(*fwd, "loss")]["calls"] == 12


# control messages ------------------------------------------------------------------------------------------

def test_window_request_encodes_like_the_cli():
    req = control.TraceRequest(job="j", ranks=[0, 1, 2, 3], steps=5, mode="every_steps", every_steps=100,
                                with_shapes=True, request_id="tw12345678")
    env = decode(encode_request(req))
    assert env.kind == "control" and env.job == "j" and env.rank == -1
    assert env.body == {"command": "trace", "request_id": "tw12345678", "ranks": [0, 1, 2, 3],
                        "args": {"steps": 5, "with_shapes": True, "with_stack": True, "byte_budget": 0,
                                 "every_steps": 100}}
    parsed = parse_command("tw12345678", env.body["args"], env.body["ranks"], env.sent_ns)  # the rank's parser
    assert parsed.every_steps == 100 and parsed.repeating
    every = decode(encode_request(control.TraceRequest(job="j", mode="every_s", every_s=30))).body
    assert every["args"]["every_s"] == 30.0 and every["ranks"] is None
    cont = decode(encode_request(control.TraceRequest(job="j", mode="continuous"))).body["args"]
    assert cont["continuous"] is True
    stop = decode(encode_request(control.TraceRequest(job="j", ranks=[2], stop=True))).body
    assert stop["command"] == "stop" and stop["args"] == {} and stop["ranks"] == [2]


@pytest.mark.parametrize("kw, msg", [
    ({"steps": 0}, "steps must be in"),
    ({"mode": "every_steps", "steps": 5, "every_steps": 2}, "every K steps"),
    ({"mode": "every_s", "every_s": 0}, "every N seconds"),
    ({"mode": "sometimes"}, "mode must be one of"),
    ({"ranks": []}, "ranks must be"),
    ({"job": ""}, "job must not be empty"),
])
def test_window_request_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        control.TraceRequest(**{"job": "j", **kw})


def test_parse_ranks_is_the_cli_one():
    assert control.parse_ranks("0-3,8") == [0, 1, 2, 3, 8] and control.parse_ranks(" ") is None
    with pytest.raises(ValueError, match="bad rank range"):
        control.parse_ranks("3-x")


# page -------------------------------------------------------------------------------------------------------

@pytest.mark.clickhouse
def test_traces_page_lists_windows_and_draws_flame(app_env):
    at = open_page("views/traces.py", job=sd.HANG_JOB)
    assert not at.exception, at.exception
    windows = at.dataframe[0].value
    assert list(windows["window_id"]) == [sd.WINDOW_ID, sd.OLD_WINDOW_ID]
    assert windows["truncated"].iloc[0] == "1 rank" and windows["ranks"].iloc[0] == "0,1,2,3"
    text = page_text(at)
    assert "96 events from 4 rank(s)" in text and "Some ranks were truncated" in text
    dl = at.get("download_button")
    assert len(dl) == 1 and not dl[0].proto.disabled
    assert len(drawn_svgs(at, "flame")) == 1 and "5 frames" in text
    at.selectbox(key="flame_rank").select(3).run()
    assert not at.exception and "5 frames" in page_text(at)
    at.selectbox(key="trace_window_pick").select(sd.OLD_WINDOW_ID).run()
    assert not at.exception
    assert "No Python call paths in this window" in page_text(at)
    assert at.get("download_button")[0].proto.disabled


@pytest.mark.clickhouse
def test_traces_page_sends_a_request_and_shows_acks(app_env, monkeypatch):
    sent = []

    def fake_request(settings, req, wait_s=5.0, expect_ranks=None, **kw):
        sent.append((req, sorted(expect_ranks or [])))
        return [control.Ack(0, "accepted", "window of 5 steps from step 59"),
                control.Ack(1, "rejected", "steps=5: a window is already open")]

    monkeypatch.setattr(control, "request_window", fake_request)
    at = open_page("views/traces.py", job=sd.HANG_JOB)
    at.text_input[0].input("0-1")
    at.number_input[0].set_value(5)
    at.button[0].click().run()       # "Request window"
    assert not at.exception, at.exception
    req, expect = sent[0]
    assert (req.job, req.ranks, req.steps, req.mode, req.stop) == (sd.HANG_JOB, [0, 1], 5, "once", False)
    assert expect == [0, 1]
    acks = at.dataframe[0].value
    assert list(acks["status"]) == ["accepted", "rejected"]
    assert f"Request `{req.request_id}`" in page_text(at)
    assert f"(reports?job={sd.HANG_JOB}&window={req.request_id})" in page_text(at)
    assert not any("is not stepping" in w.value for w in at.warning)     # ranks 0 and 1 are not the hung one
    at.button[1].click().run()       # "Stop windows"
    assert not at.exception and sent[1][0].stop
    assert "(reports?job=" not in page_text(at)


@pytest.mark.clickhouse
def test_traces_page_says_why_a_window_of_a_hung_rank_will_not_start(app_env, monkeypatch):
    monkeypatch.setattr(control, "request_window", lambda *a, **k: [control.Ack(3, "accepted", "3 steps, once")])
    at = open_page("views/traces.py", job=sd.HANG_JOB)
    at.button[0].click().run()       # every rank, rank 3 hung in the sample job
    assert not at.exception, at.exception
    stalled = [w.value for w in at.warning if f"job {sd.HANG_JOB} is not stepping" in w.value]
    assert stalled and "ranks [3] hung" in stalled[0] and "when their steps resume" in stalled[0], \
        [w.value for w in at.warning]


@pytest.mark.clickhouse
def test_traces_page_refuses_bad_input_without_sending(app_env, monkeypatch):
    monkeypatch.setattr(control, "request_window", lambda *a, **k: pytest.fail("must not send"))
    at = open_page("views/traces.py", job=sd.HANG_JOB)
    at.text_input[0].input("0-x")
    at.button[0].click().run()
    assert any("bad rank range" in e.value for e in at.error)
    at.text_input[0].input("7")
    at.button[0].click().run()
    assert any("has no rank 7" in e.value for e in at.error)


@pytest.mark.clickhouse
def test_traces_page_no_acks_warns(app_env, monkeypatch):
    monkeypatch.setattr(control, "request_window", lambda *a, **k: [])
    at = open_page("views/traces.py", job=sd.OK_JOB)
    at.button[0].click().run()
    assert not at.exception
    assert any("No acknowledgement within 5 s" in w.value for w in at.warning)
    assert not any("is not stepping" in w.value for w in at.warning)
    assert any(f"No trace windows for {sd.OK_JOB} yet" in i.value for i in at.info)
