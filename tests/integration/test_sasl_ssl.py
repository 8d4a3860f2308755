"""Every Kafka client over SASL_SSL (SCRAM-SHA-512, certificates from a test CA) against a real broker.

The module's broker has a SASL_SSL listener on loopback; every client below is given only that
listener's address. A rank (Tracer), the sink, the CLI, the dashboard's control request, the
processors (confluent-kafka stage one and faust/aiokafka stage two) and the load generator work
over it; a wrong password gives one clear error per process and the clients stop trying (the
broker's own count of failed logins stops growing); the password appears in no log.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import Consumer

from rankscope.cli.stack.admin import ensure_topics
from rankscope.cli.stack.broker import LocalBroker
from rankscope.config import Settings
from rankscope.dashboard import control
from rankscope.kafka_client import client_conf
from rankscope.producers.tracer import Tracer
from rankscope.protocol.alerts import Alert
from rankscope.storage.sink import Sink
from rankscope.storage.store import close_store, open_store
from rankscope.topics import Topic
from tests.integration.helpers import REPO, child_env, free_port, stop_process, tail, wait_until
from tests.integration.tls_broker import USER, LocalCa, client_settings, make_test_ca, sasl_ssl_broker

pytestmark = [pytest.mark.kafka, pytest.mark.clickhouse]

PASSWORD = "pw-" + secrets.token_urlsafe(18)   # random, so that finding it anywhere is a leak
CLEAR = f"Kafka authentication failed for user '{USER}'"


@dataclass
class Secure:
    broker: LocalBroker
    ca: LocalCa
    work: Path

    def client(self, name: str, password: str = PASSWORD, **kw: object) -> Settings:
        folder = self.work / name
        folder.mkdir(exist_ok=True)
        base = Settings(data_dir=str(folder), clickhouse_dsn=f"chdb://{folder / 'ch'}",
                        topic_prefix=f"s{uuid.uuid4().hex[:8]}.")
        return client_settings(base, self.broker, self.ca, password, **kw)

    def failed_logins(self) -> int:
        """Failed authentications the broker has logged (one line per attempt)."""
        return self.broker.server_log_path.read_text(errors="replace").count("Failed authentication with")


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    work = tmp_path_factory.mktemp("sasl")
    ca = make_test_ca(work / "ca")
    settings = Settings(data_dir=str(work / "broker"), kafka_port=free_port(), kafka_controller_port=free_port())
    broker = sasl_ssl_broker(settings, ca, free_port(), PASSWORD)
    broker.start(timeout_s=120)
    try:
        yield Secure(broker, ca, work)
    finally:
        broker.stop()


def run_cli(settings: Settings, log: Path, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([sys.executable, "-m", "rankscope", *args], env=child_env(settings), cwd=REPO,
                         capture_output=True, text=True, timeout=timeout_s)
    log.write_text(res.stdout + res.stderr)
    return res


def spawn(settings: Settings, log: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, *args], env=child_env(settings), cwd=REPO, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def read_alerts(settings: Settings, job: str, until: callable, timeout_s: float) -> list[Alert]:  # type: ignore[valid-type]
    consumer = Consumer({**client_conf(settings, fatal=True), "group.id": f"test-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([Topic.ALERTS.name_for(settings)])
    got: list[Alert] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not until(got):
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                alert = Alert.from_json(msg.value())
                if alert.job == job:
                    got.append(alert)
    finally:
        consumer.close()
    return got


def test_a_rank_the_sink_the_cli_and_the_dashboard_work_over_sasl_ssl(
        secure: Secure, capfd: pytest.CaptureFixture[str]) -> None:
    s = secure.client("rank-sink", sink_batch_s=0.5, hw_sample_s=0.0)
    ensure_topics(s, timeout_s=60)                      # admin client over SASL_SSL
    status = run_cli(s, secure.work / "cli-status.log", "kafka", "status")
    assert status.returncode == 0 and f"external Kafka {secure.broker.sasl_ssl_bootstrap} answers" in status.stdout, \
        status.stdout + status.stderr
    job = f"sasl-{uuid.uuid4().hex[:6]}"
    store = open_store(s.store_dsn)
    sink = Sink(s, store)
    stop = threading.Event()
    sink_thread = threading.Thread(target=sink.run, args=(stop,), daemon=True)
    sink_thread.start()
    tracer = Tracer(s.with_overrides(job_id=job, rank=0, world_size=1, local_rank=0),
                    install_collective_timing=False, handle_signals=False)
    stepping = threading.Event()

    def train() -> None:
        while not stepping.is_set():
            tracer.step()
            time.sleep(0.05)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        rows = wait_until(lambda: store.query_rows("SELECT count() FROM rankscope.steps WHERE job = {j:String}",
                                                   {"j": job})[0][0] >= 20, 90, "the rank's steps in the store")
        assert rows
        # The dashboard's control request reaches the rank's control listener; its ack comes back.
        acks: list[control.Ack] = []

        def answered() -> bool:
            acks.extend(control.request_window(s, control.TraceRequest(job=job, stop=True), wait_s=3,
                                               expect_ranks=[0]))
            return any(a.rank == 0 for a in acks)

        wait_until(answered, 90, "rank 0's ack to the dashboard's request")
    finally:
        stepping.set()
        trainer.join(10)
        tracer.close()
        stop.set()
        sink_thread.join(30)
        close_store(s.store_dsn)
    out, err = capfd.readouterr()
    (secure.work / "in-process.log").write_text(out + err)
    assert CLEAR not in out + err, out + err


def test_the_processors_consume_and_alert_on_a_planted_hang_over_sasl_ssl(secure: Secure) -> None:
    s = secure.client("processors", hang_min_s=8.0)
    ensure_topics(s, timeout_s=60)
    job = f"hang-{uuid.uuid4().hex[:6]}"
    processors = spawn(s, secure.work / "processors.log", "-m", "rankscope", "processors")
    load = spawn(s, secure.work / "loadgen.log", "-m", "benchmarks.loadgen", "--ranks", "8", "--duration", "90",
                 "--procs", "1", "--job", job, "--no-hw", "--hang-at", "10", "--hang-rank", "3")
    try:
        got = read_alerts(s, job, lambda a: any(x.kind == "hang" and x.status == "open" for x in a), 150)
        hangs = [a for a in got if a.kind == "hang" and a.status == "open"]
        assert hangs, f"no hang alert; got {[a.summary for a in got]}\n{tail(secure.work / 'processors.log')}"
        assert 3 in hangs[0].ranks, hangs[0].summary
        # A CLI consumer reads the same alert over SASL_SSL.
        res = run_cli(s, secure.work / "cli-alerts.log", "alerts", "--job", job, "--json", "--timeout", "5")
        assert res.returncode == 0 and hangs[0].alert_id in res.stdout, res.stdout + res.stderr
    finally:
        stop_process(load)
        stop_process(processors)
    log = (secure.work / "processors.log").read_text(errors="replace")
    assert "assigned steps partitions" in log and CLEAR not in log, tail(secure.work / "processors.log")


RANK_SCRIPT = """
import time
from rankscope.producers.tracer import Tracer
t = Tracer(job_id="wrong-pw", rank=0, world_size=1, local_rank=0, hw_sample_s=0.0,
           install_collective_timing=False, handle_signals=False)
