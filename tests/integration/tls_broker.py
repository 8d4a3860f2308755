"""A test CA, a broker certificate for 127.0.0.1 and a real broker with a SASL_SSL listener (openssl, tmp dirs)."""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rankscope.cli.stack.broker import LocalBroker, SaslSslListener
from rankscope.config import Settings

USER = "rankscope-test"


@dataclass(frozen=True)
class LocalCa:
    ca_file: Path
    keystore: Path
    keystore_password: str


def _openssl(*args: str, cwd: Path) -> None:
    res = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {res.stderr}")


def make_test_ca(folder: Path) -> LocalCa:
    """A self-signed CA and a PKCS12 keystore with a broker key and certificate (SAN 127.0.0.1) it signed."""
    folder.mkdir(parents=True, exist_ok=True)
    store_pw = secrets.token_urlsafe(12)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=rankscope test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "broker.key", "-out", "broker.csr",
             "-subj", "/CN=127.0.0.1", cwd=folder)
    (folder / "broker.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                                       "keyUsage=critical,digitalSignature,keyEncipherment\n"
                                       "extendedKeyUsage=serverAuth\nauthorityKeyIdentifier=keyid,issuer\n")
    _openssl("x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "broker.pem", "-days", "2", "-extfile", "broker.ext", cwd=folder)
    _openssl("pkcs12", "-export", "-in", "broker.pem", "-inkey", "broker.key", "-certfile", "ca.pem",
             "-out", "broker.p12", "-passout", f"pass:{store_pw}", cwd=folder)
    return LocalCa(folder / "ca.pem", folder / "broker.p12", store_pw)


def sasl_ssl_broker(settings: Settings, ca: LocalCa, sasl_port: int, password: str) -> LocalBroker:
    """A broker (not started) whose SASL_SSL listener knows ``USER`` with ``password`` (SCRAM-SHA-512)."""
    listener = SaslSslListener(port=sasl_port, keystore=ca.keystore, keystore_password=ca.keystore_password,
                               users={USER: password})
    return LocalBroker(settings, sasl_ssl=listener)


def client_settings(base: Settings, broker: LocalBroker, ca: LocalCa, password: str, **kw: object) -> Settings:
    """Settings of a client that reaches ``broker`` only through its SASL_SSL listener."""
    return base.with_overrides(bootstrap_servers=broker.sasl_ssl_bootstrap, kafka_security_protocol="SASL_SSL",
                               kafka_sasl_mechanism="SCRAM-SHA-512", kafka_sasl_username=USER,
                               kafka_sasl_password=password, kafka_ssl_ca_file=str(ca.ca_file), **kw)
