"""The project-managed Apache Kafka broker: single node, KRaft (combined broker + controller), loopback.

Jars come from Maven Central via ``cli/stack/kafka/pom.xml`` into ``<cache_dir>/kafka-<version>/libs``
(once); state lives in ``<data_dir>/kafka/`` (server.properties, data/, broker.log, server.log,
broker.pid). The broker is a detached ``java`` process, so it outlives the command that started it
and is found again through the pid file.
cli/stack/broker_cluster.py starts N such nodes as one cluster.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.cli.stack.admin import kafka_answers
from rankscope.config import Settings

log = logging.getLogger(__name__)

KAFKA_RESOURCES = Path(__file__).resolve().parent / "kafka"
POM = KAFKA_RESOURCES / "pom.xml"
LOG4J2_CONFIG = KAFKA_RESOURCES / "log4j2.properties"
# Kafka's own log4j2 version per release (the SLF4J 1.x binding must match it).
LOG4J2_FOR_KAFKA = {"4.3.1": "2.25.4", "4.4.0": "2.25.5"}
JVM_HEAP = ["-Xms256m", "-Xmx768m"]
_COMPLETE_MARKER = ".complete"


class BrokerError(RuntimeError):
    """The local broker could not be prepared, started or stopped."""


def new_cluster_id() -> str:
    """16 random bytes, URL-safe base64 without padding (22 chars), not starting with '-'."""
    while True:
        cid = base64.urlsafe_b64encode(os.urandom(16)).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError, OSError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our own child that exited: reap it
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


@dataclass(frozen=True)
class SaslSslListener:
    """A second listener, ``SASL_SSL://127.0.0.1:<port>``, beside the PLAINTEXT one (which stays for
    the broker's own readiness probe and inter-broker traffic on loopback).

    ``keystore`` is a PKCS12 file holding the broker's key and a certificate for 127.0.0.1;
    ``users`` (name -> password) become SCRAM credentials of ``mechanism`` when the storage is
    formatted, so they apply to a broker whose data dir is new.
    """

    port: int
    keystore: Path
    keystore_password: str = field(repr=False)
    users: Mapping[str, str] = field(default_factory=dict, repr=False)
    mechanism: str = "SCRAM-SHA-512"

    def server_properties(self, host: str) -> dict[str, str]:
        return {
            "sasl.enabled.mechanisms": self.mechanism,
            f"listener.name.sasl_ssl.{self.mechanism.lower()}.sasl.jaas.config":
                "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(self.keystore),
            "ssl.keystore.password": self.keystore_password,
            "ssl.client.auth": "none",
        }

    def scram_args(self) -> list[str]:
        return [a for name, pw in self.users.items()
                for a in ("--add-scram", f"{self.mechanism}=[name={name},password={pw}]")]


class LocalBroker:
    """One single-node KRaft broker on 127.0.0.1:settings.kafka_port (and ``sasl_ssl.port`` when given).

    The keyword arguments make it one node of a LocalCluster (cli/stack/broker_cluster.py) instead: its ``node_id``, its
    ports, every voter of the quorum (node id -> controller port), its own ``home``, the cluster id
    its storage is formatted with, the replication of the internal topics (min ISR one less), and
    the JVM flags (heap). ``settings.kafka_jvm_opts`` is appended to the JVM flags either way.
    """

    def __init__(self, settings: Settings, sasl_ssl: SaslSslListener | None = None, *, node_id: int = 1,
                 port: int | None = None, controller_port: int | None = None,
                 voters: Mapping[int, int] | None = None, home: Path | None = None,
                 cluster_id: str | None = None, replication: int = 1,
                 jvm_opts: Sequence[str] = tuple(JVM_HEAP)) -> None:
        self.settings = settings
        self.sasl_ssl = sasl_ssl
        self.version = settings.kafka_version
        self.host = "127.0.0.1"
        self.node_id = node_id
        self.port = port or settings.kafka_port
        self.controller_port = controller_port or settings.kafka_controller_port
        self.voters = dict(voters) if voters else {node_id: self.controller_port}
        self.cluster_id = cluster_id
        self.replication = replication
        self.jvm_opts = [*jvm_opts, *shlex.split(settings.kafka_jvm_opts)]
        self.libs_dir = Path(settings.cache_dir).expanduser().resolve() / f"kafka-{self.version}" / "libs"
        self.home = home.expanduser().resolve() if home else Path(settings.data_dir).expanduser().resolve() / "kafka"
        self.config_path = self.home / "server.properties"
        self.log_dirs = self.home / "data"
        self.log_path = self.home / "broker.log"      # JVM stdout/stderr (WARN and above)
        self.server_log_path = self.home / "server.log"  # log4j2 INFO file
        self.pid_path = self.home / "broker.pid"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def sasl_ssl_bootstrap(self) -> str:
        if self.sasl_ssl is None:
            raise BrokerError("this broker has no SASL_SSL listener")
        return f"{self.host}:{self.sasl_ssl.port}"

    # Configuration ----------------------------------------------------------------------------
    def server_properties(self) -> dict[str, str]:
        ctrl = f"{self.host}:{self.controller_port}"
        rf, min_isr = str(self.replication), str(max(1, self.replication - 1))
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": ",".join(f"{n}@{self.host}:{p}" for n, p in sorted(self.voters.items())),
            "listeners": f"PLAINTEXT://{self.bootstrap},CONTROLLER://{ctrl}",
            "advertised.listeners": f"PLAINTEXT://{self.bootstrap}",
            "inter.broker.listener.name": "PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.log_dirs),
            "num.partitions": "1",
            "default.replication.factor": rf,
            "auto.create.topics.enable": "false",
            "offsets.topic.replication.factor": rf,
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": min_isr,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": min_isr,
            "group.initial.rebalance.delay.ms": "0",
            "log.retention.hours": "24",
        }
        if self.replication > 1:
            # The cluster's default for topics (and __consumer_offsets, which has none of its own):
            # an acks=all write is on two replicas when one node is lost.
            props["min.insync.replicas"] = min_isr
        if self.sasl_ssl is not None:
            secure = f"SASL_SSL://{self.sasl_ssl_bootstrap}"
            props["listeners"] += f",{secure}"
            props["advertised.listeners"] += f",{secure}"
            props["listener.security.protocol.map"] += ",SASL_SSL:SASL_SSL"
            props.update(self.sasl_ssl.server_properties(self.host))
        return props

    def write_config(self) -> Path:
        self.home.mkdir(parents=True, exist_ok=True)
        body = "".join(f"{k}={v}\n" for k, v in self.server_properties().items())
        self.config_path.write_text("# Written by cli/stack/broker.py; rewritten on every start.\n" + body)
        self.config_path.chmod(0o600)  # may hold the keystore password
        return self.config_path

    # Jars ---------------------------------------------------------------------------------------
    def ensure_jars(self) -> Path:
        """Resolve the broker jars from Maven Central into ``libs_dir`` once (idempotent)."""
        if (self.libs_dir / _COMPLETE_MARKER).exists():
            return self.libs_dir
        mvn = shutil.which("mvn")
        if mvn is None:
            raise BrokerError("Maven ('mvn') not found on PATH; it is needed once to fetch the Kafka "
                              f"{self.version} jars into {self.libs_dir}. Install Maven 3.8+ or set "
                              "RANKSCOPE_BOOTSTRAP_SERVERS to use an external Kafka.")
        self._java()  # fail early with a clear message
        self.libs_dir.parent.mkdir(parents=True, exist_ok=True)
        with self._lock(self.libs_dir.parent / ".lock"):
            if (self.libs_dir / _COMPLETE_MARKER).exists():
                return self.libs_dir
            tmp = self.libs_dir.parent / f"libs.tmp{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            cmd = [mvn, "-q", "-B", "-f", str(POM), f"-Dkafka.version={self.version}",
                   f"-Drankscope.libs.dir={tmp}"]
            if self.version in LOG4J2_FOR_KAFKA:
                cmd.append(f"-Dlog4j2.version={LOG4J2_FOR_KAFKA[self.version]}")
            cmd.append("dependency:copy-dependencies@copy-libs")
            log.info("fetching Kafka %s jars with Maven into %s", self.version, self.libs_dir)
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                                     cwd=self.libs_dir.parent, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired as e:
                raise BrokerError(f"Maven timed out fetching Kafka {self.version} jars") from e
            if res.returncode != 0 or not any(tmp.glob(f"kafka_2.13-{self.version}.jar")):
                shutil.rmtree(tmp, ignore_errors=True)
                out = "\n".join((res.stdout + res.stderr).splitlines()[-30:])
                raise BrokerError(f"Maven failed to fetch Kafka {self.version} jars "
                                  f"(rc={res.returncode}):\n{out}")
            (tmp / _COMPLETE_MARKER).write_text(self.version + "\n")
            shutil.rmtree(self.libs_dir, ignore_errors=True)
            tmp.rename(self.libs_dir)
        return self.libs_dir

    # Process ------------------------------------------------------------------------------------
    def pid(self) -> int | None:
        """Pid of the running broker from the pid file, or None."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None
        if not _pid_alive(pid):
            return None
        try:  # guard against pid reuse: must be our kafka.Kafka with our config
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"kafka.Kafka" not in cmdline or str(self.config_path).encode() not in cmdline:
                return None
        except OSError:
            pass
        return pid

    def is_running(self) -> bool:
        return self.pid() is not None

    def start(self, timeout_s: float = 90.0) -> str:
        """Start the broker (or reuse a running one) and wait until it serves metadata."""
        self.home.mkdir(parents=True, exist_ok=True)
        with self._lock(self.home / ".lock"):
            if self.is_running():
                self._wait_ready(timeout_s, proc=None)
                log.info("reusing running Kafka broker at %s (pid %s)", self.bootstrap, self.pid())
                return self.bootstrap
            t0 = time.monotonic()
            proc = self.launch()
            try:
                self._wait_ready(timeout_s, proc=proc)
            except BrokerError:
                self.stop(timeout_s=10)
                raise
            log.info("Kafka %s broker ready at %s in %.1fs (pid %d)", self.version, self.bootstrap,
                     time.monotonic() - t0, proc.pid)
            return self.bootstrap

    def launch(self) -> subprocess.Popen[bytes]:
        """Check the ports, write the config, format the storage (once) and start the ``java``
        process without waiting for it to be ready. The caller holds the home's lock, or owns the home."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.pid_path.unlink(missing_ok=True)
        for port in (self.port, self.controller_port, *([self.sasl_ssl.port] if self.sasl_ssl else [])):
            if port_open(self.host, port):
                raise BrokerError(
                    f"port {port} on {self.host} is already in use by another process (not the broker "
                    f"of {self.home}); choose other ports (RANKSCOPE_KAFKA_PORT / kafka_controller_port) "
                    "or point RANKSCOPE_BOOTSTRAP_SERVERS at that cluster")
        libs = self.ensure_jars()
        java = self._java()
        self.write_config()
        self._format(java, libs)
        cmd = [java, *self.jvm_opts, "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
               "-cp", f"{libs}/*", *self._log_props(), "kafka.Kafka", str(self.config_path)]
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n=== rankscope: starting Kafka {self.version} at {time.ctime()} ===\n".encode())
            logf.flush()
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf,
                                          stderr=subprocess.STDOUT, cwd=self.home,
                                          start_new_session=True)
        self.pid_path.write_text(f"{self._proc.pid}\n")
        return self._proc

    def stop(self, timeout_s: float = 30.0) -> bool:
        """SIGTERM the broker, wait up to ``timeout_s``, then SIGKILL. False if it was not running."""
        pid = self.pid()
        if pid is None:
            self.pid_path.unlink(missing_ok=True)
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not self._wait_exit(pid, timeout_s):
            log.warning("Kafka broker pid %d ignored SIGTERM for %.0fs; killing it", pid, timeout_s)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._wait_exit(pid, 10)
        self.pid_path.unlink(missing_ok=True)
        self._proc = None
        return True

    # Internals ----------------------------------------------------------------------------------
    def kill9(self) -> int | None:
        """SIGKILL the broker's ``java`` process (no shutdown hook, no controlled shutdown) and reap it.
        Returns the pid killed, or None when it was not running."""
        pid = self.pid()
        if pid is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if not self._wait_exit(pid, 30):
            raise BrokerError(f"Kafka broker pid {pid} outlived SIGKILL for 30 s")
        self.pid_path.unlink(missing_ok=True)
        self._proc = None
        return pid

    def _wait_exit(self, pid: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.pid == pid:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=0.2)
                    return True
            elif not _pid_alive(pid):
                return True
            else:
                time.sleep(0.1)
        return not _pid_alive(pid)

    def _wait_ready(self, timeout_s: float, proc: subprocess.Popen[bytes] | None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise BrokerError(f"Kafka broker exited with code {proc.returncode} during start-up.\n"
                                  + self._diagnostics())
            if proc is None and not self.is_running():
                raise BrokerError("Kafka broker process from the pid file died.\n" + self._diagnostics())
            if port_open(self.host, self.port) and kafka_answers(self.bootstrap, timeout_s=2.0):
                return
            time.sleep(0.2)
        raise BrokerError(f"Kafka broker at {self.bootstrap} not ready after {timeout_s:.0f}s.\n"
                          + self._diagnostics())

    def _diagnostics(self, n: int = 30) -> str:
        parts = []
        for path in (self.log_path, self.server_log_path):
            lines = _tail(path, n)
            if lines:
                parts.append(f"--- last {len(lines)} lines of {path} ---\n" + "\n".join(lines))
        return "\n".join(parts) or f"(no log output in {self.home})"

    def _log_props(self) -> list[str]:
        return [f"-Dlog4j2.configurationFile={LOG4J2_CONFIG}", f"-Dkafka.logs.dir={self.home}"]

    def _format(self, java: str, libs: Path) -> None:
        if (self.log_dirs / "meta.properties").exists():
            return
        self.log_dirs.mkdir(parents=True, exist_ok=True)
        cmd = [java, *self.jvm_opts, "-cp", f"{libs}/*", *self._log_props(), "kafka.tools.StorageTool",
               "format", "-t", self.cluster_id or new_cluster_id(), "-c", str(self.config_path), "--ignore-formatted",
               *(self.sasl_ssl.scram_args() if self.sasl_ssl else [])]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=self.home,
                             stdin=subprocess.DEVNULL)
        if res.returncode != 0:
            out = res.stdout + res.stderr
            for secret in (self.sasl_ssl.users.values() if self.sasl_ssl else ()):
                out = out.replace(secret, "***")
            raise BrokerError(f"formatting Kafka storage in {self.log_dirs} failed (rc={res.returncode}):\n"
                              + "\n".join(out.splitlines()[-30:]))

    @staticmethod
    def _java() -> str:
        home = os.environ.get("JAVA_HOME")
        java = str(Path(home) / "bin" / "java") if home and (Path(home) / "bin" / "java").exists() \
            else shutil.which("java")
        if java is None:
            raise BrokerError("Java not found (no JAVA_HOME, no 'java' on PATH); Kafka 4.x needs Java 17+. "
                              "Install OpenJDK 17 or set RANKSCOPE_BOOTSTRAP_SERVERS to use an external Kafka.")
        return java

    @staticmethod
    @contextlib.contextmanager
    def _lock(path: Path) -> Iterator[None]:
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def ensure_broker(settings: Settings, timeout_s: float = 90.0) -> str:
    """Bootstrap address to use: the external cluster if configured, else the (started) local broker."""
    if settings.bootstrap_servers:
        return settings.bootstrap_servers
    return LocalBroker(settings).start(timeout_s=timeout_s)
