"""Hardware sampler: a fake pynvml (2 GPUs, deterministic values) and real psutil; no GPU needed."""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
import types
from typing import Any

import pynvml as real_nvml
import pytest

from rankscope.config import ConfigError, Settings
from rankscope.producers.hw import MAX_ROWS_PER_BODY, NO_NVML_MESSAGE, HardwareSampler
from rankscope.producers.hw_gpu import pick_gpu
from rankscope.producers.identity import RankIdentity
from rankscope.producers.tracer import Tracer
from rankscope.protocol.envelope import Envelope, decode, encode
from rankscope.storage.columns import TABLE_COLUMNS, Columns
from rankscope.storage.rows import hw_columns

GIB = 2**30


class _Handle:
    def __init__(self, index: int) -> None:
        self.index = index


def fake_nvml(n_gpus: int = 2, *, gpm: bool = True, fields: bool = True, init_error: int | None = None,
              xid_on: int | None = None) -> types.ModuleType:
    """A pynvml stand-in: the real module's constants, structs and error classes, fake device calls.

    GPU i: gpu_util 10+50i, mem_util 5+40i, mem_used (1+i) GiB of 80 GiB, power 100+100i W, temp 40+10i C,
    SM clock 1500+100i MHz, throttle bitmask 4i, no ECC (not supported). PCIe counters grow at
    (1+i) MB/s per direction, NVLink 2 links at 1000 and 2000 KiB/s; GPM metric value = id + 0.5 i.
    """
    m = types.ModuleType("pynvml")
    for k, v in vars(real_nvml).items():
        if k.startswith(("NVML_", "nvmlEventType", "c_nvml", "NVMLError")) or k == "NVMLError":
            setattr(m, k, v)
    NVMLError = real_nvml.NVMLError
    handles = [_Handle(i) for i in range(n_gpus)]
    state: dict[str, Any] = {"init": 0, "shutdown": 0, "last_gpm": 0, "xid_pending": xid_on is not None,
                             "calls": 0}
    m.state = state

    def nvmlInit() -> None:
        if init_error is not None:
            raise NVMLError(init_error)
        state["init"] += 1

    def nvmlShutdown() -> None:
        state["shutdown"] += 1

    def call(fn):  # count device calls
        def wrapped(*a: Any) -> Any:
            state["calls"] += 1
            return fn(*a)
        return wrapped

    m.nvmlInit, m.nvmlShutdown = nvmlInit, nvmlShutdown
    m.nvmlDeviceGetCount = lambda: n_gpus
    m.nvmlDeviceGetHandleByIndex = lambda i: handles[i]
    m.nvmlDeviceGetIndex = lambda h: h.index
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h.index:08d}-aaaa-bbbb"
    m.nvmlDeviceGetUtilizationRates = call(lambda h: types.SimpleNamespace(gpu=10 + 50 * h.index,
                                                                           memory=5 + 40 * h.index))
    m.nvmlDeviceGetMemoryInfo = call(lambda h: types.SimpleNamespace(used=(1 + h.index) * GIB, total=80 * GIB,
                                                                     free=(79 - h.index) * GIB))
    m.nvmlDeviceGetPowerUsage = call(lambda h: 100_000 + 100_000 * h.index)
    m.nvmlDeviceGetTemperature = call(lambda h, sensor: 40 + 10 * h.index)
    m.nvmlDeviceGetClockInfo = call(lambda h, clock: 1500 + 100 * h.index)
    m.nvmlDeviceGetCurrentClocksEventReasons = call(lambda h: 4 * h.index)

    def ecc(h: _Handle, err: int, counter: int) -> int:
        raise NVMLError(real_nvml.NVML_ERROR_NOT_SUPPORTED)

    m.nvmlDeviceGetTotalEccErrors = ecc

    def field_values(h: _Handle, ids: list[Any]) -> Any:
        state["calls"] += 1
        if not fields:
            raise NVMLError(real_nvml.NVML_ERROR_NOT_SUPPORTED)
        arr = (real_nvml.c_nvmlFieldValue_t * len(ids))()
        t = time.monotonic()
        for i, fid in enumerate(ids):
            fid, scope = fid if isinstance(fid, tuple) else (fid, 0)
            arr[i].fieldId, arr[i].scopeId = fid, scope
            arr[i].valueType = real_nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            if fid == real_nvml.NVML_FI_DEV_NVLINK_LINK_COUNT:
                arr[i].value.ullVal = 2
            elif fid in (real_nvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, real_nvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES):
                arr[i].value.ullVal = int(t * 1e6 * (1 + h.index))
            elif fid in (real_nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, real_nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX):
                arr[i].value.ullVal = int(t * 1000 * (1 + scope))
            else:
                arr[i].nvmlReturn = real_nvml.NVML_ERROR_NOT_SUPPORTED
        return arr

    m.nvmlDeviceGetFieldValues = field_values
    m.nvmlDeviceGetPcieThroughput = lambda h, counter: 777 + counter

    def event_wait(es: Any, timeout_ms: int) -> Any:
        if state["xid_pending"]:
            state["xid_pending"] = False
            return types.SimpleNamespace(eventData=79, eventType=8)
        raise NVMLError(real_nvml.NVML_ERROR_TIMEOUT)

    m.nvmlEventSetCreate = lambda: object()
    m.nvmlDeviceRegisterEvents = lambda h, types_, es: None if xid_on in (None, h.index) else None
    m.nvmlEventSetWait = event_wait
    m.nvmlEventSetFree = lambda es: None

    def gpm_support(h: _Handle) -> Any:
        if not gpm:
            raise NVMLError(real_nvml.NVML_ERROR_NOT_SUPPORTED)
        return types.SimpleNamespace(isSupportedDevice=1)

    def gpm_sample_get(h: _Handle, sample: Any) -> Any:
        state["last_gpm"] = h.index
        return sample

    def gpm_metrics_get(mg: Any) -> Any:
        for i in range(mg.numMetrics):
            mg.metrics[i].value = mg.metrics[i].metricId + 0.5 * state["last_gpm"]
            mg.metrics[i].nvmlReturn = 0
        return mg

    m.nvmlGpmQueryDeviceSupport = gpm_support
    m.nvmlGpmSampleAlloc = lambda: real_nvml.c_nvmlGpmSample_t()
    m.nvmlGpmSampleGet = gpm_sample_get
    m.nvmlGpmMetricsGet = gpm_metrics_get
    m.nvmlGpmSampleFree = lambda s: None
    return m


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    return mod


