"""One typed, frozen configuration object, built once at start-up from env vars and flags.

Every setting has an env var ``RANKSCOPE_<NAME>`` (upper-case field name). Flags given on the
command line override env vars. The object is passed down explicitly; nothing reads the
environment after start-up.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit


class ConfigError(ValueError):
    """A setting has a value outside its allowed range or of the wrong type."""


def _default_data_dir() -> str:
    return str(Path.cwd() / ".rankscope")


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "rankscope")


PRODUCER_COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")
LOG_FORMATS = ("text", "json")
# Set by the supervisor for each child: how many times it restarted that service before. Not a setting.
RESTARTS_ENV = "RANKSCOPE_RESTARTS"


# the services that serve /metrics, and the setting that holds each one's port
METRICS_PORTS = {"processors": "metrics_port_processors", "sink": "metrics_port_sink", "serve": "metrics_port_serve"}


@dataclass(frozen=True)
class Settings:
    """All rankscope settings. See README "Settings" for each one."""

    # Where everything local lives: broker logs, chDB data, pid files.
    data_dir: str = field(default_factory=_default_data_dir)
    # Downloaded artifacts (Kafka jars), kept across clones.
    cache_dir: str = field(default_factory=_default_cache_dir)
    # Kafka. Empty bootstrap = the project-managed local broker on 127.0.0.1:kafka_port.
    bootstrap_servers: str = ""
    kafka_port: int = 9092
    kafka_controller_port: int = 9093
    kafka_version: str = "4.3.1"
    # Extra JVM options of the managed local broker(s), after the heap flags; shell-quoted words.
    kafka_jvm_opts: str = ""
    topic_prefix: str = "rankscope."
    topic_partitions: int = 4
    # Topic durability, applied when rankscope creates its topics: replicas per partition and
    # min.insync.replicas (0 = the cluster's default.replication.factor / min.insync.replicas), and
    # retention overrides in hours, "topic=hours,..." over the defaults in rankscope/topics.py.
    topic_replication: int = 0
    topic_min_insync: int = 0
    topic_retention_h: str = ""
    # Kafka security, for every client (rankscope/kafka_client.py). Secrets stay out of repr and logs.
    kafka_security_protocol: str = "PLAINTEXT"  # PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL
    kafka_sasl_mechanism: str = "SCRAM-SHA-512"  # SCRAM-SHA-512, SCRAM-SHA-256 or PLAIN
    kafka_sasl_username: str = ""
    kafka_sasl_password: str = field(default="", repr=False)
    kafka_ssl_ca_file: str = ""      # PEM CA that signed the brokers' certificates; empty = system CAs
    kafka_ssl_cert_file: str = ""    # PEM client certificate (mutual TLS), with kafka_ssl_key_file
    kafka_ssl_key_file: str = ""
    kafka_extra: str = field(default="", repr=False)  # more librdkafka properties: "k=v,k=v" or a JSON object
    # ClickHouse: chdb:///path (embedded) or http://host:8123 (server). Empty = chdb in data_dir.
    clickhouse_dsn: str = ""
    clickhouse_user: str = ""        # server DSN only; overrides a user in the DSN
    clickhouse_password: str = field(default="", repr=False)
    clickhouse_ca_file: str = ""     # https DSN: PEM CA of the server's certificate; empty = system CAs
    clickhouse_verify: bool = True   # https DSN: verify the server's certificate
    # Days each expiring table keeps its rows, "table=days,..." over the defaults in rankscope/retention.py.
    store_ttl_days: str = ""
    # Dashboard / serve process.
    dashboard_port: int = 8501
    dashboard_refresh_s: float = 2.0
    # Address the dashboard binds. Any non-loopback address requires dashboard_password.
    dashboard_host: str = "127.0.0.1"
    dashboard_password: str = field(default="", repr=False)
    # A sign-in lasts this many hours in its browser (a signed cookie). Cookies are signed with a key
    # derived from the password and dashboard_secret; empty = a random key kept in data_dir.
    dashboard_session_h: float = 12.0
    dashboard_secret: str = field(default="", repr=False)
    # Sink.
    sink_batch_rows: int = 200000
    sink_batch_s: float = 0.5
    sink_ranks_s: float = 2.0   # a rank that only progressed is upserted into `ranks` at most this often
    sink_group: str = "rankscope-sink"
    # Processors.
    processors_app_id: str = "rankscope-processors"
    processors_web_port: int = 6066
    scan_interval_s: float = 1.0
    hang_min_s: float = 10.0
    hang_factor: float = 8.0
    dead_after_s: float = 6.0
    stats_every_steps: int = 10
    straggler_window: int = 20
    straggler_min_steps: int = 8
    straggler_z: float = 4.0
    straggler_min_rel: float = 0.25
    straggler_persist: int = 3
    straggler_min_s: float = 10.0        # the slow-rank rule judges the last >= this many seconds ...
    straggler_min_slow_steps: int = 20   # ... and >= this many steps of the job
    straggler_cost_gate: float = 0.05    # a slow rank is alerted when it costs this share of the job's time
    report_deadline_s: float = 30.0
    rebuild_horizon_s: float = 60.0  # a worker taking a partition rebuilds its ranks from this much recent input
    incident_horizon_s: float = 86400.0  # ... and takes back open incidents published this recently
    job_idle_s: float = 300.0        # a job with no message for this long is forgotten
    processors_batch: int = 2000     # messages folded per batch
    auto_trace_steps: int = 5
    auto_trace_interval_s: float = 600.0
    # Producer (rank side).
    job_id: str = ""
    rank: int = -1
    world_size: int = -1
    local_rank: int = -1
    heartbeat_s: float = 1.0
    queue_max: int = 20000
    stall_stack_factor: float = 3.0
    stall_stack_min_s: float = 3.0
    flush_timeout_s: float = 5.0
    hw_sample_s: float = 1.0  # hardware sampling period; 0 = off
    hw_send_s: float = 5.0    # a rank sends its buffered hardware samples this often, as one message
    producer_compression: str = "zstd"  # Kafka compression of what ranks send: none, gzip, snappy, lz4, zstd
    trace_byte_budget: int = 8_000_000
    flight_steps: int = 256
    # Collective records from PyTorch's Flight Recorder: its ring size (TORCH_FR_BUFFER_SIZE, unless
    # set by the user; 0 = no collective records) and NCCL's device timing (TORCH_NCCL_ENABLE_TIMING).
    coll_ring: int = 64
    coll_timing: bool = True
    coll_read_s: float = 3.0   # the ring is read at each multiple of this many seconds of wall time
    # Stack sampling (producers/stack_sampler.py): samples per second (0 = off) and how often a rank
    # sends what it sampled.
    profile_hz: float = 20.0
    profile_s: float = 10.0
    native_reader: bool = True  # read trace windows with the C++ reader when built (rankscope build-native)
    control_enabled: bool = True
    ddp_autodetect: bool = True  # the tracer finds DDP models by itself and marks their busy time
    attach: bool = False         # set by `rankscope run`: each rank (RANK set) makes a tracer at start-up
    step_marker: str = ""        # attach: "module:function" whose calls end a step; empty = optimizer steps
    log_level: str = "INFO"
    log_format: str = "text"  # text, or json: one JSON object per line (ts, level, logger, message, service)
    # Prometheus /metrics of each service, on metrics_host; 0 = off.
    metrics_host: str = "127.0.0.1"
    metrics_port_processors: int = 9470
    metrics_port_sink: int = 9471
    metrics_port_serve: int = 9472

    def __post_init__(self) -> None:
        positive = [
            "kafka_port", "kafka_controller_port", "topic_partitions", "dashboard_port",
            "sink_batch_rows", "queue_max", "straggler_window", "straggler_min_steps",
            "straggler_persist", "stats_every_steps", "processors_web_port",
            "trace_byte_budget", "flight_steps", "processors_batch",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ["sink_batch_s", "sink_ranks_s", "scan_interval_s", "hang_min_s", "hang_factor", "dead_after_s",
                     "heartbeat_s", "straggler_z", "flush_timeout_s", "dashboard_refresh_s",
                     "stall_stack_factor", "stall_stack_min_s", "rebuild_horizon_s", "incident_horizon_s",
                     "job_idle_s", "hw_send_s", "coll_read_s", "profile_s", "dashboard_session_h"]:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds/factor, got {getattr(self, name)!r}")
        if self.profile_s > 3600:
            raise ConfigError(f"profile_s must be at most 3600 seconds, got {self.profile_s!r}")
        if self.dashboard_session_h > 87600:
            raise ConfigError(f"dashboard_session_h must be at most 87600 (ten years), got {self.dashboard_session_h!r}")
        if self.producer_compression not in PRODUCER_COMPRESSIONS:
            raise ConfigError(f"producer_compression must be one of {', '.join(PRODUCER_COMPRESSIONS)}, "
                              f"got {self.producer_compression!r}")
        if self.step_marker and not _is_marker(self.step_marker):
            raise ConfigError(f"step_marker must be 'module:function' (e.g. 'train:train_step' or "
                              f"'mypkg.loop:Trainer.step'), got {self.step_marker!r}")
        try:
            shlex.split(self.kafka_jvm_opts)
        except ValueError as e:
            raise ConfigError(f"kafka_jvm_opts must be shell-quoted JVM options, got {self.kafka_jvm_opts!r}: {e}") from None
        if self.topic_replication < 0 or self.topic_min_insync < 0:
            raise ConfigError(f"topic_replication and topic_min_insync must be >= 0 (0 = the cluster's default), "
                              f"got {self.topic_replication!r} and {self.topic_min_insync!r}")
        if self.topic_replication and self.topic_min_insync > self.topic_replication:
            raise ConfigError(f"topic_min_insync ({self.topic_min_insync}) cannot exceed topic_replication "
                              f"({self.topic_replication}): no write would ever be acknowledged")
        from rankscope.retention import RetentionError, table_ttl_days, topic_retention_h

        try:
            topic_retention_h(self.topic_retention_h)
            table_ttl_days(self.store_ttl_days)
        except RetentionError as e:
            raise ConfigError(str(e)) from None
        if self.coll_ring < 0:
            raise ConfigError(f"coll_ring must be >= 0 (0 = no collective records), got {self.coll_ring!r}")
        if not 0 <= self.profile_hz <= 1000:
            raise ConfigError(f"profile_hz must be in [0, 1000] (0 = off), got {self.profile_hz!r}")
        if self.hw_sample_s < 0:
            raise ConfigError(f"hw_sample_s must be >= 0 (0 = off), got {self.hw_sample_s!r}")
        if self.straggler_min_s < 0 or self.straggler_min_slow_steps < 2:
            raise ConfigError(f"straggler_min_s must be >= 0 and straggler_min_slow_steps >= 2, got "
                              f"{self.straggler_min_s!r} and {self.straggler_min_slow_steps!r}")
        if not 0 <= self.straggler_cost_gate < 1:
            raise ConfigError(f"straggler_cost_gate must be in [0, 1), got {self.straggler_cost_gate!r}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        for name in ("metrics_port_processors", "metrics_port_sink", "metrics_port_serve"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name} must be in [0, 65535] (0 = off), got {getattr(self, name)!r}")
        if not 0 <= self.straggler_min_rel < 10:
            raise ConfigError(f"straggler_min_rel must be in [0, 10), got {self.straggler_min_rel!r}")
        if self.clickhouse_dsn and not self.clickhouse_dsn.startswith(("chdb://", "http://", "https://")):
            raise ConfigError(
                f"clickhouse_dsn must start with chdb://, http:// or https://, got {redact_dsn(self.clickhouse_dsn)!r}")
        from rankscope.kafka_client import validate

        validate(self)

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={redact_dsn(v) if f.name == 'clickhouse_dsn' else v!r}"
                          for f in fields(self) if f.repr for v in [getattr(self, f.name)])
        return f"Settings({shown})"

    # Derived values -------------------------------------------------------------------------
    @property
    def local_broker(self) -> bool:
        """True when rankscope manages its own single-node broker."""
        return not self.bootstrap_servers

    @property
    def bootstrap(self) -> str:
        return self.bootstrap_servers or f"127.0.0.1:{self.kafka_port}"

    @property
    def store_dsn(self) -> str:
        """The store's DSN; a server DSN has clickhouse_user, _password, _ca_file and _verify folded in,
        so it may hold the password (show ``store_dsn_redacted``)."""
        dsn = self.clickhouse_dsn or f"chdb://{Path(self.data_dir).resolve() / 'clickhouse'}"
        if not dsn.startswith(("http://", "https://")):
            return dsn
        return server_dsn(dsn, self.clickhouse_user, self.clickhouse_password, self.clickhouse_ca_file,
                          self.clickhouse_verify)

    @property
    def store_dsn_redacted(self) -> str:
        """``store_dsn`` without a password, for logs and messages."""
        return redact_dsn(self.store_dsn)

    @property
    def embedded_store(self) -> bool:
        return self.store_dsn.startswith("chdb://")

    def metrics_port(self, service: str) -> int:
        """The /metrics port of ``service`` (processors, sink, serve; 0 = off; any other service has none)."""
        field = METRICS_PORTS.get(service)
        return int(getattr(self, field)) if field else 0

    def metrics_url(self, service: str) -> str | None:
        """``http://<metrics_host>:<port>/metrics`` of ``service``, or None when its port is 0."""
        port = self.metrics_port(service)
        if not port:
            return None
        host = self.metrics_host
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"

    def with_overrides(self, **kw: Any) -> Settings:
        return dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from ``RANKSCOPE_*`` env vars, then apply non-None ``overrides``.

        Raises ConfigError naming the variable when a value cannot be parsed.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            key = f"RANKSCOPE_{f.name.upper()}"
            if key in env and env[key] != "":
                values[f.name] = _parse(key, env[key], f.type)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """Env vars that rebuild these settings in a child process (every field, explicit)."""
        return {f"RANKSCOPE_{f.name.upper()}": str(getattr(self, f.name)) for f in fields(self)
                if getattr(self, f.name) not in ("", None)}

    @classmethod
    def env_names(cls) -> list[str]:
        return [f"RANKSCOPE_{f.name.upper()}" for f in fields(cls)]


