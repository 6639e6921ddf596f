"""The native core's one door (`kvpipe.processors.core.native`): which engine runs and why, decided once from the
extension as installed; the stub (native/kvpipe_native.pyi) held equal to the built module by mypy's stubtest; the
Python engine on request; and what the apps do with the answer at start-up (one log line, `/metrics`, and
`require_native` refusing to start)."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpipe.bench.procrun import REPO
from kvpipe.processors.core import native, slots
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import Ingest

STUB = REPO / "native" / "kvpipe_native.pyi"
# Run in a fresh interpreter as if the extension were not installed: its import fails as a missing one does.
WITHOUT_NATIVE = "import sys; sys.modules['kvpipe_native'] = None\n"


def _needs_the_build() -> None:
    if native.engine() != "native":
        if os.environ.get("KVPIPE_NATIVE") == "0":
            pytest.skip(f"KVPIPE_NATIVE=0: {native.reason()}")
        pytest.fail(f"the stub is checked against the built extension, and {native.reason()}")


def _stubtest(stub_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    allow = tmp_path / "allowlist.txt"
    # maturin's package re-exports the compiled module it wraps (kvpipe_native/kvpipe_native.*.so): its stub is
    # the package's own
    allow.write_text("kvpipe_native.kvpipe_native\n")
    env = {**os.environ, "MYPYPATH": str(stub_dir)}
    return subprocess.run([sys.executable, "-m", "mypy.stubtest", "kvpipe_native", "--allowlist", str(allow)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


# -- the stub ------------------------------------------------------------------------------------------------------

def test_the_stub_describes_the_built_extension(tmp_path):
    _needs_the_build()
    done = _stubtest(STUB.parent, tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Success" in done.stdout


@pytest.mark.parametrize("change, says", [
    # an argument renamed in the stub only
    (("def store(self, slot: int, hashes: Iterable[_Hash], ts: float, cap: int | None = None)",
      "def store(self, slot: int, hashes: Iterable[_Hash], ts: float, limit: int | None = None)"),
     'kvpipe_native.IndexStore.store is inconsistent, stub parameter "limit" differs from runtime parameter "cap"'),
    # a method the extension does not have
    (("    def entries(self) -> int: ...\n", "    def entries(self) -> int: ...\n    def forget(self) -> None: ...\n"),
     "kvpipe_native.IndexStore.forget is not present at runtime"),
    # a function the extension has and the stub forgot
    (("def read_slot_head(data: Buffer) -> tuple[int, str, int]: ...\n", ""),
     "kvpipe_native.read_slot_head is not present in stub"),
    # a default that differs
    (("def stop(self, grace_s: float = 5.0) -> None: ...", "def stop(self, grace_s: float = 1.0) -> None: ..."),
     "kvpipe_native.RouteServer.stop is inconsistent, runtime parameter \"grace_s\" has a default value of 5.0"),
])
def test_a_stub_that_disagrees_with_the_extension_fails_the_check(tmp_path, change, says):
    _needs_the_build()
    old, new = change
    text = STUB.read_text()
    assert text.count(old) == 1, "the stub changed: update this test's edit"
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / STUB.name).write_text(text.replace(old, new))
    done = _stubtest(stubs, tmp_path)
    assert done.returncode != 0
    assert says in done.stdout, done.stdout[-4000:]


def test_the_facade_expects_every_name_the_stub_exports():
    tree = ast.parse(STUB.read_text())
    exported = next(ast.literal_eval(node.value) for node in tree.body
                    if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets))
    assert set(exported) == native.SURFACE


def test_the_api_version_is_the_one_of_the_built_extension():
    _needs_the_build()
    import kvpipe_native  # the one direct look: the facade's own constant against the module's

    assert kvpipe_native.API_VERSION == native.API_VERSION
    lib = (REPO / "native" / "src" / "lib.rs").read_text()
    assert f"pub const API_VERSION: u32 = {native.API_VERSION};" in lib


def test_only_the_facade_imports_the_extension():
    # kvpipe/<folder> are links to the top-level folders: each file once, by its real path
    files = {p.resolve() for top in ("processors", "gpu", "producer", "schemas", "infra", "kvpipe")
             for p in (REPO / top).rglob("*.py")}
    importers = [str(path.relative_to(REPO.resolve())) for path in files
                 if re.search(r"^\s*(import kvpipe_native|from kvpipe_native import)", path.read_text(), re.M)]
    assert importers == ["processors/core/native.py"]


# -- the decision --------------------------------------------------------------------------------------------------

def _full_module(version: int = native.API_VERSION) -> types.ModuleType:
    module = types.ModuleType("kvpipe_native")
    for name in native.SURFACE:
        setattr(module, name, object())
    module.API_VERSION = version
    return module


def test_a_complete_extension_of_this_version_runs_natively():
    assert native.decide(_full_module(), None) == native.Status("native", "")


def test_a_missing_extension_runs_the_python_engine_and_says_so():
    got = native.decide(None, ImportError("No module named 'kvpipe_native'"))
    assert got.engine == "python"
    assert "not installed (No module named 'kvpipe_native')" in got.reason and "infra/scripts/native.sh" in got.reason


def test_a_build_from_older_sources_runs_the_python_engine_naming_what_it_lacks():
    old = _full_module()
    del old.API_VERSION, old.serve_static
    got = native.decide(old, None)
    assert got.engine == "python"
    assert "built from older sources (it lacks API_VERSION, serve_static)" in got.reason


def test_a_build_of_another_api_version_runs_the_python_engine():
    got = native.decide(_full_module(native.API_VERSION + 1), None)
    assert got.engine == "python"
    assert f"API version {native.API_VERSION + 1}, this kvpipe expects {native.API_VERSION}" in got.reason


# -- the Python engine on request ----------------------------------------------------------------------------------

def test_the_python_engine_can_be_asked_for_and_every_native_part_then_says_why_not():
    before = native.status()
    with native.python_engine("asked for by the test"):
        assert native.status() == native.Status("python", "asked for by the test")
        assert slots.make_store().kind == "python" and Index().store.kind == "python"
        ingest = Ingest(Index(), 1 << 20, native_batches=True)
        assert not ingest.native_batches and not ingest.native_runs
        assert native.parse_batch(b"\x93") is None and native.sha256_token_chain(b"", [1, 2], 1, True) is None
        assert native.hit_rules() == {}
        for make in (native.index_store, native.hit_engine, native.media_bits):
            with pytest.raises(native.NativeUnavailable, match="asked for by the test"):
                make()
        with pytest.raises(native.NativeUnavailable, match="the native index store needs the native core"):
            slots.make_store("native")
    assert native.status() == before


# -- the apps at start-up ------------------------------------------------------------------------------------------

def test_check_start_tells_nothing_on_the_native_engine_and_refuses_the_python_one_when_required(monkeypatch):
    monkeypatch.setattr(native, "_status", native.Status("native", ""))
    assert native.check_start("kvpipe processor", required=True) is None
    with native.python_engine("no build here"):
        assert native.check_start("kvpipe processor", required=False) == (
            "kvpipe processor: running on the Python engine, not the native core: no build here")
        with pytest.raises(native.NativeUnavailable, match="require_native is set .* not in use: no build here"):
            native.check_start("kvpipe processor", required=True)


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_") or k == "KVPIPE_CACHE_DIR"}
    return subprocess.run([sys.executable, "-c", WITHOUT_NATIVE + code], cwd=REPO, env={**clean, **env},
                          capture_output=True, text=True, timeout=120)


def _engine_samples(text: str, name: str) -> list[dict[str, str]]:
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


@pytest.mark.parametrize("app, prog, metric", [
    ("routing", "kvpipe processor", "kvpipe_processor_engine_info"),
    ("analytics", "kvpipe analytics", "kvpipe_analytics_engine_info"),
])
def test_without_the_native_core_each_app_says_so_once_and_in_its_metrics(app, prog, metric):
    render = ("runtime.metrics.render().decode()" if app == "routing" else
              "__import__('kvpipe.processors.analytics.metrics', fromlist=['render']).render("
              "lambda: collect_stats(runtime, lambda p: None)).decode()")
    done = _run(f"from kvpipe.processors.{app}.state import collect_stats, runtime\n"
                f"print(runtime.index.store.kind)\nprint({render})")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "Python engine" in line]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{prog}: running on the Python engine, not the native core: the native core is not "
                               "installed")
    kind, text = done.stdout.split("\n", 1)
    assert kind == "python"
    [labels] = _engine_samples(text, metric)
    assert labels["engine"] == "python" and labels["reason"].startswith("the native core is not installed")


def test_with_the_native_core_the_metrics_say_native(monkeypatch):
    from kvpipe.processors.routing.metrics import ProcessorMetrics

    with native.python_engine("to compare"):
        python_text = ProcessorMetrics().render().decode()
    monkeypatch.setattr(native, "_status", native.Status("native", ""))
    native_text = ProcessorMetrics().render().decode()
    assert _engine_samples(native_text, "kvpipe_processor_engine_info") == [{"engine": "native", "reason": ""}]
    assert _engine_samples(python_text, "kvpipe_processor_engine_info") == [{"engine": "python",
                                                                            "reason": "to compare"}]


@pytest.mark.parametrize("command", ["processor", "analytics"])
def test_require_native_refuses_to_start_the_command(command):
    done = _run(f"from kvpipe.cli import main\nsys.exit(main([{command!r}]))", KVPIPE_REQUIRE_NATIVE="1")
    assert done.returncode == 2, done.stdout + done.stderr
    assert re.search(rf"^kvpipe {command}: require_native is set \(KVPIPE_REQUIRE_NATIVE\) and the native core is "
                     r"not in use: the native core is not installed", done.stderr, re.M), done.stderr


@pytest.mark.parametrize("app", ["routing", "analytics"])
def test_require_native_refuses_to_start_the_app_module_too(app):
    """`faust -A kvpipe.processors.<app>.app worker` skips the command: the app's state refuses at import."""
    done = _run(f"import kvpipe.processors.{app}.state", KVPIPE_REQUIRE_NATIVE="1")
    assert done.returncode != 0
    assert "NativeUnavailable" in done.stderr and "require_native is set" in done.stderr