def ident(local_rank: int, rank: int | None = None) -> RankIdentity:
    return RankIdentity(job="job1", rank=local_rank if rank is None else rank, local_rank=local_rank,
                        world_size=2, host="host-a", pid=1234)


class Sent:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def __call__(self, kind: str, body: dict[str, Any]) -> None:
        assert kind == "hw"
        with self.lock:
            self.bodies.append(body)

    def rows(self) -> list[tuple[int, int, dict[str, Any]]]:
        out = []
        for b in self.bodies:
            for i, (ts, dev) in enumerate(zip(b["ts_ns"], b["device"], strict=True)):
                out.append((ts, dev, {k: v[i] for k, v in b["metrics"].items() if v[i] is not None}))
        return out


def sampler(local_rank: int, sent: Sent, env: dict[str, str] | None = None, **kw: Any) -> HardwareSampler:
    return HardwareSampler(Settings(job_id="job1"), ident(local_rank), sent, env={} if env is None else env, **kw)


def envelope(body: dict[str, Any], seq: int = 1) -> Envelope:
    return Envelope(kind="hw", job="job1", rank=1, host="host-a", pid=1234, seq=seq, sent_ns=time.time_ns(), body=body)


def test_samples_the_local_ranks_gpu_and_bodies_pass_the_wire_schema(nvml: types.ModuleType) -> None:
    sent = Sent()
    s = sampler(1, sent)
    s.sample_once()
    time.sleep(0.2)
    s.sample_once()
    assert s.flush() and len(sent.bodies) == 1
    body = sent.bodies[0]
    assert body["device"] == [1, 1] and len(body["ts_ns"]) == 2
    assert all(len(v) == 2 for v in body["metrics"].values())
    last = sent.rows()[-1][2]
    assert last["gpu_util"] == 60 and last["mem_util"] == 45
    assert last["mem_used_bytes"] == 2 * GIB and last["mem_total_bytes"] == 80 * GIB
    assert last["power_w"] == 200.0 and last["temp_c"] == 50 and last["sm_clock_mhz"] == 1600
    assert last["throttle_reasons"] == 4.0 and isinstance(last["throttle_reasons"], float)
    assert last["pcie_tx_kbps"] == pytest.approx(2000, rel=0.1)      # 2 MB/s
    assert last["nvlink_tx_kbps"] == pytest.approx(3072, rel=0.1)    # (1000 + 2000) KiB/s
    assert last["gpm_sm_active_pct"] == 2.5 and last["gpm_tensor_active_pct"] == 5.5
    assert "ecc_uncorrected_volatile" not in body["metrics"]        # not supported: skipped quietly
    assert "pcie_tx_kbps" not in sent.rows()[0][2]                  # rates need two samples
    assert not any(d == -1 for d in body["device"])                 # host metrics: local rank 0 only
    # A real envelope round-trips and the sink turns it into hw_samples rows.
    env = decode(encode(envelope(body)))
    cols = Columns(TABLE_COLUMNS["hw_samples"])
    hw_columns(env, cols)
    assert cols.rows == sum(len([v for v in col if v is not None]) for col in body["metrics"].values())
    assert set(cols.data["device"]) == {1}
    s.stop()
    assert nvml.state["init"] == 1 and nvml.state["shutdown"] == 1


