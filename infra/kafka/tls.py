"""A private CA and a broker key store for the local broker's SASL_SSL listener, made with the
JDK's `keytool` (no openssl dependency: Java is already required for the broker).

Layout under `<kafka dir>/tls/` (created once, reused while the files exist):
- `ca.p12`      the CA's key pair (never leaves this directory)
- `ca.pem`      the CA certificate: what clients trust (Settings.kafka_cafile finds it)
- `broker.p12`  the broker's key and its certificate chain (CN=localhost, SAN localhost + 127.0.0.1,
                so clients keep hostname verification on)
- `store.pass`  the key stores' password (mode 0600), random per state dir
"""
from __future__ import annotations

import os
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvpipe.infra.errors import InfraError
from kvpipe.infra.kafka.jars import require_tool

SAN = "SAN=dns:localhost,ip:127.0.0.1"
VALIDITY_DAYS = "3650"  # a dev CA; regenerate by deleting the tls directory


@dataclass(frozen=True)
class BrokerTls:
    keystore: Path
    ca_pem: Path
    password: str = ""

    def __repr__(self) -> str:  # the store password stays out of reprs and logs
        return f"BrokerTls(keystore={self.keystore}, ca_pem={self.ca_pem})"


def _keytool(keytool: str, *args: str, stdin: bytes | None = None) -> bytes:
    proc = subprocess.run([keytool, *args], input=stdin, capture_output=True)
    if proc.returncode != 0:
        # keytool's message names the step; the command line holds the store password, so it is not shown
        raise InfraError(f"keytool {args[0]} failed (exit {proc.returncode}): "
                         f"{(proc.stdout + proc.stderr).decode(errors='replace').strip()}")
    return proc.stdout


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def ensure_broker_tls(tls_dir: Path) -> BrokerTls:
    """The CA and broker key store in `tls_dir`, generated on first use (~2 s of keytool)."""
    ca_p12, ca_pem, broker_p12, pw_file = (tls_dir / n for n in ("ca.p12", "ca.pem", "broker.p12", "store.pass"))
    if all(p.is_file() for p in (ca_p12, ca_pem, broker_p12, pw_file)):
        return BrokerTls(broker_p12, ca_pem, pw_file.read_text().strip())
    keytool = require_tool("keytool")
    tls_dir.mkdir(parents=True, exist_ok=True)
    for p in (ca_p12, ca_pem, broker_p12):
        p.unlink(missing_ok=True)
    password = secrets.token_urlsafe(18)
    _write_private(pw_file, password + "\n")
    common = ["-storetype", "PKCS12", "-storepass", password, "-keypass", password]
    _keytool(keytool, "-genkeypair", "-alias", "ca", "-keyalg", "RSA", "-keysize", "2048", "-dname",
             "CN=kvpipe local CA", "-ext", "bc:c", "-validity", VALIDITY_DAYS, "-keystore", str(ca_p12), *common)
    _keytool(keytool, "-exportcert", "-rfc", "-alias", "ca", "-keystore", str(ca_p12), "-storepass", password,
             "-file", str(ca_pem))
    _keytool(keytool, "-genkeypair", "-alias", "broker", "-keyalg", "RSA", "-keysize", "2048", "-dname",
             "CN=localhost", "-ext", SAN, "-validity", VALIDITY_DAYS, "-keystore", str(broker_p12), *common)
    csr = _keytool(keytool, "-certreq", "-alias", "broker", "-keystore", str(broker_p12), "-storepass", password)
    signed = _keytool(keytool, "-gencert", "-alias", "ca", "-keystore", str(ca_p12), "-storepass", password,
                      "-rfc", "-ext", SAN, "-validity", VALIDITY_DAYS, stdin=csr)
    # The chain goes in CA first, so the broker presents broker cert + CA.
    _keytool(keytool, "-importcert", "-noprompt", "-alias", "ca", "-file", str(ca_pem), "-keystore", str(broker_p12),
             "-storepass", password)
    _keytool(keytool, "-importcert", "-noprompt", "-alias", "broker", "-keystore", str(broker_p12),
             "-storepass", password, stdin=signed)
    return BrokerTls(broker_p12, ca_pem, password)
