"""Host page and its queries (hw_samples of node-a / node-b), and the shared time-range picker."""

from __future__ import annotations

import pytest
import sample_data as sd
from pagetest import open_page, page_text

from rankscope.dashboard import queries as q
from rankscope.dashboard import ui

pytestmark = pytest.mark.clickhouse
S = sd.S


def test_bucket_for():
    assert q.bucket_for(900) == 5 and q.bucket_for(86400) == 600 and q.bucket_for(60) == 1
    assert q.bucket_for(10 * 86400 * 365) == 3600
    with pytest.raises(ValueError, match="span_s"):
        q.bucket_for(0)


def test_host_names(store, now):
    assert q.host_names(store) == ["node-a", "node-b", "node-c"]


def test_hw_series_gpu_and_host_metrics(store, now):
    df = q.hw_series(store, "node-a", now - 900 * S, now + S, bucket_s=30)
    assert list(df.columns) == q.HW_COLUMNS
    assert set(df["device"]) == {-1, 0, 1}
    gpu_metrics = set(df.loc[df["device"] >= 0, "metric"])
    assert {"gpu_util", "power_w", "temp_c", "sm_clock_mhz", "nvlink_tx_kbps", "pcie_rx_kbps"} <= gpu_metrics
    assert set(df.loc[df["device"] == -1, "metric"]) == set(sd.HOST_METRICS)
    util = df[(df["metric"] == "gpu_util") & (df["device"] == 1)]
    assert util["value"].max() == pytest.approx(35.0)
    assert df["t"].is_monotonic_increasing or df.groupby(["device", "metric"])["t"].is_monotonic_increasing.all()
    only = q.hw_series(store, "node-a", now - 900 * S, now + S, metrics=["temp_c"])
    assert set(only["metric"]) == {"temp_c"}
    assert q.hw_series(store, "node-c", now - 900 * S, now + S, metrics=["temp_c"]).empty
    with pytest.raises(ValueError, match="until_ns"):
        q.hw_series(store, "node-a", now, now)


def test_hw_latest(store, now):
    df = q.hw_latest(store, "node-b", now - 900 * S, now_ns=now)
    assert list(df.columns) == q.HW_LATEST_COLUMNS
    power = df[(df["metric"] == "power_w") & (df["device"] == 1)].iloc[0]
    assert power["value"] == pytest.approx(sd.GPU_METRICS["power_w"] * 1.04 + 1)  # newest sample: k = 11
    assert (df["age_s"] == 5.0).all()
    assert q.hw_latest(store, "node-x", now - 900 * S).empty


def test_time_range_bounds():
    r = ui.TimeRange("1h", 3600.0)
    assert r.bounds(now_ns=10**13) == (10**13 - 3600 * S, 10**13) and r.label == "last 1 h"
    since, until = r.bounds()
    assert until % S == 0 and until - since == 3600 * S
    c = ui.TimeRange("custom", 60.0, 5 * S, 65 * S)
    assert c.bounds() == (5 * S, 65 * S) and c.label.endswith("UTC")


def test_host_page(app_env):
    at = open_page("views/host.py", host="node-a")
    assert not at.exception, at.exception
    assert at.selectbox(key="host_pick").value == "node-a"
    text = page_text(at)
    assert "Ranks 2" in text and "GPUs reporting 2" in text and "Jobs here: [llm-pretrain]" in text
    for title in ("GPU utilisation", "Power", "Temperature", "SM clock", "PCIe", "NVLink", "CPU", "Memory used",
                  "Network", "Disk"):
        assert f"**{title}**" in text
    assert "No `" not in text  # every chart has data
    gpus = at.dataframe[0].value
    assert list(gpus["GPU"]) == [0, 1] and gpus["power W"].iloc[1] > 300
    assert len(at.get("vega_lite_chart")) == 12


def test_host_page_without_samples_and_range_follows_user(app_env):
    at = open_page("views/host.py", host="node-c")  # gpu_util only, no host metrics
    assert not at.exception, at.exception
    assert "No `cpu_util` samples" in page_text(at)
    at.selectbox(key="range_pick").select("6h").run()
    assert not at.exception
    assert "GPUs · last 6 h" in [s.value for s in at.subheader]
    at.switch_page("views/fleet.py").run()  # the choice follows the user to the fleet page
    assert not at.exception and at.selectbox(key="range_pick").value == "6h"
    at.selectbox(key="range_pick").select("custom").run()
    assert not at.exception
    assert len(at.date_input) == 2 and len(at.time_input) == 2


def test_host_page_unknown_host_warns(app_env):
    at = open_page("views/host.py", host="node-zz")
    assert not at.exception
    assert any("node-zz" in w.value for w in at.warning)


def test_fleet_hosts_link_to_host_page(app_env):
    at = open_page()
    assert not at.exception
    hosts = at.dataframe[1].value
    assert list(hosts["link"]) == ["host?host=node-a", "host?host=node-b", "host?host=node-c"]
