"""Dashboard tests against a real embedded store (chDB) filled with sample_data.

Unit tests of dashboard/queries.py, then one AppTest smoke test per page (fleet, job, alerts; the
newer pages have their own modules). Fixtures are in conftest.py.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import sample_data as sd
from pagetest import drawn_svgs, open_page, page_text, stacks

from rankscope.dashboard import queries as q
from rankscope.dashboard import ui
from rankscope.storage.store import Store, StoreLocked

pytestmark = pytest.mark.clickhouse

S = sd.S


# queries.py ---------------------------------------------------------------------------------------

def test_jobs_lists_both_jobs_open_alerts_first(store, now):
    df = q.jobs(store, now_ns=now)
    assert list(df.columns) == q.JOBS_COLUMNS
    assert list(df["job"]) == [sd.HANG_JOB, sd.OK_JOB]
    row = df.set_index("job")
    assert row.loc[sd.HANG_JOB, "world_size"] == 4 and row.loc[sd.HANG_JOB, "ranks_seen"] == 4
    assert row.loc[sd.HANG_JOB, "last_step"] == 58
    assert row.loc[sd.HANG_JOB, "open_alerts"] == 2 and row.loc[sd.OK_JOB, "open_alerts"] == 0
    assert row.loc[sd.OK_JOB, "alerts_total"] == 1
    assert row.loc[sd.OK_JOB, "last_seen_age_s"] == pytest.approx(0.5)


def test_ranks_states_from_alerts_and_stats(store, now):
    df = q.ranks(store, sd.HANG_JOB, now_ns=now)
    assert list(df.columns) == q.RANKS_COLUMNS
    assert dict(zip(df["rank"], df["state"], strict=True)) == {0: "running", 1: "slow", 2: "running", 3: "hung"}
    r = df.set_index("rank")
    assert r.loc[1, "median_busy_ms"] == pytest.approx(92.0, abs=1.5)
    assert r.loc[0, "median_busy_ms"] == pytest.approx(40.0, abs=1.5)
    assert r.loc[0, "median_step_ms"] == pytest.approx(100.0, abs=2)
    assert r.loc[3, "last_step"] == 57 and r.loc[0, "last_step"] == 58
    assert r.loc[3, "alerts"] == "hang" and r.loc[1, "alerts"] == "slow_rank"
    assert r.loc[2, "host"] == "node-b" and r.loc[2, "pid"] == 5200
    assert r.loc[1, "cpu_wait_pct"] == 45.0 and r.loc[0, "cpu_wait_pct"] == 3.0


def test_ranks_go_dead_when_heartbeats_stop(store, now):
    df = q.ranks(store, sd.HANG_JOB, dead_after_s=6.0, now_ns=now + 60 * S)
    assert set(df["state"]) == {"dead"}
    assert (df["heartbeat_age_s"] > 59).all()


def test_derive_rank_states_priority():
    rows = pd.DataFrame({
        "rank": [0, 1, 2, 3, 4, 5, 6, 7, 8],
        "heartbeat_age_s": [1.0, 1.0, 1.0, 30.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        "stats_state": ["ok", "", "slow", "", "hung", "", "waiting", "waiting", "exited:signal"],
        "exit_reason": ["completed", "", "", "", "", "", "", "", ""],
        "exit_detail": ["", "", "", "", "", "", "", "", ""],
    })
    open_alerts = pd.DataFrame({"kind": ["dead_rank", "slow_rank"], "ranks": [[1], [0, 5, 7]]})
    df = q.derive_rank_states(rows, open_alerts, dead_after_s=10)
    # 6 waits in a collective; 7 waits too, but the slow-rank incident names it; 8's stats row says
    # it exited, which its own exit record (not stored yet) will say too.
    assert list(df["state"]) == ["exited", "dead", "slow", "dead", "hung", "slow", "waiting", "slow", "running"]
    assert df.loc[5, "alerts"] == "slow_rank"
    assert q.derive_rank_states(rows.iloc[:0], open_alerts).columns.tolist() == q.RANKS_COLUMNS
    with pytest.raises(ValueError, match="dead_after_s"):
        q.derive_rank_states(rows, open_alerts, dead_after_s=0)


def test_step_times_last_n(store):
    df = q.step_times(store, sd.HANG_JOB, last_n=5)
    assert list(df.columns) == q.STEP_COLUMNS
    assert sorted(df.loc[df["rank"] == 0, "step"]) == [54, 55, 56, 57, 58]
    assert sorted(df.loc[df["rank"] == 3, "step"]) == [54, 55, 56, 57]
    assert df.loc[df["rank"] == 1, "busy_ms"].median() > 2 * df.loc[df["rank"] == 0, "busy_ms"].median()


def test_step_time_heatmap_bins_steps(store):
    df = q.step_time_heatmap(store, sd.HANG_JOB, metric="busy_ms", last_n=40, max_cols=4)
    assert list(df.columns) == ["rank", "step", "busy_ms"]
    assert sorted(df["step"].unique()) == [10, 20, 30, 40, 50]  # bins of 10 over steps 19..58
    assert df["rank"].nunique() == 4
    with pytest.raises(ValueError, match="metric"):
        q.step_time_heatmap(store, sd.HANG_JOB, metric="duration_ns; DROP TABLE steps")


def test_step_time_heatmaps_bin_ranks_alike_when_told_the_number_of_ranks(store):
    """A page that knows the job's world size passes it and saves the store a query; the bins are the
    ones the store's highest rank gives."""
    asked = q.step_time_heatmaps(store, sd.HANG_JOB, max_rows=2)
    told = q.step_time_heatmaps(store, sd.HANG_JOB, max_rows=2, ranks=4)
    assert "ranks" in told.columns and sorted(told["ranks"].unique()) == ["0-1", "2-3"]
    pd.testing.assert_frame_equal(asked, told)


