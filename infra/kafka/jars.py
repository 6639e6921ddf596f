"""Resolve the broker's jars with Maven into a cache outside the repository.

The cache lives at `${XDG_CACHE_HOME:-~/.cache}/kvpipe/kafka-<version>/libs`, shared by every
checkout and state dir on the machine: resolving costs ~40 s and ~50 MB, starting a broker must not.
A marker file written *after* a complete copy makes re-runs instant; it records the version and a
hash of pom.xml so editing the POM re-resolves. Maven copies into a temporary sibling directory that
is renamed into place, and an flock serialises concurrent `up`s (dev broker + test broker), so a
half-copied class path is never used.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from kvpipe.infra.errors import INSTALL_HINT, InfraError

POM = Path(__file__).with_name("pom.xml")
MARKER = ".complete"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvpipe"


def _marker_text(version: str) -> str:
    if not POM.is_file():
        raise InfraError(f"{POM} is missing: this kvpipe installation lacks infra/kafka/pom.xml "
                         f"(package-data), so the broker's jars cannot be resolved; run from a checkout")
    digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:16]
    return f"kafka={version} pom={digest}\n"


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise InfraError(f"`{name}` not found on PATH; the local Kafka broker needs Java 17 and Maven — {INSTALL_HINT}")
    return path


def resolve_jars(version: str) -> Path:
    """Return the directory holding the broker's jars, resolving them first if needed."""
    home = cache_root() / f"kafka-{version}"
    libs = home / "libs"
    expected = _marker_text(version)
    marker = home / MARKER
    if marker.is_file() and marker.read_text() == expected and libs.is_dir():
        return libs  # fast path: no lock, no Maven
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be resolving right now
        if marker.is_file() and marker.read_text() == expected and libs.is_dir():
            return libs
        mvn = require_tool("mvn")
        tmp = home / f"libs.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [mvn, "-B", "-q", "-f", str(POM), f"-Dkafka.version={version}",
               "dependency:copy-dependencies", f"-DoutputDirectory={tmp}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not any(tmp.glob(f"kafka_2.13-{version}.jar")):
            out = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
            shutil.rmtree(tmp, ignore_errors=True)
            raise InfraError(
                f"Maven could not resolve Apache Kafka {version} (exit {proc.returncode}); "
                f"it needs network access to Maven Central or a populated ~/.m2.\n"
                f"command: {' '.join(cmd)}\n" + "\n".join(out))
        marker.unlink(missing_ok=True)
        shutil.rmtree(libs, ignore_errors=True)
        tmp.rename(libs)
        marker.write_text(expected)
    return libs


def classpath(libs: Path) -> str:
    # The JVM expands `dir/*` itself; an explicit list of ~60 jars would only lengthen `ps` output.
    return str(libs / "*")