def test_gpu_choice_follows_cuda_visible_devices(nvml: types.ModuleType) -> None:
    assert pick_gpu(nvml, 1, {})[1] == 1
    assert pick_gpu(nvml, 0, {"CUDA_VISIBLE_DEVICES": "1"})[1] == 1           # one device per process
    assert pick_gpu(nvml, 1, {"CUDA_VISIBLE_DEVICES": "1,0"})[1] == 0
    assert pick_gpu(nvml, 0, {"CUDA_VISIBLE_DEVICES": "GPU-00000001"})[1] == 1  # UUID prefix
    assert pick_gpu(nvml, 0, {"CUDA_VISIBLE_DEVICES": ""}) is None
    assert pick_gpu(nvml, 3, {}) is None


def test_local_rank_without_a_gpu_warns_once_and_samples_nothing(nvml: types.ModuleType,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rankscope.hw")
    sent = Sent()
    s = sampler(5, sent)
    assert s.sample_once() == 0 and s.sample_once() == 0
    assert s.gpu_index is None and not s.flush()
    assert len([r for r in caplog.records if "no GPU for local rank 5" in r.getMessage()]) == 1


def test_host_metrics_on_local_rank_0_only(nvml: types.ModuleType) -> None:
    sent0, sent1 = Sent(), Sent()
    s0, s1 = sampler(0, sent0), sampler(1, sent1)
    for _ in range(2):
        s0.sample_once()
        s1.sample_once()
        time.sleep(1.0)   # per-core CPU is sampled at most once a second
    s0.flush()
    s1.flush()
    rows0 = sent0.rows()
    host = [m for _, d, m in rows0 if d == -1]
    gpu0 = [m for _, d, m in rows0 if d == 0]
    assert len(host) == 2 and len(gpu0) == 2
    last = host[-1]
    for name in ("cpu_util", "mem_used_bytes", "mem_total_bytes", "net_tx_bytes_s", "net_rx_bytes_s"):
        assert name in last, name
    assert 0 <= last["cpu_util"] <= 100
    assert 0 < last["mem_used_bytes"] < last["mem_total_bytes"]
    assert 0 <= last["cpu_util_core_max"] <= 100 and 0 <= last["cpu_cores_busy"] <= (os.cpu_count() or 1)
    assert not any(k.startswith("cpu_util_core") and k != "cpu_util_core_max" for k in last)
    assert gpu0[-1]["gpu_util"] == 10 and gpu0[-1]["mem_used_bytes"] == GIB   # same name, other device
    assert {d for _, d, _ in sent1.rows()} == {1}
    encode(envelope(sent0.bodies[0]))
    s0.stop()
    s1.stop()


def test_host_cpu_cores_become_the_busiest_core_and_a_busy_count() -> None:
    from collections import namedtuple

    from rankscope.producers.hw_host import HostSampler

    Times = namedtuple("Times", "user system idle iowait")
    busy = [5.0, 95.0, 100.0, 40.0]   # % of each core's next second

    class Ps:
        calls = 0

        def cpu_times(self, percpu: bool = False) -> Any:
            Ps.calls += 1
            if not percpu:
                return Times(1.0 * Ps.calls, 0.0, 1.0 * Ps.calls, 0.0)
            return [Times(b / 100 * Ps.calls, 0.0, (1 - b / 100) * Ps.calls, 0.0) for b in busy]

    host = HostSampler(Ps())
    first: dict[str, Any] = {}
    host._cores(first, 0.0)
    assert first == {}                      # no rate from the first reading
    out: dict[str, Any] = {}
    host._cores(out, 0.5)
    assert out == {}                        # per-core times are read at most once a second
    host._cores(out, 1.0)
    assert out == {"cpu_util_core_max": 100.0, "cpu_cores_busy": 2.0}


def test_fast_mode_samples_more_and_batches_per_message(nvml: types.ModuleType) -> None:
    sent = Sent()
    s = sampler(1, sent, period_s=0.2, fast_period_s=0.02, send_every_s=0.2).start()
    time.sleep(0.65)
    slow_samples, slow_msgs = s.samples, len(sent.bodies)
    s.set_fast(True)
    time.sleep(0.65)
    fast_samples = s.samples - slow_samples
    with sent.lock:
        fast_bodies = sent.bodies[slow_msgs:]
    s.stop()
    assert 2 <= slow_samples <= 6
    assert fast_samples >= 3 * slow_samples
    assert max(len(b["ts_ns"]) for b in fast_bodies) >= 4   # several fast samples in one message
    assert len(fast_bodies) <= 6
    for i, b in enumerate(sent.bodies):
        encode(envelope(b, seq=i + 1))


def test_samples_are_sent_every_hw_send_s_in_one_message(nvml: types.ModuleType) -> None:
    sent = Sent()
    settings = Settings(job_id="job1", hw_sample_s=0.02, hw_send_s=0.3)
    s = HardwareSampler(settings, ident(1), sent, env={}).start()
    assert s.send_every_s == 0.3
    deadline = time.monotonic() + 60
    while len(sent.bodies) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    s.stop()
    bodies = list(sent.bodies)
    assert len(bodies) >= 3
    assert max(len(b["ts_ns"]) for b in bodies[:-1]) >= 5          # several samples per message
    assert sum(len(b["ts_ns"]) for b in bodies) == s.samples        # every sample sent once (stop flushes)
    for i, b in enumerate(bodies):
        encode(envelope(b, seq=i + 1))


def test_a_body_is_sent_once_it_holds_max_rows(nvml: types.ModuleType) -> None:
    sent = Sent()
    s = sampler(0, sent, period_s=0.002, send_every_s=3600.0).start()   # GPU and host rows
    deadline = time.monotonic() + 60
    while len(sent.bodies) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    s.stop()
    assert len(sent.bodies) >= 2, "no body sent before send_every_s"
    assert all(len(b["ts_ns"]) <= MAX_ROWS_PER_BODY + 1 for b in sent.bodies)   # GPU and host row of one sample
    assert all(len(b["ts_ns"]) >= MAX_ROWS_PER_BODY for b in sent.bodies[:-1])


def test_leaving_fast_mode_does_not_sample_at_once(nvml: types.ModuleType) -> None:
    # A window's end is when its sender converts on the rank's cores: the slow period resumes from
    # the last sample instead of a sample (~1.4 ms of CPU on a busy host) at that moment.
    sent = Sent()
    s = sampler(1, sent, period_s=60.0, fast_period_s=0.02, send_every_s=60.0)
    starts: list[float] = []
    take = s.sample_once

    def recording_sample_once() -> int:
        starts.append(time.monotonic())
        return take()

    s.sample_once = recording_sample_once
    s.start()
    s.set_fast(True)
    deadline = time.monotonic() + 60
    while len(starts) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(starts) >= 4, "fast mode did not sample"
    s.set_fast(False)
    left_at = time.monotonic()
    time.sleep(0.5)
    after = [t for t in starts if t > left_at]
    s.stop()
    assert after == [], f"{len(after)} samples right after leaving fast mode"


def test_pcie_falls_back_to_throughput_without_field_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = fake_nvml(fields=False, gpm=False)
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    sent = Sent()
    s = sampler(0, sent)
    s.host_enabled = False
    s.sample_once()
    s.flush()
    m = sent.rows()[0][2]
    assert m["pcie_tx_kbps"] == 777.0 and m["pcie_rx_kbps"] == 778.0
    assert "nvlink_tx_kbps" not in m and not any(k.startswith("gpm_") for k in m)


def test_xid_event_is_reported_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(xid_on=0))
    sent = Sent()
    s = sampler(0, sent)
    s.host_enabled = False
    s.sample_once()
    s.sample_once()
    s.flush()
    assert sent.bodies[0]["metrics"]["xid"] == [79.0, None]