def test_alerts_latest_version_open_first(store, now):
    df = q.alerts(store, now_ns=now)
    assert list(df.columns) == q.ALERTS_COLUMNS
    assert list(df["alert_id"]) == [sd.HANG_ALERT_ID, sd.SLOW_ALERT_ID, sd.OLD_ALERT_ID]
    hang = df.iloc[0]
    assert hang["version"] == 2 and hang["status"] == "update" and hang["open"]
    assert hang["ranks"] == [3] and hang["step"] == 57
    assert hang["duration_s"] == pytest.approx(25.0)
    old = df.iloc[2]
    assert not old["open"] and old["duration_s"] == pytest.approx(100.0)
    only_open = q.alerts(store, include_resolved=False, now_ns=now)
    assert sd.OLD_ALERT_ID not in set(only_open["alert_id"])
    assert set(q.alerts(store, job=sd.OK_JOB)["alert_id"]) == {sd.OLD_ALERT_ID}


def test_parameters_are_bound_not_formatted(store):
    evil = "x' OR 1=1 --"
    assert q.alerts(store, job=evil).empty
    assert q.ranks(store, evil).empty
    assert q.step_times(store, evil).empty


def test_stack_groups_from_body(store):
    df = q.alert_stack_groups(store, sd.HANG_JOB)
    assert list(df.columns) == q.STACK_COLUMNS
    assert len(df) == 2
    culprit = df[df["culprit"]].iloc[0]
    assert culprit["ranks"] == [3] and culprit["frames"][-1].endswith(sd.HANG_FUNCTION)
    assert not culprit["waiting_in_collective"]
    waiting = df[~df["culprit"]].iloc[0]
    assert waiting["ranks"] == [0, 1, 2] and waiting["waiting_in_collective"]


def test_parse_stack_groups_tolerates_bad_bodies():
    frame = pd.DataFrame({"alert_id": ["a", "b", "c"], "ranks": [[1], [2], [3]],
                          "body": ["not json", "", json.dumps({"stack_groups": [
                              {"ranks": [3], "thread": "t", "frames": ["f.py:1 g"]}, "junk"]})]})
    df = q.parse_stack_groups(frame)
    assert list(df["alert_id"]) == ["c"] and df.iloc[0]["culprit"]


def test_lost_rank_seconds(store, now):
    df = q.lost_rank_seconds(store, now_ns=now)
    assert list(df.columns) == q.LOST_COLUMNS
    by = df.set_index("alert_id")
    assert by.loc[sd.HANG_ALERT_ID, "estimated"]
    assert by.loc[sd.HANG_ALERT_ID, "lost_rank_seconds"] == pytest.approx(4 * 25.0)
    assert by.loc[sd.SLOW_ALERT_ID, "lost_rank_seconds"] == pytest.approx(12.5)
    assert not by.loc[sd.SLOW_ALERT_ID, "estimated"]
    assert df.iloc[0]["alert_id"] == sd.HANG_ALERT_ID  # costliest first