def test_the_stub_ships_beside_the_crate_for_maturin():
    """maturin puts `<module>.pyi` next to Cargo.toml into the wheel (with py.typed), and native.sh rebuilds the
    wheel when it changes, so the installed package carries the stub mypy reads."""
    assert (REPO / "native" / "Cargo.toml").exists() and STUB.exists()
    assert "kvpipe_native.pyi" in (REPO / "infra" / "scripts" / "native.sh").read_text()
    _needs_the_build()
    import kvpipe_native

    installed = Path(kvpipe_native.__file__).parent
    assert (installed / "py.typed").exists()
    assert (installed / "__init__.pyi").read_bytes() == STUB.read_bytes(), (
        "the installed stub is not this checkout's: run infra/scripts/venv.sh (native.sh rebuilds the wheel)")


def test_both_apps_get_their_index_from_one_place_with_the_settings_bounds(monkeypatch, caplog):
    from kvpipe.processors.core.appindex import index_from_settings
    from kvpipe.schemas.settings import load_settings

    s = load_settings({"node_ttl_s": 12.5, "max_nodes": 7, "index_store": "python"}, env={})
    index = index_from_settings(s, "kvpipe analytics", lifetimes="columns")
    assert (index.ttl_s, index.max_nodes, index.store.kind, index.lifetimes_mode) == (12.5, 7, "python", "columns")
    with native.python_engine("no build here"):
        with caplog.at_level("WARNING"):
            assert index_from_settings(load_settings({"index_store": "native"}, env={}), "kvpipe processor",
                                       lifetimes=False).store.kind == "python"
        assert "kvpipe processor: running on the Python engine, not the native core: no build here" in caplog.text
        with pytest.raises(native.NativeUnavailable):
            index_from_settings(load_settings({"require_native": True}, env={}), "kvpipe processor", lifetimes=False)
