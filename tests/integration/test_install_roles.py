"""Each install role from the wheelhouse `make dist` builds, in a fresh venv, running its own commands.

- routing (`pip install kvpipe`, the base): no analytics store, no plotting, no numpy in its closure, at most
  200 MB installed; `kvpipe processor` starts against the local broker and serves /health; the analytics
  commands name the `[analytics]` extra and exit 2 instead of a traceback.
- analytics (`kvpipe[analytics]`): the analytics app starts on an embedded chDB store that the analytics row
  path filled (kvpipe.bench.workload), and `kvpipe report` writes the page with every plot drawn.
- native (`kvpipe[native]`, or `kvpipe kvpipe-native`): the abi3 kvpipe-native wheel installs with no Rust
  toolchain on the PATH and the index runs on the native engine.

The venvs are made as tests/integration/test_wheel_install.py makes its own: a role's dependency closure is
linked in from the project venv (nothing is downloaded), then pip installs kvpipe from the wheelhouse with
`--no-index`, so kvpipe's own metadata must resolve against exactly that closure. Sizes are the installed
files of the role's distributions, kvpipe included, as `importlib.metadata` lists them in the role's venv.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import tomllib
import urllib.request
import uuid
import venv
from pathlib import Path

import pytest

from kvpipe.bench.procrun import free_port
from tests.integration.processor_fixture import ProcessorTopics
from tests.integration.test_wheel_install import ROOT, dependency_closure, link_distribution, project_requirements

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROUTING_LIMIT_BYTES = 200 * 10**6
# What the routing role must not carry: the analytics store (chDB and what it pulls), its client, the SQL
# parser, the plots, and numpy (the GPU side's and the plots').
ANALYTICS_ONLY = {"chdb", "chdb-core", "pyarrow", "pandas", "clickhouse-connect", "sqlglot", "matplotlib", "numpy"}
EXTRA_HINT = "pip install 'kvpipe[analytics]'"
# Summed inside a role's venv: every distribution but the installer itself.
SIZE_SCRIPT = """
from importlib import metadata
total = 0
for dist in metadata.distributions():
    if dist.metadata["Name"] == "pip":
        continue
    for f in dist.files or []:
        p = dist.locate_file(f)
        if p.is_file():
            total += p.stat().st_size