def test_hosts_with_and_without_gpu_samples(store, now):
    df = q.hosts(store, now_ns=now)
    assert list(df.columns) == q.HOSTS_COLUMNS
    by = df.set_index("host")
    assert list(by.index) == ["node-a", "node-b", "node-c"]
    assert by.loc["node-a", "ranks"] == 2 and by.loc["node-a", "jobs"] == [sd.HANG_JOB]
    assert by.loc["node-a", "gpus"] == 2
    assert by.loc["node-a", "gpu_util_min"] == pytest.approx(35.0)
    assert by.loc["node-b", "gpu_util_min"] > 90
    later = q.hosts(store, window_s=10, live_within_s=10, now_ns=now + 3600 * S)
    assert (later["gpus"] == 0).all() and later["gpu_util_mean"].isna().all()
    assert (later["live_ranks"] == 0).all()


def test_gpu_util_series(store, now):
    df = q.gpu_util_series(store, window_s=120, bucket_s=30, now_ns=now)
    assert list(df.columns) == q.GPU_UTIL_COLUMNS
    assert set(df["gpu"]) == {"node-a/0", "node-a/1", "node-b/0", "node-b/1", "node-c/0", "node-c/1"}
    assert df.loc[df["gpu"] == "node-a/1", "gpu_util"].max() == pytest.approx(35.0)


def test_empty_store_gives_empty_frames_with_columns(empty_store):
    assert list(q.jobs(empty_store).columns) == q.JOBS_COLUMNS
    assert list(q.ranks(empty_store, "j").columns) == q.RANKS_COLUMNS
    assert list(q.step_times(empty_store, "j").columns) == q.STEP_COLUMNS
    assert list(q.alerts(empty_store).columns) == q.ALERTS_COLUMNS
    assert list(q.alert_stack_groups(empty_store).columns) == q.STACK_COLUMNS
    assert list(q.lost_rank_seconds(empty_store).columns) == q.LOST_COLUMNS
    assert list(q.hosts(empty_store).columns) == q.HOSTS_COLUMNS
    assert list(q.gpu_util_series(empty_store).columns) == q.GPU_UTIL_COLUMNS


def test_arguments_validated(store):
    with pytest.raises(ValueError, match="recent_steps must be > 0"):
        q.ranks(store, sd.HANG_JOB, recent_steps=0)
    with pytest.raises(ValueError, match="last_n"):
        q.step_times(store, sd.HANG_JOB, last_n=-1)


# Pages (AppTest) ------------------------------------------------------------------------------------

def test_fleetopen_page(app_env):
    at = open_page()
    assert not at.exception, at.exception
    text = page_text(at)
    assert "Fleet overview" in at.title[0].value
    assert f"{sd.HANG_JOB} · 2 open alerts" in text and sd.OK_JOB in text
    assert "Jobs 2" in text and "Hosts 3" in text and "Open alerts 2" in text
    assert "Last updated" in text
    assert len(at.dataframe) == 2  # jobs and hosts


def test_job_page_shows_states_and_stacks(app_env):
    at = open_page("views/job.py", job=sd.HANG_JOB)
    assert not at.exception, at.exception
    assert at.selectbox[0].value == sd.HANG_JOB
    ranks = at.table[0].value
    assert list(ranks["rank"]) == ["0", "1", "2", "3"]
    states = ranks["state"].str.cat(sep=" ")
    assert "slow" in states and "hung" in states and "running" in states
    text = page_text(at)
    assert ":red-badge[hung] rank 3 · :orange-badge[slow] rank 1 · 2 running" in text
    assert "Slow rank 1" in text and "12.5 rank-seconds" in text
    assert "rank 3 :red-badge[hung] at step 57" in text
    assert sd.HANG_FUNCTION in "\n".join(stacks(at))
    assert "**ranks 3**" in text and "ranks 0,1,2" in text


def test_job_page_large_job_uses_heatmap_and_dataframe(app_env, monkeypatch):
    monkeypatch.setattr(q, "HEATMAP_MIN_RANKS", 2)  # treat the 4-rank job as a large one
    at = open_page("views/job.py", job=sd.HANG_JOB)
    assert not at.exception, at.exception
    assert not [t for t in at.table if "state" in t.value.columns]  # the ranks table is a (virtualised) dataframe
    ranks = at.dataframe[0].value
    assert list(ranks["state"]) == ["running", "slow", "running", "hung"]
    assert ":red-badge[hung] rank 3" in page_text(at)
    heat = drawn_svgs(at, "heatmap")    # only the open tab's heatmap is drawn: busy time
    assert len(heat) == 1 and "<title>rank 3 · step " in heat[0] and "busy ms" in heat[0], heat


