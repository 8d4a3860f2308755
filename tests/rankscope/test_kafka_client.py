"""Kafka client settings: one librdkafka dict and one faust credential set from Settings; secrets stay out of text."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import pytest
from confluent_kafka import KafkaError

from rankscope import kafka_client
from rankscope.config import ConfigError, Settings
from rankscope.kafka_client import (
    KafkaAuthError,
    auth_error_cb,
    client_conf,
    faust_auth,
    parse_extra,
    redacted,
    security_conf,
)
from tests.integration.tls_broker import make_test_ca

SECRET = "s3cr3t-Pa55word"


def sasl(**kw: object) -> Settings:
    base = {"bootstrap_servers": "10.0.0.1:9093", "kafka_security_protocol": "SASL_SSL",
            "kafka_sasl_username": "alice", "kafka_sasl_password": SECRET, "kafka_ssl_ca_file": "/etc/ca.pem"}
    base.update(kw)
    return Settings(**base)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _fresh_reports() -> None:
    kafka_client._reported.clear()


def test_plaintext_conf_is_the_bootstrap_alone() -> None:
    conf = client_conf(Settings(bootstrap_servers="127.0.0.1:9092"))
    assert {k: v for k, v in conf.items() if k != "error_cb"} == {"bootstrap.servers": "127.0.0.1:9092"}
    assert callable(conf["error_cb"])
    assert faust_auth(Settings()) == {}


def test_sasl_ssl_conf_carries_mechanism_user_password_and_ca() -> None:
    assert security_conf(sasl()) == {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                                     "sasl.username": "alice", "sasl.password": SECRET,
                                     "ssl.ca.location": "/etc/ca.pem"}


def test_sasl_plaintext_has_no_tls_keys_and_ssl_has_no_sasl_keys() -> None:
    plain = security_conf(sasl(kafka_security_protocol="SASL_PLAINTEXT"))
    assert plain["security.protocol"] == "SASL_PLAINTEXT" and "ssl.ca.location" not in plain
    tls = security_conf(Settings(kafka_security_protocol="SSL", kafka_ssl_ca_file="/ca.pem",
                                 kafka_ssl_cert_file="/c.pem", kafka_ssl_key_file="/k.pem"))
    assert tls == {"security.protocol": "SSL", "ssl.ca.location": "/ca.pem",
                   "ssl.certificate.location": "/c.pem", "ssl.key.location": "/k.pem"}


def test_extra_options_in_both_forms_and_a_clients_own_keys_win() -> None:
    assert parse_extra("socket.timeout.ms=5000, ssl.endpoint.identification.algorithm=none") == {
        "socket.timeout.ms": "5000", "ssl.endpoint.identification.algorithm": "none"}
    assert parse_extra('{"sasl.oauthbearer.scope": "a,b", "socket.keepalive.enable": true}') == {
        "sasl.oauthbearer.scope": "a,b", "socket.keepalive.enable": True}
    s = sasl(kafka_extra="client.rack=r1,linger.ms=99")
    conf = {**client_conf(s), "linger.ms": 5}
    assert conf["client.rack"] == "r1" and conf["linger.ms"] == 5
    assert client_conf(s, {"group.id": "g"})["group.id"] == "g"


@pytest.mark.parametrize("kw, needle", [
    ({"kafka_security_protocol": "SASL_TLS"}, "kafka_security_protocol must be one of"),
    ({"kafka_sasl_mechanism": "GSSAPI"}, "kafka_sasl_mechanism must be one of"),
    ({"kafka_sasl_password": ""}, "needs kafka_sasl_username and kafka_sasl_password"),
    ({"kafka_ssl_cert_file": "/c.pem"}, "go together"),
    ({"kafka_extra": "novalue"}, "is not key=value"),
    ({"kafka_extra": "{not json"}, "not a valid JSON object"),
])
def test_bad_security_settings_are_refused_by_name(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        sasl(**kw)


def test_env_builds_the_same_settings() -> None:
    env = {"RANKSCOPE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "RANKSCOPE_KAFKA_SASL_USERNAME": "bob",
           "RANKSCOPE_KAFKA_SASL_PASSWORD": SECRET, "RANKSCOPE_KAFKA_EXTRA": "client.rack=r2"}
    conf = client_conf(Settings.from_env(env))
    assert conf["sasl.username"] == "bob" and conf["sasl.password"] == SECRET and conf["client.rack"] == "r2"


def test_secrets_stay_out_of_repr_and_of_errors() -> None:
    s = sasl(kafka_extra=f"ssl.key.password={SECRET}x", clickhouse_dsn=f"https://u:{SECRET}@ch:8443",
             clickhouse_password=SECRET)
    assert SECRET not in repr(s) and SECRET not in str(s)
    assert "kafka_sasl_username='alice'" in repr(s) and "https://u:***@ch:8443" in repr(s)
    assert SECRET not in repr(redacted(client_conf(s)))
    with pytest.raises(ConfigError) as e:
        sasl(kafka_extra=f"{SECRET}")
    assert SECRET not in str(e.value)
    with pytest.raises(ConfigError) as e:
        sasl(kafka_extra=f'{{"ssl.key.password": "{SECRET}"')
    assert SECRET not in str(e.value)


class FakeErr:
    def __init__(self, code: int, text: str = "boom") -> None:
        self._code, self._text = code, text

    def code(self) -> int:
        return self._code

    def str(self) -> str:
        return self._text


def test_an_auth_failure_is_reported_once_and_raises_when_fatal(caplog: pytest.LogCaptureFixture) -> None:
    conf = client_conf(sasl())
    seen: list[FakeErr] = []
    quiet = auth_error_cb(conf, seen.append)
    fatal = client_conf(sasl(), fatal=True)["error_cb"]
    with caplog.at_level(logging.DEBUG, logger="rankscope.kafka"):
        for _ in range(50):
            quiet(FakeErr(KafkaError._AUTHENTICATION))
        with pytest.raises(KafkaAuthError, match="Kafka authentication failed for user 'alice' at 10.0.0.1:9093"):
            fatal(FakeErr(KafkaError._AUTHENTICATION))
        quiet(FakeErr(KafkaError._TRANSPORT))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["Kafka authentication failed for user 'alice' at 10.0.0.1:9093 (SCRAM-SHA-512); "
                     "check kafka_sasl_username and kafka_sasl_password"]
    assert len(seen) == 51 and SECRET not in caplog.text


def test_a_tls_failure_names_the_ca_setting(caplog: pytest.LogCaptureFixture) -> None:
    cb = client_conf(sasl(), fatal=True)["error_cb"]
    with pytest.raises(KafkaAuthError, match="TLS handshake with 10.0.0.1:9093 failed .*kafka_ssl_ca_file"):
        cb(FakeErr(KafkaError._SSL, "certificate verify failed"))


def test_other_errors_pass_through_untouched() -> None:
    seen: list[FakeErr] = []
    cb = client_conf(sasl(), {"error_cb": seen.append}, fatal=True)["error_cb"]
    cb(FakeErr(KafkaError._ALL_BROKERS_DOWN))
    assert [e.code() for e in seen] == [KafkaError._ALL_BROKERS_DOWN]


def test_faust_gets_scram_credentials_with_a_context_trusting_the_ca(tmp_path: Path) -> None:
    ca = make_test_ca(tmp_path)
    creds = faust_auth(sasl(kafka_ssl_ca_file=str(ca.ca_file)))["broker_credentials"]
    assert creds.protocol.value == "SASL_SSL" and creds.mechanism.value == "SCRAM-SHA-512"
    assert creds.username == "alice" and creds.password == SECRET and SECRET not in repr(creds)
    ctx = creds.ssl_context
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert any("rankscope test CA" in str(c.get("subject")) for c in ctx.get_ca_certs())
    plain = faust_auth(sasl(kafka_security_protocol="SASL_PLAINTEXT"))["broker_credentials"]
    assert plain.protocol.value == "SASL_PLAINTEXT" and plain.ssl_context is None
    tls = faust_auth(Settings(kafka_security_protocol="SSL", kafka_ssl_ca_file=str(ca.ca_file)))["broker_credentials"]
    assert tls.protocol.value == "SSL" and isinstance(tls.context, ssl.SSLContext)


def test_the_local_broker_adds_a_sasl_ssl_listener_with_scram_users(tmp_path: Path) -> None:
    from rankscope.cli.stack.broker import LocalBroker, SaslSslListener

    settings = Settings(data_dir=str(tmp_path), kafka_port=19092, kafka_controller_port=19093)
    listener = SaslSslListener(port=19094, keystore=tmp_path / "b.p12", keystore_password="kspw",
                               users={"alice": SECRET})
    broker = LocalBroker(settings, sasl_ssl=listener)
    props = broker.server_properties()
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093,SASL_SSL://127.0.0.1:19094"
    assert props["advertised.listeners"].endswith(",SASL_SSL://127.0.0.1:19094")
    assert props["listener.security.protocol.map"].endswith(",SASL_SSL:SASL_SSL")
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-512" and props["ssl.keystore.type"] == "PKCS12"
    assert "ScramLoginModule required" in props["listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config"]
    assert listener.scram_args() == ["--add-scram", f"SCRAM-SHA-512=[name=alice,password={SECRET}]"]
    assert broker.sasl_ssl_bootstrap == "127.0.0.1:19094" and SECRET not in repr(listener)
    assert broker.write_config().stat().st_mode & 0o077 == 0   # holds the keystore password
    assert "SASL_SSL" not in LocalBroker(settings).server_properties()["listeners"]
