"""Start, wait for, and stop one local Apache Kafka broker per state directory.

Invariants:
- The pid file names the only process `down` will ever signal, and only after /proc confirms that
  pid still runs `kafka.Kafka` with *this* state dir's server.properties — pids are reused, and
  other engineers run their own brokers on the same machine.
- `up` returns only once the broker answers a metadata request, so callers can create topics and
  produce immediately. A broker that does not get there within the timeout is stopped again, and
  the error carries the tail of its server.log.
- The broker runs in its own session (process group): Ctrl-C in the terminal that ran `up`, or a
  test runner tearing down its process group, does not take the shared dev broker with it.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvpipe.infra.errors import InfraError
from kvpipe.infra.kafka import config as kconfig
from kvpipe.infra.kafka.config import BrokerConfig
from kvpipe.infra.kafka.jars import classpath, require_tool, resolve_jars
from kvpipe.infra.kafka.tls import ensure_broker_tls

# JVM flags from Kafka's kafka-run-class.sh (KAFKA_JVM_PERFORMANCE_OPTS), minus JMX: nothing here
# reads JMX and an open JMX port on a dev machine is one more thing to collide.
JVM_FLAGS = ["-server", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:InitiatingHeapOccupancyPercent=35",
             "-XX:+ExplicitGCInvokesConcurrent", "-Djava.awt.headless=true"]



def gc_log_flags(path: Path) -> list[str]:
    """The JVM's GC log, as kafka-run-class.sh writes it (KAFKA_GC_LOG_OPTS): every pause with its
    cause and length, in a few rotated files. A broker on the same host as the apps stops for its
    collections, and a slow event is as often the broker's as the app's: this log tells them apart."""
    return [f"-Xlog:gc*:file={path.resolve()}:time,uptime,tags:filecount=4,filesize=20M"]


# Children started by this Python process: polled instead of waitpid'ed so they are reaped
# (no zombies in a long-lived test session) without tripping Popen's own bookkeeping.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


@dataclass(frozen=True)
class BrokerStatus:
    pid: int | None
    bootstrap: str
    started: bool = False  # True if this call started the process, False if it was already up


def _quiet_logger() -> logging.Logger:
    # librdkafka logs every refused connection while the broker boots; those are expected here.
    log = logging.getLogger("kvpipe.infra.kafka.probe")
    log.addHandler(logging.NullHandler())
    log.propagate = False
    return log


def broker_answers(bootstrap: str, timeout: float = 2.0, security: dict | None = None) -> bool:
    """True if a broker at `bootstrap` answers a metadata request within `timeout` seconds.
    `security`: librdkafka TLS/SASL properties (Settings.kafka_confluent_security) for a secured
    cluster; the local broker's own readiness probe uses its plaintext loopback listener."""
    from confluent_kafka.admin import AdminClient  # lazy: `--help` must not load librdkafka

    admin = AdminClient({**(security or {}), "bootstrap.servers": bootstrap, "logger": _quiet_logger(),
                         "socket.connection.setup.timeout.ms": max(1000, int(timeout * 1000))})
    try:
        md = admin.list_topics(timeout=timeout)
    except Exception:  # KafkaException on timeout / transport failure: "not (yet) answering"
        return False
    return bool(md.brokers)


def upsert_scram_users(bootstrap: str, users: tuple[tuple[str, str], ...]) -> None:
    """Create or reset SCRAM-SHA-512 credentials through the admin API."""
    from confluent_kafka.admin import AdminClient, ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

    admin = AdminClient({"bootstrap.servers": bootstrap, "logger": _quiet_logger()})
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, kconfig.SCRAM_ITERATIONS)
    alterations = [UserScramCredentialUpsertion(name, info, password.encode()) for name, password in users]
    for name, future in admin.alter_user_scram_credentials(alterations).items():
        try:
            future.result(timeout=30)
        except Exception as exc:  # the user's name and Kafka's reason; never the password
            raise InfraError(f"creating SCRAM user {name!r} on {bootstrap} failed: {exc}") from None


def _port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def tail(path: Path, lines: int = 30) -> str:
    if not path.is_file():
        return f"({path} does not exist)"
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 64 * 1024))
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


