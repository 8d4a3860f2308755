"""Host view (``?host=``): its GPUs now, then GPU and host metrics over the picked time range."""

from functools import partial

import altair as alt
import pandas as pd
import streamlit as st

from rankscope.config import Settings
from rankscope.dashboard import ui
from rankscope.storage.store import StoreError

GIB = 1024**3
# (title, metrics, unit, scale) per chart; kbps are KB/s (1000 B/s), shown as MB/s.
GPU_CHARTS = [
    ("GPU utilisation", ["gpu_util"], "%", 1.0),
    ("GPU memory-controller utilisation", ["mem_util"], "%", 1.0),
    ("GPU memory used", ["mem_used_bytes"], "GiB", 1 / GIB),
    ("Power", ["power_w"], "W", 1.0),
    ("Temperature", ["temp_c"], "°C", 1.0),
    ("SM clock", ["sm_clock_mhz"], "MHz", 1.0),
    ("PCIe", ["pcie_tx_kbps", "pcie_rx_kbps"], "MB/s", 1e-3),
    ("NVLink", ["nvlink_tx_kbps", "nvlink_rx_kbps"], "MB/s", 1e-3),
]
HOST_CHARTS = [
    ("CPU", ["cpu_util"], "%", 1.0),
    ("Memory used", ["mem_used_bytes"], "GiB", 1 / GIB),
    ("Network", ["net_tx_bytes_s", "net_rx_bytes_s"], "MB/s", 1e-6),
    ("Disk", ["disk_read_bytes_s", "disk_write_bytes_s"], "MB/s", 1e-6),
]
DIRECTION = {"tx": "tx", "rx": "rx", "read": "read", "write": "write"}


def series_label(device: int, metric: str, pair: bool) -> str:
    who = "host" if device < 0 else f"GPU {device}"
    if not pair:
        return who
    part = next((d for d in DIRECTION if f"_{d}_" in f"_{metric}_"), metric)
    return f"{who} {part}"


def time_format(span_s: float) -> str:
    return "%H:%M:%S" if span_s <= 1800 else "%H:%M" if span_s <= 2 * 86400 else "%m-%d %H:%M"


def chart(frame: pd.DataFrame, title: str, metrics: list[str], unit: str, scale: float, gpu: bool,
          span_s: float) -> None:
    rows = frame[frame["metric"].isin(metrics) & ((frame["device"] >= 0) if gpu else (frame["device"] < 0))]
    st.markdown(f"**{title}** ({unit})")
    if rows.empty:
        st.caption(f"No `{'`, `'.join(metrics)}` samples in this range.")
        return
    data = rows.assign(value=rows["value"] * scale,
                       series=[series_label(int(d), m, len(metrics) > 1)
                               for d, m in zip(rows["device"], rows["metric"], strict=True)])
    line = alt.Chart(data).mark_line(point=len(data) < 60).encode(
        x=alt.X("t:T", title=None, axis=alt.Axis(format=time_format(span_s), tickCount=6)),
        y=alt.Y("value:Q", title=unit, scale=alt.Scale(zero=unit in ("%", "MB/s", "W"))),
        color=alt.Color("series:N", title=None, legend=alt.Legend(orient="bottom", columns=4)),
        tooltip=["series", alt.Tooltip("t:T", format="%H:%M:%S"), alt.Tooltip("value:Q", format=",.1f")])
    st.altair_chart(line.properties(height=200), width="stretch")


def gpus_now(latest: pd.DataFrame) -> pd.DataFrame:
    gpus = latest[latest["device"] >= 0]
    if gpus.empty:
        return pd.DataFrame()
    wide = gpus.pivot_table(index="device", columns="metric", values="value", aggfunc="last")
    col = lambda m: wide[m] if m in wide.columns else pd.Series(float("nan"), index=wide.index)  # noqa: E731
    return pd.DataFrame({
        "GPU": wide.index.astype(int),
        "util %": col("gpu_util"),
        "memory GiB": (col("mem_used_bytes") / GIB).round(1),
        "of GiB": (col("mem_total_bytes") / GIB).round(1),
        "power W": col("power_w").round(0),
        "temp °C": col("temp_c").round(0),
        "SM MHz": col("sm_clock_mhz").round(0),
    }).reset_index(drop=True)


def panel(cfg: Settings, host: str, span: ui.TimeRange) -> None:
    since, until = span.bounds()
    frame = ui.query(cfg, "hw_series", host=host, since_ns=since, until_ns=until)
    latest = ui.query(cfg, "hw_latest", host=host, since_ns=since)
    hosts = ui.query(cfg, "hosts")
    row = hosts[hosts["host"] == host]
    c = st.columns(4)
    c[0].metric("Ranks", int(row["ranks"].iloc[0]) if not row.empty else 0)
    c[1].metric("Jobs", len(row["jobs"].iloc[0]) if not row.empty else 0)
    c[2].metric("GPUs reporting", int(latest.loc[latest["device"] >= 0, "device"].nunique()))
    util = frame.loc[frame["metric"] == "gpu_util", "value"]
    c[3].metric("GPU utilisation", f"{util.mean():.0f} %" if not util.empty else "n/a",
                help=f"Mean over the {span.label}.")
    if not row.empty and row["jobs"].iloc[0]:
        st.markdown("Jobs here: " + " · ".join(f"[{j}](job?job={j})" for j in row["jobs"].iloc[0]))
    if frame.empty:
        st.info(f"No hardware samples from `{host}` in the {span.label}. The sampler runs in every rank "
                "(GPU metrics) and in local rank 0 (host metrics); pick a longer range.", icon="📉")
        return
    table = gpus_now(latest)
    if not table.empty:
        st.subheader("GPUs now")
        st.dataframe(table, hide_index=True, column_config={
            "util %": st.column_config.ProgressColumn("util %", format="%.0f %%", min_value=0, max_value=100)})
    st.subheader(f"GPUs · {span.label}")
    for i in range(0, len(GPU_CHARTS), 2):
        for col, spec in zip(st.columns(2), GPU_CHARTS[i:i + 2], strict=False):
            with col:
                chart(frame, *spec, gpu=True, span_s=span.span_s)
    st.subheader(f"Host · {span.label}")
    for i in range(0, len(HOST_CHARTS), 2):
        for col, spec in zip(st.columns(2), HOST_CHARTS[i:i + 2], strict=False):
            with col:
                chart(frame, *spec, gpu=False, span_s=span.span_s)


st.title("Host")
cfg = ui.connect()
if cfg is not None:
    try:
        names = ui.query(cfg, "host_names")
    except StoreError as e:
        st.warning(f"The store did not answer: {e}")
        names = None
    if names is not None and not names:
        st.info("No hosts yet: hosts appear once a rank or the hardware sampler reports. "
                + ui.EMPTY_FLEET, icon="🛰️")
    elif names is not None:
        top = st.columns([1, 2])
        with top[0]:
            chosen = ui.pick_param("Host", list(names), "host", "host_pick")
        span = ui.time_range(top[1])
        ui.live(cfg, partial(panel, cfg, chosen, span))
