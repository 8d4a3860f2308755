"""Kafka client settings from :class:`~rankscope.config.Settings`: one place for bootstrap, SASL and TLS.

- :func:`client_conf` gives the confluent-kafka (librdkafka) dict every producer, consumer and admin
  client starts from: ``{**client_conf(settings), "group.id": ...}``.
- :func:`faust_auth` gives the faust/aiokafka keyword arguments (``broker_credentials`` with an
  SSL context) for ``faust.App``.
- Authentication and TLS failures are reported once per process, user and bootstrap address
  ("Kafka authentication failed for user 'x' at host:port ..."); with ``fatal=True`` the
  client's ``poll``/``consume``/``flush`` raises :class:`KafkaAuthError` instead of retrying.

Secrets (``kafka_sasl_password``, ``kafka_extra``) never enter a log line or an error message.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rankscope.config import ConfigError

if TYPE_CHECKING:
    from rankscope.config import Settings

log = logging.getLogger("rankscope.kafka")

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")
# librdkafka properties whose values are secrets: never logged, never shown in errors.
SECRET_KEYS = frozenset({"sasl.password", "ssl.key.password", "ssl.keystore.password", "ssl.key.pem",
                         "sasl.oauthbearer.client.secret", "ssl_key"})


class KafkaAuthError(RuntimeError):
    """The broker rejected this client's credentials or its TLS handshake failed."""


def uses_sasl(settings: Settings) -> bool:
    return settings.kafka_security_protocol.startswith("SASL_")


def uses_tls(settings: Settings) -> bool:
    return settings.kafka_security_protocol in ("SSL", "SASL_SSL")


def parse_extra(raw: str) -> dict[str, Any]:
    """``kafka_extra`` as a dict: a JSON object, or ``key=value`` pairs separated by commas.

    Raises ConfigError naming the bad entry by position (its text may hold a secret).
    """
    raw = raw.strip()
    if not raw:
        return {}
    if raw.startswith("{"):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"kafka_extra is not a valid JSON object ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict) or not all(isinstance(v, str | int | float | bool) for v in obj.values()):
            raise ConfigError("kafka_extra as JSON must be an object of strings, numbers or booleans")
        return {str(k): v for k, v in obj.items()}
    out: dict[str, Any] = {}
    for n, item in enumerate(raw.split(","), 1):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"kafka_extra entry {n} is not key=value (use JSON for values that hold commas)")
        out[key.strip()] = value.strip()
    return out


def validate(settings: Settings) -> None:
    """Raise ConfigError when the Kafka security settings cannot work together."""
    proto, mech = settings.kafka_security_protocol, settings.kafka_sasl_mechanism
    if proto not in SECURITY_PROTOCOLS:
        raise ConfigError(f"kafka_security_protocol must be one of {', '.join(SECURITY_PROTOCOLS)}, got {proto!r}")
    if mech not in SASL_MECHANISMS:
        raise ConfigError(f"kafka_sasl_mechanism must be one of {', '.join(SASL_MECHANISMS)}, got {mech!r}")
    if uses_sasl(settings) and not (settings.kafka_sasl_username and settings.kafka_sasl_password):
        raise ConfigError(f"kafka_security_protocol={proto} needs kafka_sasl_username and kafka_sasl_password")
    if bool(settings.kafka_ssl_cert_file) != bool(settings.kafka_ssl_key_file):
        raise ConfigError("kafka_ssl_cert_file and kafka_ssl_key_file go together (a client certificate and its key)")
    parse_extra(settings.kafka_extra)


def security_conf(settings: Settings) -> dict[str, Any]:
    """The librdkafka security properties alone (empty for PLAINTEXT without extras)."""
    conf: dict[str, Any] = {}
    if settings.kafka_security_protocol != "PLAINTEXT":
        conf["security.protocol"] = settings.kafka_security_protocol
    if uses_sasl(settings):
        conf.update({"sasl.mechanism": settings.kafka_sasl_mechanism,
                     "sasl.username": settings.kafka_sasl_username,
                     "sasl.password": settings.kafka_sasl_password})
    if uses_tls(settings):
        if settings.kafka_ssl_ca_file:
            conf["ssl.ca.location"] = settings.kafka_ssl_ca_file
        if settings.kafka_ssl_cert_file:
            conf["ssl.certificate.location"] = settings.kafka_ssl_cert_file
            conf["ssl.key.location"] = settings.kafka_ssl_key_file
    return conf


