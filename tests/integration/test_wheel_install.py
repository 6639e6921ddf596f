"""A wheel built from the repository installs without torch, adds one import name (`kvpipe`) to
site-packages, and the base install's server roles start.

The base install must be what the routing app and the bridge need (pyproject.toml: torch is the `[gpu]`
extra, the analytics store the `[analytics]` one; tests/integration/test_install_roles.py runs each role). The
check builds the wheel (`pip wheel --no-deps`), makes a fresh venv without system site-packages, puts into it
exactly the base dependencies' closure taken from the project venv (their installed files linked in, no
download: the resolver's view is the one `pip check` judges), installs the wheel with `--no-deps --no-index`,
and runs the roles' `--help` there.

The repository's top-level folders (schemas/, gpu/, producer/, processors/, infra/) are subpackages
of `kvpipe` in the wheel (pyproject.toml's package-dir): the wheel's metadata names `kvpipe` as its
only top-level import, every source file of the folders is in it under kvpipe/, and none of the
folders' names is importable from the fresh venv.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("schemas", "gpu", "producer", "processors", "infra")  # the same as kvpipe.FOLDERS


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_closure(requirements: list[str]) -> set[str]:
    """Distributions (normalized names) the requirements need, transitively, extras ignored unless named."""
    env = default_environment()
    # Markers are judged when a requirement is queued: a sub-requirement's may name the extra it came with.
    todo = [r for r in map(Requirement, requirements) if r.marker is None or r.marker.evaluate({**env, "extra": ""})]
    seen: set[str] = set()
    # (distribution, extra) pairs whose requirements are queued, "" for the plain ones: a distribution met
    # again with another extra (torch's `cuda-toolkit[cudart,...]` after a plain `cuda-toolkit`) adds that
    # extra's requirements then.
    done: set[tuple[str, str]] = set()
    while todo:
        req = todo.pop()
        name = _norm(req.name)
        seen.add(name)
        extras = {e for e in {"", *req.extras} if (name, e) not in done}
        if not extras:
            continue
        done |= {(name, e) for e in extras}
        for sub in metadata.distribution(req.name).requires or []:
            r = Requirement(sub)
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in extras):
                todo.append(r)
    return seen


def link_distribution(name: str, site: Path) -> None:
    """The installed files of one distribution (package dirs, modules, .dist-info) linked into `site`."""
    dist = metadata.distribution(name)
    src_site = Path(dist.locate_file(""))
    tops = set()
    for f in dist.files or []:
        parts = Path(f).parts
        if parts and parts[0] not in ("..", "bin") and not parts[0].startswith("__pycache__"):
            tops.add(parts[0])
    for top in tops:
        src, dst = src_site / top, site / top
        if src.exists() and not dst.exists():
            os.symlink(src, dst)


def project_requirements(extra: str | None = None) -> list[str]:
    """The base install's requirements, or those one extra adds."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"][extra] if extra else project["dependencies"]