def test_job_page_picker_follows_query_param(app_env):
    at = open_page("views/job.py", job=sd.OK_JOB)
    assert not at.exception
    assert at.selectbox[0].value == sd.OK_JOB
    assert "healthy] all 2 ranks running" in page_text(at)
    at.selectbox[0].select(sd.HANG_JOB).run()
    assert not at.exception
    assert at.query_params["job"] == sd.HANG_JOB
    assert "hung" in at.table[0].value["state"].str.cat()


def test_job_page_unknown_job_warns(app_env):
    at = open_page("views/job.py", job="no-such-job")
    assert not at.exception
    assert any("no-such-job" in w.value for w in at.warning)
    assert at.selectbox[0].value == sd.HANG_JOB


def test_alertsopen_page(app_env):
    at = open_page("views/alerts.py")
    assert not at.exception, at.exception
    text = page_text(at)
    assert "Open 2" in text and "Resolved 1" in text
    assert sd.HANG_FUNCTION in "\n".join(stacks(at))
    assert f"Open job {sd.HANG_JOB}" in text
    # The hang's collective table, from its ranks' Flight Recorder dumps, marks the culprit.
    table = next(d.value for d in at.dataframe if "last_enqueued" in getattr(d.value, "columns", []))
    table = getattr(table, "data", table)      # a Styler shows its DataFrame
    assert dict(zip(table["rank"], table["last_enqueued"], strict=True)) == sd.FR_LAST
    assert table.loc[table["culprit"], "rank"].tolist() == [3]
    at.toggle[0].set_value(False).run()
    assert not at.exception
    assert sd.OLD_ALERT_ID not in at.dataframe[0].value.to_string()


def test_empty_store_says_what_to_do(app_env, monkeypatch):
    monkeypatch.setattr(q, "jobs", lambda store, **kw: pd.DataFrame(columns=q.JOBS_COLUMNS))
    for page in (None, "views/job.py"):
        at = open_page(page)
        assert not at.exception
        assert any("from rankscope import Tracer" in i.value and "make demo" in i.value for i in at.info)
    monkeypatch.setattr(q, "alerts", lambda store, **kw: pd.DataFrame(columns=q.ALERTS_COLUMNS))
    at = open_page("views/alerts.py")
    assert not at.exception and any("No alerts yet" in i.value for i in at.info)


def test_unreachable_store_warns_calmly(app_env, monkeypatch):
    monkeypatch.setenv("RANKSCOPE_CLICKHOUSE_DSN", "http://127.0.0.1:9")
    for page in (None, "views/job.py", "views/alerts.py"):
        at = open_page(page)
        assert not at.exception, at.exception
        assert any("Cannot open the store" in w.value for w in at.warning)


def test_locked_store_warns_calmly(app_env, monkeypatch):
    def locked(dsn: str) -> Store:
        raise StoreLocked("the embedded store /x is open in another process (chDB allows one)")

    monkeypatch.setattr(ui, "open_store", locked)
    monkeypatch.setenv("RANKSCOPE_CLICKHOUSE_DSN", "chdb:///locked/elsewhere")
    at = open_page()
    assert not at.exception, at.exception
    assert any("busy" in w.value and "another process" in w.value for w in at.warning)


def test_rank_medians_use_each_ranks_last_steps(store):
    """rank_rows bounds the steps it reads by the slowest rank's last step; the medians stay exact."""
    got = q.rank_rows(store, sd.HANG_JOB, recent_steps=5).set_index("rank")
    steps = store.query_df(f"SELECT rank, step, busy_ns FROM {store.database}.steps WHERE job = {{j:String}}",
                           {"j": sd.HANG_JOB})
    last5 = steps.sort_values("step").groupby("rank").tail(5)
    want = (last5.groupby("rank")["busy_ns"].median() / 1e6).round(2)
    assert got["median_busy_ms"].to_dict() == pytest.approx(want.to_dict())


def test_flight_records_latest_per_rank(store):
    df = q.flight_records(store, sd.HANG_JOB)
    assert list(df.columns) == q.FLIGHT_COLUMNS and list(df["rank"]) == [3]
    row = df.iloc[0]
    assert (row["steps"], row["first_step"], row["last_step"]) == (18, 40, 57)
    assert sd.HANG_FUNCTION in row["stacks"][0]["frames"][-1]
    assert q.flight_records(store, sd.OK_JOB).empty


def test_job_page_shows_flight_records(app_env):
    at = open_page("views/job.py", job=sd.HANG_JOB)
    assert not at.exception, at.exception
    assert "Rank 3" in page_text(at) and any("train.py:56" in s for s in stacks(at))