def test_failing_nvml_calls_never_raise(nvml: types.ModuleType) -> None:
    sent = Sent()
    s = sampler(1, sent)
    s.sample_once()

    def boom(*a: Any) -> Any:
        raise RuntimeError("boom")

    for name in ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetFieldValues",
                 "nvmlGpmSampleGet"):
        setattr(nvml, name, boom)
    for _ in range(3):
        s.sample_once()
    s.flush()
    last = sent.rows()[-1][2]
    assert "gpu_util" not in last and last["power_w"] == 200.0


def _real_nvml_works() -> bool:
    try:
        real_nvml.nvmlInit()
        real_nvml.nvmlShutdown()
        return True
    except Exception:
        return False


def test_real_nvml_gpu_rows_or_one_log_line_and_host_metrics_only(caplog: pytest.LogCaptureFixture) -> None:
    """With the real pynvml: on a machine without an NVIDIA driver, one log line and host metrics
    only; with a driver, GPU rows and no such line (the injected no-driver cases are below)."""
    driver = _real_nvml_works()
    assert importlib.import_module("pynvml") is real_nvml
    caplog.set_level(logging.INFO, logger="rankscope.hw")
    sent = Sent()
    s = sampler(0, sent)
    for _ in range(3):
        s.sample_once()
        time.sleep(0.05)   # CPU times tick at 100 Hz
    s.flush()
    lines = [r for r in caplog.records if NO_NVML_MESSAGE in r.getMessage()]
    devices = {d for _, d, _ in sent.rows()}
    if driver:
        assert lines == [] and any(d >= 0 for d in devices)
    else:
        assert len(lines) == 1 and lines[0].levelno in (logging.INFO, logging.WARNING)
        assert devices == {-1}
    assert any("cpu_util" in row[2] for row in sent.rows() if row[1] == -1)
    s.stop()