class LocalKafka:
    def __init__(self, cfg: BrokerConfig) -> None:
        self.cfg = cfg
        self._formatted_before = False

    # -- process identity -------------------------------------------------------------------
    def _is_ours(self, pid: int) -> bool:
        child = _CHILDREN.get(pid)
        if child is not None and child.poll() is not None:
            del _CHILDREN[pid]
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return False  # someone else's process now holds that pid
        cmdline = Path(f"/proc/{pid}/cmdline")
        if not cmdline.parent.exists():
            return True  # no /proc (macOS): trust a live pid from our own pid file
        try:
            # The java launcher re-execs itself right after start; for those few ms its cmdline
            # reads as empty. Re-read instead of mistaking our own broker for a stranger.
            for _ in range(40):
                raw = cmdline.read_bytes()
                if raw:
                    break
                time.sleep(0.025)
            args = raw.split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        if state == "Z":
            return False
        return b"kafka.Kafka" in args and str(self.cfg.server_properties.resolve()).encode() in args

    def running_pid(self) -> int | None:
        """The pid of this state dir's broker if it runs; a stale pid file is removed."""
        try:
            pid = int(self.cfg.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if self._is_ours(pid):
            return pid
        self.cfg.pid_file.unlink(missing_ok=True)
        return None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialise up/down per state dir. Without it, two concurrent `up`s both start a JVM; the
        loser dies on the taken port and its cleanup would delete the winner's pid file."""
        self.cfg.kafka_dir.mkdir(parents=True, exist_ok=True)
        with open(self.cfg.kafka_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    # -- up ---------------------------------------------------------------------------------
    def up(self, timeout: float = 90.0) -> BrokerStatus:
        with self._locked():
            return self._up(timeout)

    def _up(self, timeout: float) -> BrokerStatus:
        st = self._start()
        if not st.started:
            self._wait_ready(st.pid, timeout)
            return st
        try:
            self._wait_ready(st.pid, timeout)
        except InfraError as e:
            # Half-started and unusable: stop what we started rather than leave an orphan JVM.
            self._stop(st.pid, grace=10.0)
            self.cfg.pid_file.unlink(missing_ok=True)
            raise InfraError(f"{e}\n(stopped pid {st.pid}; fix the cause above, then run `kvpipe infra up` again)") from None
        if self.cfg.users and self._formatted_before:
            # SCRAM users are written at format time; storage formatted earlier (before --secure)
            # gets them through the admin API on the plaintext loopback listener instead.
            upsert_scram_users(self.cfg.bootstrap, self.cfg.users)
        return st

    def start(self) -> BrokerStatus:
        """Start the JVM unless it runs, without waiting for it to answer: a cluster node only
        answers once a majority of the quorum runs, so a cluster starts every node first."""
        with self._locked():
            return self._start()

    def wait_ready(self, pid: int, timeout: float) -> None:
        self._wait_ready(pid, timeout)

    def _start(self) -> BrokerStatus:
        pid = self.running_pid()
        if pid is not None:
            return BrokerStatus(pid, self.cfg.bootstrap, started=False)
        java = require_tool("java")
        for port in (self.cfg.port, self.cfg.controller_port, self.cfg.sasl_port, self.cfg.sasl_ssl_port):
            if not port:
                continue
            if _port_open(self.cfg.host, port):
                raise InfraError(
                    f"port {self.cfg.host}:{port} is already in use by a process that is not this state dir's "
                    f"broker ({self.cfg.state_dir}). Stop it, or choose other ports with "
                    f"KVPIPE_KAFKA_PORT / KVPIPE_KAFKA_CONTROLLER_PORT (or point KVPIPE_KAFKA_BOOTSTRAP at it).")
        libs = resolve_jars(self.cfg.version)
        tls = ensure_broker_tls(self.cfg.tls_dir) if self.cfg.sasl_ssl_port else None
        kconfig.write_configs(self.cfg, tls.keystore if tls else None, tls.password if tls else "")
        self._formatted_before = (self.cfg.data_dir / "meta.properties").is_file()
        self._format_storage(java, libs)
        # the whole heap from the start, as Kafka's own start script sets it (KAFKA_HEAP_OPTS -Xms = -Xmx). Grown
        # on demand, it stayed near 205 MB under 100 k events/s: 35 % of that (InitiatingHeapOccupancyPercent)
        # is below the broker's ~85 MB live set, so G1 marked back to back and the broker paused 20-120 ms
        # every few seconds (docs/architecture.md, "Ingest beside a busy route server")
        cmd = [java, f"-Xms{self.cfg.heap}", f"-Xmx{self.cfg.heap}", *JVM_FLAGS, *gc_log_flags(self.cfg.gc_log),
               f"-Dlog4j.configuration=file:{self.cfg.log4j_properties.resolve()}",
               f"-Dkafka.logs.dir={self.cfg.kafka_dir.resolve()}",
               "-cp", classpath(libs), "kafka.Kafka", str(self.cfg.server_properties.resolve())]
        with open(self.cfg.console_log, "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=self.cfg.kafka_dir)
        _CHILDREN[proc.pid] = proc
        tmp = self.cfg.pid_file.with_suffix(".tmp")
        tmp.write_text(f"{proc.pid}\n")
        tmp.replace(self.cfg.pid_file)  # atomic: `status` never reads a half-written pid
        return BrokerStatus(proc.pid, self.cfg.bootstrap, started=True)

    def _format_storage(self, java: str, libs: Path) -> None:
        """`kafka-storage.sh format` once per log dir; meta.properties marks a formatted dir (a log
        dir added later is formatted on the next start, the others are left as they are)."""
        if all((d / "meta.properties").is_file() for d in self.cfg.log_dirs):
            return
        cid = kconfig.cluster_id(self.cfg)
        cmd = [java, "-Xmx256m", f"-Dlog4j.configuration=file:{self.cfg.log4j_properties.resolve()}",
               "-cp", classpath(libs), "kafka.tools.StorageTool", "format",
               "-t", cid, "-c", str(self.cfg.server_properties.resolve()), "--ignore-formatted"]
        for name, password in self.cfg.users:  # salted, never the clear password (config.scram_credential)
            cmd += ["--add-scram", kconfig.scram_credential(name, password)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise InfraError(f"formatting Kafka storage in {self.cfg.data_dir} failed (exit {proc.returncode}):\n"
                             f"{(proc.stdout + proc.stderr).strip()}\n"
                             f"If the data dir belongs to another cluster id, run `kvpipe infra down --purge`.")

    def _wait_ready(self, pid: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not self._is_ours(pid):
                raise InfraError(f"the Kafka broker (pid {pid}) exited during startup.\n"
                                 f"--- tail of {self.cfg.server_log}:\n{tail(self.cfg.server_log)}\n"
                                 f"--- tail of {self.cfg.console_log}:\n{tail(self.cfg.console_log, 15)}")
            # A TCP probe first: cheap, and keeps librdkafka from spinning on a closed port.
            if _port_open(self.cfg.host, self.cfg.port) and broker_answers(self.cfg.bootstrap, 2.0):
                return
            if time.monotonic() > deadline:
                raise InfraError(f"the Kafka broker (pid {pid}) did not answer on {self.cfg.bootstrap} within "
                                 f"{timeout:.0f} s.\n"
                                 f"--- tail of {self.cfg.server_log}:\n{tail(self.cfg.server_log)}")
            time.sleep(0.25)

    # -- down -------------------------------------------------------------------------------
    def _stop(self, pid: int, grace: float) -> bool:
        """SIGTERM (Kafka shuts down cleanly: flushes logs, no recovery on next start), then
        SIGKILL after `grace` seconds. Returns True if SIGKILL was needed."""
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return False
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not self._is_ours(pid):
                return False
            time.sleep(0.1)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        while self._is_ours(pid):
            time.sleep(0.05)
        return True

    def down(self, purge: bool = False, grace: float = 30.0) -> str:
        if not self.cfg.kafka_dir.is_dir():
            return f"no Kafka broker running for {self.cfg.state_dir}"
        with self._locked():
            return self._down(purge, grace)

    def _down(self, purge: bool, grace: float) -> str:
        pid = self.running_pid()
        if pid is None:
            msg = f"no Kafka broker running for {self.cfg.state_dir}"
        else:
            killed = self._stop(pid, grace)
            msg = f"stopped Kafka broker pid {pid}" + (" (SIGKILL after SIGTERM timed out)" if killed else "")
        self.cfg.pid_file.unlink(missing_ok=True)
        if purge:
            shutil.rmtree(self.cfg.data_dir, ignore_errors=True)
            self.cfg.cluster_id_file.unlink(missing_ok=True)
            msg += f"; deleted {self.cfg.data_dir}"
        return msg