def unknown_env(env: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each ``RANKSCOPE_*`` variable of ``env`` (default ``os.environ``) that names no
    setting, with the closest setting's variable when one is close (difflib). Sorted by name."""
    env = os.environ if env is None else env
    known = set(Settings.env_names())
    out = []
    for key in sorted(k for k in env if k.startswith("RANKSCOPE_") and k not in known and k != RESTARTS_ENV):
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else ""
        out.append(f"{key} is not a rankscope setting and is ignored{hint}")
    return out


def _is_marker(spec: str) -> bool:
    module, sep, func = spec.partition(":")
    return bool(sep) and all(p.isidentifier() for p in module.split(".")) and \
        all(p.isidentifier() for p in func.split("."))


def server_dsn(dsn: str, user: str = "", password: str = "", ca_file: str = "", verify: bool = True) -> str:
    """``dsn`` (http or https) with a user, password, CA file or ``verify=false`` that settings give,
    which replace those in the DSN; unchanged when the settings give none."""
    if not (user or password or ca_file or not verify):
        return dsn
    u = urlsplit(dsn)
    name = user or unquote(u.username or "")
    secret = password or unquote(u.password or "")
    auth = quote(name, safe="") + (":" + quote(secret, safe="") if secret else "") + "@" if name or secret else ""
    host = u.hostname or ""
    netloc = auth + (f"[{host}]" if ":" in host else host) + (f":{u.port}" if u.port else "")
    query = dict(parse_qsl(u.query))
    if ca_file:
        query["ca_cert"] = ca_file
    if not verify:
        query["verify"] = "false"
    return urlunsplit((u.scheme, netloc, u.path, urlencode(query), u.fragment))


def redact_dsn(dsn: str) -> str:
    """``dsn`` with the password of a ``user:password@host`` part replaced by ``***``."""
    scheme, sep, rest = dsn.partition("://")
    auth, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in auth.split("/")[0]:
        return dsn
    return f"{scheme}://{auth.split(':', 1)[0]}:***@{host}"


def _parse(key: str, raw: str, typ: Any) -> Any:
    typ = str(typ)
    try:
        if typ == "int":
            return int(raw)
        if typ == "float":
            return float(raw)
        if typ == "bool":
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return raw
    except ValueError as e:
        raise ConfigError(f"{key}={raw!r} is not a valid {typ}") from e