print(total)
"""


class RoleVenv:
    """A fresh venv (no system site-packages) holding one role's dependency closure, linked in."""

    def __init__(self, path: Path, requirements: list[str], path_env: str | None = None) -> None:
        self.path, self.cwd = path, path.parent  # run where no kvpipe.toml and no checkout can answer
        self.py, self.kvpipe = path / "bin" / "python", path / "bin" / "kvpipe"
        # No KVPIPE_* of the caller's; the venv's bin first, as an activated venv has it.
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("KVPIPE_")}
        self.env["PATH"] = os.pathsep.join([str(path / "bin"), os.environ.get("PATH", "") if path_env is None
                                            else path_env])
        self.closure = dependency_closure(requirements)
        venv.EnvBuilder(with_pip=False, system_site_packages=False).create(path)
        site = Path(self.python("import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
        for name in sorted(self.closure | {"pip"}):
            link_distribution(name, site)

    def run(self, argv: list[str], check: bool = False, timeout: float = 300, **env: str
            ) -> subprocess.CompletedProcess:
        out = subprocess.run(argv, cwd=self.cwd, env={**self.env, **env}, capture_output=True, text=True,
                             timeout=timeout)
        if check:
            assert out.returncode == 0, (argv, out.stdout[-2000:], out.stderr[-3000:])
        return out

    def pip_install(self, wheelhouse: Path, *targets: str) -> None:
        """From the wheelhouse only (binary wheels, no index): dependencies must already be there."""
        self.run([str(self.py), "-m", "pip", "install", "-q", "--no-index", "--only-binary", ":all:",
                  "--find-links", str(wheelhouse), *targets], check=True)
        self.run([str(self.py), "-m", "pip", "check"], check=True)

    def python(self, code: str, **env: str) -> subprocess.CompletedProcess:
        return self.run([str(self.py), "-c", code], check=True, **env)

    def installed_bytes(self) -> int:
        return int(self.python(SIZE_SCRIPT).stdout)

    def spawn(self, log: Path, *args: str, **env: str) -> subprocess.Popen:
        with open(log, "wb") as out:
            return subprocess.Popen([str(self.kvpipe), *args], cwd=self.cwd, env={**self.env, **env}, stdout=out,
                                    stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    """`make dist` into a temporary wheelhouse: the kvpipe wheel and the abi3 kvpipe-native wheel."""
    out = tmp_path_factory.mktemp("wheelhouse")
    built = subprocess.run(["make", "-s", "dist", f"DIST={out}"], cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-4000:]
    return out


def _get_json(url: str, timeout: float = 5) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _wait_health(proc: subprocess.Popen, url: str, log: Path, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode}; log:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            return _get_json(url + "/health")
        except (OSError, ValueError):
            time.sleep(0.3)
    raise AssertionError(f"{url}/health did not answer in {timeout} s; log:\n{log.read_text(errors='replace')[-4000:]}")


def _stop(proc: subprocess.Popen, log: Path) -> None:
    """SIGTERM, as an orchestrator stops it: the worker shuts down on its own, with exit status 0."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            raise AssertionError(f"did not stop on SIGTERM; log:\n{log.read_text(errors='replace')[-4000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}; log:\n{log.read_text(errors='replace')[-4000:]}"


def _hint_exit(role: RoleVenv, *args: str, **env: str) -> None:
    out = role.run([str(role.kvpipe), *args], timeout=120, **env)
    assert out.returncode == 2, (args, out.returncode, out.stdout[-1000:], out.stderr[-3000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and EXTRA_HINT in lines[0] and lines[0].startswith(f"kvpipe {args[0]}:"), (args, lines)


def test_routing_role_is_small_and_starts_the_routing_app(wheelhouse, kafka_bootstrap, tmp_path) -> None:
    role = RoleVenv(tmp_path / "routing", project_requirements())
    assert "faust-streaming" in role.closure and not role.closure & ANALYTICS_ONLY, role.closure & ANALYTICS_ONLY
    role.pip_install(wheelhouse, "kvpipe")
    size = role.installed_bytes()
    assert 20 * 10**6 < size <= ROUTING_LIMIT_BYTES, f"the routing role installs {size / 1e6:.1f} MB"
    for module in ("chdb", "pyarrow", "pandas", "clickhouse_connect", "sqlglot", "matplotlib", "numpy", "torch"):
        gone = role.run([str(role.py), "-c", f"import {module}"])
        assert "ModuleNotFoundError" in gone.stderr, f"{module} is importable in the routing role"
    # No native wheel in this role: the index runs on its Python reference, and says why.
    engine = role.python("from kvpipe.processors.core.native import status; print(status().engine)")
    assert engine.stdout.strip() == "python"

    topics = ProcessorTopics(kafka_bootstrap, "roles", 1)
    port, state = free_port(), tmp_path / "state"
    log = tmp_path / "processor.log"
    try:
        proc = role.spawn(log, "processor", **topics.env(f"roles-{uuid.uuid4().hex[:8]}", port, str(state)))
        try:
            health = _wait_health(proc, f"http://127.0.0.1:{port}", log)
            assert health["status"] == "ok" and health["app"] == "index", health
        finally:
            _stop(proc, log)

        # The analytics commands on this role: one line naming the extra, exit 2.
        app_env = topics.env(f"roles-a-{uuid.uuid4().hex[:8]}", free_port(), str(state),
                             KVPIPE_ANALYTICS_WEB_PORT=str(free_port()))
        _hint_exit(role, "analytics", **app_env)
        _hint_exit(role, "sql", "SELECT 1")
        nobody = f"http://127.0.0.1:{free_port()}"
        _hint_exit(role, "report", "--url", nobody, "--out", str(tmp_path / "report.html"))
        _hint_exit(role, "plan", "--url", nobody)
    finally:
        topics.delete()


FILL = """
import sys
from kvpipe.bench.workload import fill_store, serving_steps
from kvpipe.processors.analytics.sink import AnalyticsSink
sink = AnalyticsSink(sys.argv[1])
sink.start()
try:
    print(fill_store(sink, serving_steps(1500))["events"])
finally:
    sink.close()
"""


def test_analytics_role_serves_the_store_and_renders_the_report(wheelhouse, kafka_bootstrap, tmp_path) -> None:
    role = RoleVenv(tmp_path / "analytics", project_requirements() + project_requirements("analytics"))
    assert {"chdb", "clickhouse-connect", "sqlglot", "matplotlib"} <= role.closure
    role.pip_install(wheelhouse, "kvpipe[analytics]")
    role.python("import kvpipe.processors.analytics.agents, kvpipe.processors.analytics.views",
                KVPIPE_STATE_DIR=str(tmp_path / "import-state"))

    # An embedded store filled by the analytics row path; the app then opens it (one process at a time).
    dsn = f"chdb://{tmp_path / 'store'}"
    fill = role.run([str(role.py), "-c", FILL, dsn], check=True, timeout=600)
    assert int(fill.stdout.strip().splitlines()[-1]) > 1000, fill.stdout

    topics = ProcessorTopics(kafka_bootstrap, "roles", 1)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "analytics.log"
    env = topics.env(f"roles-{uuid.uuid4().hex[:8]}", free_port(), str(tmp_path / "state"),
                     KVPIPE_ANALYTICS_ID=f"roles-a-{uuid.uuid4().hex[:8]}", KVPIPE_ANALYTICS_WEB_PORT=str(port),
                     KVPIPE_CLICKHOUSE_DSN=dsn)
    try:
        proc = role.spawn(log, "analytics", **env)
        try:
            health = _wait_health(proc, url, log)
            assert health["status"] == "ok" and health["app"] == "analytics", health
            count = role.run([str(role.kvpipe), "sql", "-q", "SELECT count() FROM kv_events_final", "--url", url,
                              "--format", "TSV"], check=True, **env)
            assert int(count.stdout.strip()) > 1000, count.stdout
            report = tmp_path / "report.html"
            role.run([str(role.kvpipe), "report", "--url", url, "--out", str(report)], check=True, timeout=300,
                     **env)
        finally:
            _stop(proc, log)
    finally:
        topics.delete()

    page = report.read_text()
    from kvpipe.processors.analytics.report import PLOTS

    figures = dict(re.findall(r"<figure class=[\"']plot[\"'] data-query=[\"'](\w+)[\"'][^>]*>(.*?)</figure>", page,
                              re.DOTALL))
    assert set(figures) == set(PLOTS), sorted(figures)
    for name, svg in figures.items():
        drawn = re.findall(r'<path d="([^"]+)"[^>]*clip-path', svg)
        assert svg.lstrip().startswith("<svg") and drawn, f"plot {name} has no data drawn"


def _without_rust(path: str) -> str:
    """PATH minus every directory holding cargo or rustc."""
    keep = [d for d in path.split(os.pathsep)
            if d and shutil.which("cargo", path=d) is None and shutil.which("rustc", path=d) is None]
    return os.pathsep.join(keep)


@pytest.mark.parametrize("targets", [("kvpipe", "kvpipe-native"), ("kvpipe[native]",)], ids=["both", "extra"])
def test_native_core_installs_from_the_wheelhouse_without_a_rust_toolchain(wheelhouse, tmp_path, targets) -> None:
    (native_wheel,) = wheelhouse.glob("kvpipe_native-*.whl")
    assert "-abi3-" in native_wheel.name, native_wheel.name  # one wheel for every CPython >= 3.11
    native_version = tomllib.loads((ROOT / "native" / "pyproject.toml").read_text())["project"]["version"]
    assert project_requirements("native") == [f"kvpipe-native=={native_version}"]

    path = _without_rust(os.environ.get("PATH", ""))
    role = RoleVenv(tmp_path / "native", project_requirements(), path_env=path)
    assert shutil.which("cargo", path=role.env["PATH"]) is None and shutil.which("rustc", path=role.env["PATH"]) is None
    role.pip_install(wheelhouse, *targets)
    out = role.python("import kvpipe_native\n"
                      "from kvpipe.processors.core.native import status\n"
                      "s = status()\n"
                      "print(kvpipe_native.__file__)\n"
                      "print(s.engine, s.reason)")
    where, answer = out.stdout.strip().splitlines()
    assert Path(where).is_relative_to(role.path), where  # this venv's copy, not the project venv's
    assert answer == "native", answer
    # The routing index on it: the block store the processor would use.
    store = role.python("from kvpipe.processors.core.slots import make_store; print(make_store('native').kind)")
    assert store.stdout.strip() == "native"