def test_incident_collectives_come_from_the_incidents_dumps(store, now):
    df = q.incident_collectives(store, ((sd.HANG_JOB, sd.HANG_ALERT_ID), (sd.OK_JOB, sd.OLD_ALERT_ID)))
    assert set(df["alert_id"]) == {sd.HANG_ALERT_ID}
    assert dict(zip(df["rank"], df["last_enqueued"], strict=True)) == sd.FR_LAST
    assert set(df["process_group"]) == {"0"} and set(df["last_started"]) == {-1}
    assert list(q.incident_collectives(store, ()).columns) == q.COLLECTIVE_COLUMNS


def test_profiles_put_the_function_only_the_straggler_calls_on_top_of_its_differential(store):
    from rankscope import profiles

    per = profiles.seconds(q.profile_rows(store, sd.HANG_JOB, roles=["training"]))
    diff = profiles.differential(per.groupby(["rank", "path"], as_index=False)["seconds"].sum(), [1])
    assert diff.iloc[0]["function"] == f"data.py:30 {sd.PROFILE_EXTRA}" and diff.iloc[0]["added_s"] == 3 * 90 / 20
    assert diff.iloc[-1]["function"].endswith("all_reduce")      # it waits less than its peers


def test_job_page_profile_panel_shows_a_ranks_differential(app_env):
    at = open_page("views/job.py", job=sd.HANG_JOB)
    assert not at.exception, at.exception
    rank_pick = next(s for s in at.selectbox if s.label == "Rank")
    at = rank_pick.select("1").run()
    assert not at.exception, at.exception
    assert "Where rank 1 spends more than its peers' median" in page_text(at)
    diff = next(d.value for d in at.dataframe if "added s" in d.value.columns)
    assert diff.iloc[0]["function"] == f"data.py:30 {sd.PROFILE_EXTRA}"


def test_the_slow_rank_alert_says_where_its_time_goes_and_links_to_its_profile(app_env):
    at = open_page("views/job.py", job=sd.HANG_JOB)
    assert not at.exception, at.exception
    text = page_text(at)
    assert f"`data.py:30 {sd.PROFILE_EXTRA}` 30% of its time (peers 0%)" in text
    (link,) = [e for e in at.get("page_link") if "Profile of rank 1" in e.proto.label]
    assert "profile_rank=1" in link.proto.query_string and "profile_from=" in link.proto.query_string


def test_a_profile_link_opens_the_ranks_differential(app_env, now):
    at = open_page("views/job.py", job=sd.HANG_JOB, profile_rank="1", profile_from=str(now - 200 * sd.S))
    assert not at.exception, at.exception
    assert next(s for s in at.selectbox if s.label == "Rank").value == "1"
    assert f"Most added: `data.py:30 {sd.PROFILE_EXTRA}`" in page_text(at)
    # A link whose range holds no samples says so.
    at = open_page("views/job.py", job=sd.HANG_JOB, profile_rank="1", profile_from=str(now + 10 * sd.S))
    assert not at.exception, at.exception
    assert "No sampled stacks in this range" in page_text(at)


def test_profile_rows_filter_by_rank_role_host_and_time(store, now):
    rows = q.profile_rows(store, sd.HANG_JOB, ranks=[1], roles=["training"], hosts=["node-a"])
    assert set(rows["rank"]) == {1} and set(rows["role"]) == {"training"}
    assert q.profile_rows(store, sd.HANG_JOB, hosts=["node-b"])["rank"].isin([2, 3]).all()
    assert q.profile_rows(store, sd.HANG_JOB, t0_ns=now).empty               # every interval ended by then
    # An interval that started before t0 and ends after it is in the range (a link from an alert
    # opened mid-interval finds the samples of that interval).
    assert not q.profile_rows(store, sd.HANG_JOB, t0_ns=now - 5 * sd.S).empty
    assert not q.profile_rows(store, sd.HANG_JOB, t0_ns=now - 15 * sd.S, t1_ns=now).empty
    assert q.profile_rows(store, sd.HANG_JOB, roles=["dataloader"]).empty


def test_profile_intervals_are_bounded_as_the_range_filter_assumes():
    from rankscope.config import ConfigError, Settings
    from rankscope.storage.profiles import MAX_INTERVAL_NS

    assert Settings(profile_s=MAX_INTERVAL_NS / 1e9).profile_s == 3600
    with pytest.raises(ConfigError, match="profile_s must be at most 3600"):
        Settings(profile_s=3601)