deadline = time.monotonic() + {seconds}
while time.monotonic() < deadline:
    t.step()
    time.sleep(0.05)
t.close()
print("training finished", flush=True)
"""


def test_a_wrong_password_gives_one_clear_error_per_process_and_no_retry_storm(secure: Secure) -> None:
    good = secure.client("wrong-setup")
    ensure_topics(good, timeout_s=60)
    bad = good.with_overrides(kafka_sasl_password="not-" + PASSWORD[::-1], data_dir=str(secure.work / "wrong"))
    logs = {name: secure.work / f"wrong-{name}.log" for name in ("rank", "sink", "cli", "processors")}
    before = secure.failed_logins()
    t0 = time.monotonic()
    procs = {
        "rank": spawn(bad, logs["rank"], "-c", RANK_SCRIPT.format(seconds=40)),
        "sink": spawn(bad, logs["sink"], "-m", "rankscope", "sink"),
        "cli": spawn(bad, logs["cli"], "-m", "rankscope", "alerts", "--timeout", "30"),
        "processors": spawn(bad, logs["processors"], "-m", "rankscope", "processors"),
    }
    try:
        # The services and the CLI stop by themselves, non-zero; the rank keeps training.
        wait_until(lambda: all(procs[n].poll() is not None for n in ("sink", "cli", "processors")), 90,
                   "sink, CLI and processors to exit")
        wait_until(lambda: CLEAR in logs["rank"].read_text(errors="replace"), 60, "the rank's error line")
        last = [secure.failed_logins()]

        def no_new_attempts() -> bool:
            time.sleep(3)
            now = secure.failed_logins()
            same = now == last[0]
            last[0] = now
            return same

        wait_until(no_new_attempts, 90, "the broker's failed logins to stop growing")
        stopped_s = time.monotonic() - t0
        assert procs["rank"].poll() is None, tail(logs["rank"])
        settled = secure.failed_logins()
        time.sleep(10)   # the rank goes on training for this long: its clients must not try again
        after = secure.failed_logins()
        assert procs["rank"].poll() is None, tail(logs["rank"])
        assert procs["rank"].wait(60) == 0
    finally:
        for p in procs.values():
            stop_process(p)
    for name in ("sink", "cli", "processors"):
        assert procs[name].returncode not in (0, None), (name, tail(logs[name]))
    for name, path in logs.items():
        lines = path.read_text(errors="replace").splitlines()
        clear = [ln for ln in lines if CLEAR in ln]
        auth = [ln for ln in lines if "authentication" in ln.lower()]
        shown = f"{name}:\n" + "\n".join(lines)
        assert len(clear) == 1, shown
        assert len(auth) <= 3, shown               # no retry storm in the log
        assert len(lines) <= 12, shown
    assert "training finished" in logs["rank"].read_text()
    print(f"failed logins at the broker: {settled - before} until every client stopped "
          f"({stopped_s:.1f}s), {after - settled} in the next 10 s")
    assert after - settled == 0, (settled - before, after - settled)


def test_the_password_is_in_no_log_or_file(secure: Secure) -> None:
    """Scans everything the module wrote: client and service logs, captured output, broker logs and config."""
    scanned = 0
    for path in secure.work.rglob("*"):
        if path.is_file():
            scanned += 1
            assert PASSWORD.encode() not in path.read_bytes(), path
            assert PASSWORD[::-1].encode() not in path.read_bytes(), path
    broker_logs = [secure.broker.log_path, secure.broker.server_log_path]
    assert all(p.is_relative_to(secure.work) for p in broker_logs)
    assert scanned > 10 and secure.broker.server_log_path.stat().st_size > 0
