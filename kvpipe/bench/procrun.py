"""Run `kvpipe processor` or `kvpipe analytics` as a child process and talk to its HTTP API (tests
and the benchmarks).

A child process, not an in-process app: that is how users run it, and it is the only way to kill
it with SIGKILL at an arbitrary moment.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tenacity import RetryError, retry_if_exception_type, stop_after_delay

from kvpipe.processors.core.remote import ok_json, post_json
from kvpipe.schemas.retrying import retrying

REPO = Path(__file__).resolve().parents[2]


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to sockets that bind no port of their own (Linux's
    ip_local_port_range; the common default elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORTS = random.Random()


def free_port() -> int:
    """A port nothing listens on now, for a child process to bind later. Taken below the kernel's
    ephemeral range: a port from inside it (what binding port 0 gives) could meanwhile become the
    local port of any outgoing connection (the test's own Kafka clients make many), and the child's
    bind then failed with "address already in use"."""
    low = _ephemeral_low()
    for _ in range(200):
        port = _PORTS.randrange(max(1024, low // 2), low) if low > 2048 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessorProcess:
    """One `kvpipe <command>` worker: `processor` (the routing index app, default) or `analytics`."""

    def __init__(self, settings_env: dict[str, str], log_path: Path, args: list[str] | None = None,
                 command: str = "processor", pythonpath: list[str] | None = None) -> None:
        """`settings_env`: KVPIPE_* variables for this worker (topics, id, port, state dir); the web
        port is KVPIPE_WEB_PORT for `processor`, KVPIPE_ANALYTICS_WEB_PORT for `analytics`.
        `pythonpath`: extra directories put first on the child's PYTHONPATH."""
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_")}
        self.env.update(settings_env)
        self.env["PYTHONPATH"] = os.pathsep.join([*(pythonpath or []), str(REPO), os.environ.get("PYTHONPATH", "")])
        self.command = command
        port_key = "KVPIPE_ANALYTICS_WEB_PORT" if command == "analytics" else "KVPIPE_WEB_PORT"
        self.port = int(settings_env[port_key])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.args = list(args or [])
        self.proc: subprocess.Popen | None = None
        token = settings_env.get("KVPIPE_API_TOKEN")  # a token-protected processor: send it
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def start(self, timeout: float = 60.0) -> "ProcessorProcess":
        log = open(self.log_path, "ab")
        # cwd = the log's directory: no kvpipe.toml of the checkout leaks in
        self.proc = subprocess.Popen([sys.executable, "-m", "kvpipe", self.command, *self.args], env=self.env,
                                     cwd=self.log_path.parent, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        def answers() -> None:
            if self.popen.poll() is not None:  # not retried: a RuntimeError
                raise RuntimeError(f"kvpipe {self.command} exited with {self.popen.returncode}; log:\n{self.log_tail()}")
            self.get("/stats")  # the web server starts once the partitions are restored

        try:
            retrying(first_s=0.05, max_s=0.2, stop=stop_after_delay(timeout),
                     retry=retry_if_exception_type((OSError, ValueError)))(answers)
        except RetryError:
            raise TimeoutError(f"kvpipe {self.command} did not answer on {self.url} within {timeout} s; log:\n"
                               f"{self.log_tail()}") from None
        return self

    @property
    def popen(self) -> subprocess.Popen:
        """The process `start` launched (RuntimeError before it did)."""
        if self.proc is None:
            raise RuntimeError(f"kvpipe {self.command} ({self.url}) was not started")
        return self.proc

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs, no final snapshot."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def get(self, path: str, timeout: float = 10.0) -> Any:
        """The decoded answer (JSON, or text such as /metrics); HttpStatusError (an OSError) for a non-2xx."""
        return ok_json(self.url + path, timeout=timeout, headers=self.headers)

    def post(self, path: str, body: Any, timeout: float = 10.0) -> tuple[int, Any]:
        return post_json(self.url + path, body, timeout, self.headers)

    def route(self, block_hashes: Any = None, **fields: Any) -> dict:
        """`POST /route` with `{"block_hashes": …, **fields}` (or only `fields`, e.g. token_ids);
        anything but a 200 is an AssertionError with the answer."""
        body = {**fields, **({"block_hashes": block_hashes} if block_hashes is not None else {})}
        status, answer = self.post("/route", body)
        if status != 200:
            raise AssertionError(f"/route answered {status}: {answer}")
        return answer

    def wait_offsets(self, end_offsets: dict[int, int], timeout: float = 60.0) -> dict:
        """Wait until every partition's last handled offset is `end - 1`; returns /stats."""
        deadline = time.monotonic() + timeout
        stats: dict = {}
        while time.monotonic() < deadline:
            stats = self.get("/stats")
            fresh = stats["freshness"]
            if all(end == 0 or fresh.get(str(p), {}).get("offset", -1) >= end - 1 for p, end in end_offsets.items()):
                return stats
            time.sleep(0.1)
        raise TimeoutError(f"processor did not reach offsets {end_offsets}: {stats.get('freshness')}\n{self.log_tail()}")