def copy_checkout(dst: Path) -> Path:
    """The checkout's files as `make dist` packs them (tracked and not ignored) copied to `dst`: setuptools
    writes build/ and *.egg-info into the tree it builds."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout
    for rel in filter(None, listed.decode().split("\0")):
        if (ROOT / rel).is_file() and not (ROOT / rel).is_symlink():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    return dst


def test_wheel_installs_without_torch_and_the_server_roles_start(tmp_path: Path) -> None:
    src = copy_checkout(tmp_path / "src")
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(src)], check=True, timeout=300)
    (wheel,) = wheels.glob("kvpipe-*.whl")
    _check_wheel_contents(wheel, src)

    requirements = project_requirements()
    assert not any(_norm(Requirement(r).name) == "torch" for r in requirements), "torch is in the base install"
    closure = dependency_closure(requirements)
    assert "torch" not in closure and "faust-streaming" in closure

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for name in sorted(closure | {"pip"}):
        link_distribution(name, site)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=300)

    # Nowhere to import torch from, and every base requirement present as pip sees it.
    assert subprocess.run([str(py), "-c", "import torch"], capture_output=True).returncode != 0
    check = subprocess.run([str(py), "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    # Run outside the source tree so only the installed wheel can answer.
    run_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    kvpipe = env_dir / "bin" / "kvpipe"
    for role in ("processor", "analytics", "bridge"):
        out = subprocess.run([str(kvpipe), role, "--help"], cwd=tmp_path, env=run_env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and f"kvpipe {role}" in out.stdout, (role, out.stderr[-2000:])
    # The GPU side is the [gpu] extra: without it, a clear pointer instead of a traceback.
    node = subprocess.run([str(kvpipe), "node", "--help"], cwd=tmp_path, env=run_env, capture_output=True, text=True,
                          timeout=120)
    assert node.returncode == 2 and "kvpipe[gpu]" in node.stderr, node.stderr[-2000:]
    # Beyond --help: each base role's whole module graph (the Faust app, its agents and views) imports; the
    # analytics app's is the [analytics] extra's (tests/integration/test_install_roles.py).
    for modules in ("kvpipe.processors.routing.agents, kvpipe.processors.routing.views",
                    "kvpipe.producer.bridge.runner, kvpipe.producer.bridge.cli"):
        out = subprocess.run([str(py), "-c", f"import {modules}"], cwd=tmp_path, capture_output=True, text=True,
                             env={**run_env, "KVPIPE_STATE_DIR": str(tmp_path / "state")}, timeout=120)
        assert out.returncode == 0, (modules, out.stderr[-2000:])
    version = subprocess.run([str(kvpipe), "--version"], cwd=tmp_path, env=run_env, capture_output=True, text=True)
    assert version.stdout.strip() == f"kvpipe {_declared()}"  # read from the installed distribution's metadata

    # Nothing generic in site-packages: the installed metadata maps one import name to kvpipe, and
    # the folders' names are not importable (the venv has no other distribution that could own them).
    tops = subprocess.run([str(py), "-c", "from importlib.metadata import packages_distributions as p; "
                           "print(' '.join(sorted(t for t, d in p().items() if 'kvpipe' in d)))"],
                          cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=60)
    assert tops.stdout.split() == ["kvpipe"], tops.stdout + tops.stderr[-2000:]
    for name in FOLDERS:
        gone = subprocess.run([str(py), "-c", f"import {name}"], cwd=tmp_path, env=run_env, capture_output=True,
                              text=True, timeout=60)
        assert gone.returncode != 0 and "ModuleNotFoundError" in gone.stderr, (name, gone.stderr[-2000:])


def _check_wheel_contents(wheel: Path, src: Path) -> None:
    """`kvpipe` is the wheel's only top-level name; each folder's files are in it under kvpipe/."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        assert zf.read(f"{info}/top_level.txt").decode().split() == ["kvpipe"]
        record = zf.read(f"{info}/RECORD").decode().splitlines()
    assert {line.split(",")[0].split("/")[0] for line in record} == {"kvpipe", info}
    expected = set()
    for folder in (*FOLDERS, "kvpipe"):
        for path in (src / folder).rglob("*"):
            rel = path.relative_to(src / folder).as_posix()
            # Grafana's and Prometheus's files are the monitoring stack's, mounted from a checkout; no module
            # reads them, so the wheel leaves them out (pyproject.toml's package-data).
            if path.suffix == ".py" or (folder == "infra" and path.suffix in (".yaml", ".sql", ".sh", ".xml")
                                        and not rel.startswith(("grafana/", "prometheus/"))):
                expected.add(f"kvpipe/{rel}" if folder == "kvpipe" else f"kvpipe/{folder}/{rel}")
    assert expected <= names, f"missing from the wheel (pyproject.toml's packages): {sorted(expected - names)[:20]}"
    assert not {n for n in names if n.startswith("kvpipe/tests/") or n.startswith("tests/")}


def _declared() -> str:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_no_base_role_module_imports_torch_at_import_time(tmp_path: Path) -> None:
    # Every module of the packages the base install serves, imported with torch and numpy made
    # unimportable. The GPU package's tensor modules are the [gpu] extra's and are skipped; its pure
    # modules (hashing, hit rules, specs) serve the router and must import.
    code = r"""
import importlib, pkgutil, sys
sys.modules["torch"] = None
sys.modules["numpy"] = None
gpu_extra = ("kvpipe.bench.offload", "kvpipe.gpu.canonical", "kvpipe.gpu.kv_tensors", "kvpipe.gpu.offload",
             "kvpipe.gpu.offload_checks", "kvpipe.gpu.node")
bad = []
for pkg in ("kvpipe.schemas", "kvpipe.processors", "kvpipe.producer", "kvpipe.infra", "kvpipe", "kvpipe.gpu"):
    for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        if info.name.endswith("__main__") or info.name.startswith(gpu_extra):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError as exc:
            bad.append(f"{info.name}: {exc}")
print("\n".join(bad))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "KVPIPE_STATE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"modules that need torch/numpy at import:\n{out.stdout}"