@pytest.mark.parametrize("module", [None, "init_error"])
def test_missing_pynvml_or_driver_is_one_line(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                             module: str | None) -> None:
    fake = None if module is None else fake_nvml(init_error=real_nvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monkeypatch.setitem(sys.modules, "pynvml", fake)   # None: "import pynvml" raises ImportError
    caplog.set_level(logging.INFO, logger="rankscope.hw")
    sent = Sent()
    s = sampler(0, sent)
    s.sample_once()
    s.sample_once()
    assert len([r for r in caplog.records if NO_NVML_MESSAGE in r.getMessage()]) == 1
    assert s.gpu_index is None and s.host is not None


def test_stop_flushes_and_is_idempotent(nvml: types.ModuleType) -> None:
    sent = Sent()
    s = sampler(1, sent, period_s=10.0).start()
    deadline = time.monotonic() + 5
    while s.samples < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    s.stop()
    s.stop()
    assert len(sent.bodies) == 1 and sent.bodies[0]["device"] == [1]
    assert not s._thread.is_alive()
    assert nvml.state["shutdown"] == 1


class RecordingTransport:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes]] = []
        self.dropped = 0

    def send(self, topic: str, key: bytes, value: bytes) -> bool:
        self.sent.append((topic, key, value))
        return True

    def close(self, timeout_s: float) -> None:
        pass


def test_tracer_sends_hw_on_the_hw_topic_with_rank_key(nvml: types.ModuleType) -> None:
    t = RecordingTransport()
    settings = Settings(job_id="job9", rank=3, world_size=4, local_rank=1, heartbeat_s=60, hw_sample_s=0.05,
                        topic_prefix="x.", control_enabled=False)
    tracer = Tracer(settings, transport=t, install_collective_timing=False, handle_signals=False)
    assert tracer.hw_sampler is not None
    deadline = time.monotonic() + 5
    while tracer.hw_sampler.messages < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    tracer.close()
    hw = [(k, decode(v)) for topic, k, v in t.sent if topic == "x.hw"]
    assert hw and all(k == b"job9/3" and e.kind == "hw" and e.rank == 3 for k, e in hw)
    assert {d for _, e in hw for d in e.body["device"]} == {1}
    assert decode(t.sent[-1][2]).kind == "exit"


def test_hw_sampling_can_be_turned_off() -> None:
    t = RecordingTransport()
    tracer = Tracer(Settings(job_id="j", hw_sample_s=0, control_enabled=False), transport=t,
                    install_collective_timing=False, handle_signals=False)
    assert tracer.hw_sampler is None
    tracer.close()
    with pytest.raises(ConfigError):
        Settings(hw_sample_s=-1)
    assert Settings.from_env({"RANKSCOPE_HW_SAMPLE_S": "0.5"}).hw_sample_s == 0.5
    with pytest.raises(ConfigError):
        Settings(hw_send_s=0)
    assert Settings.from_env({"RANKSCOPE_HW_SEND_S": "2"}).hw_send_s == 2.0