def client_conf(settings: Settings, conf: Mapping[str, Any] | None = None, *, fatal: bool = False) -> dict[str, Any]:
    """The confluent-kafka configuration for one client: bootstrap, security, ``kafka_extra``,
    then ``conf`` (a client's own keys win over the extras), and an ``error_cb`` that reports
    authentication and TLS failures once (and raises :class:`KafkaAuthError` from the client's
    poll when ``fatal``). Pure: builds a dict, opens nothing."""
    out: dict[str, Any] = {"bootstrap.servers": settings.bootstrap, **security_conf(settings),
                           **parse_extra(settings.kafka_extra), **(conf or {})}
    out["error_cb"] = auth_error_cb(out, out.get("error_cb"), fatal=fatal)
    return out


def redacted(conf: Mapping[str, Any]) -> dict[str, Any]:
    """``conf`` with secret values replaced by ``***`` (for logs and errors)."""
    return {k: ("***" if k in SECRET_KEYS else v) for k, v in conf.items()}


def failure_kind(err: Any) -> str | None:
    """'auth' or 'tls' for a librdkafka error that retrying will not fix, else None."""
    from confluent_kafka import KafkaError

    try:
        code = err.code()
    except Exception:
        return None
    if code in (KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED):
        return "auth"
    if code == KafkaError._SSL:
        return "tls"
    return None


_reported: set[tuple[str, str, str]] = set()
_reported_lock = threading.Lock()


def failure_message(kind: str, conf: Mapping[str, Any], detail: str = "") -> str:
    bootstrap = conf.get("bootstrap.servers", "?")
    if kind == "auth":
        return (f"Kafka authentication failed for user {conf.get('sasl.username', '')!r} at {bootstrap} "
                f"({conf.get('sasl.mechanism', 'SASL')}); check kafka_sasl_username and kafka_sasl_password")
    return (f"Kafka TLS handshake with {bootstrap} failed ({detail}); check kafka_ssl_ca_file "
            "(the CA that signed the broker's certificate) and the broker's host name")


def report_failure(kind: str, conf: Mapping[str, Any], detail: str = "") -> str:
    """Log the failure's one clear ERROR line the first time this process sees it; return the message."""
    msg = failure_message(kind, conf, detail)
    key = (kind, str(conf.get("sasl.username", "")), str(conf.get("bootstrap.servers", "")))
    with _reported_lock:
        first = key not in _reported
        _reported.add(key)
    if first:
        log.error("%s", msg)
    return msg


def auth_error_cb(conf: Mapping[str, Any], then: Callable[[Any], None] | None = None, *,
                  fatal: bool = False) -> Callable[[Any], None]:
    """An ``error_cb`` that reports auth/TLS failures of a client built from ``conf``, then calls ``then``."""
    summary = {k: conf[k] for k in ("bootstrap.servers", "sasl.username", "sasl.mechanism") if k in conf}

    def on_error(err: Any) -> None:
        kind = failure_kind(err)
        if kind is not None:
            msg = report_failure(kind, summary, _detail(err))
            if fatal:
                raise KafkaAuthError(msg)
        if then is not None:
            then(err)

    return on_error


class FirstFailureOnly(logging.Filter):
    """For a logger that receives librdkafka's own lines: lets through the first line about a rejected
    login or TLS handshake and drops the repeats that each reconnect attempt adds."""

    MARKERS = ("SASL authentication error", "SSL handshake failed", "Authentication failed")

    def __init__(self) -> None:
        super().__init__()
        self._seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not any(m in record.getMessage() for m in self.MARKERS):
            return True
        first, self._seen = not self._seen, True
        return first


def _detail(err: Any) -> str:
    try:
        return str(err.str())
    except Exception:
        return str(err)


# faust / aiokafka ----------------------------------------------------------------------------

def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """A client TLS context trusting ``kafka_ssl_ca_file`` (else the system CAs), with the client
    certificate when one is set; None unless the protocol uses TLS."""
    if not uses_tls(settings):
        return None
    ctx = ssl.create_default_context(cafile=settings.kafka_ssl_ca_file or None)
    if settings.kafka_ssl_cert_file:
        ctx.load_cert_chain(settings.kafka_ssl_cert_file, settings.kafka_ssl_key_file)
    return ctx


def faust_auth(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for ``faust.App`` that give its aiokafka clients the same security as
    :func:`client_conf` (``kafka_extra`` is librdkafka-only and does not apply)."""
    proto = settings.kafka_security_protocol
    if proto == "PLAINTEXT":
        return {}
    import faust

    ctx = ssl_context(settings)
    if proto == "SSL":
        return {"broker_credentials": faust.SSLCredentials(ctx)}
    return {"broker_credentials": faust.SASLCredentials(
        username=settings.kafka_sasl_username, password=settings.kafka_sasl_password,
        ssl_context=ctx, mechanism=settings.kafka_sasl_mechanism)}
