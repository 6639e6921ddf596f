"""One import package: the repository's top-level folders are used only as `kvpipe.<folder>`.

The folders (schemas/, gpu/, producer/, processors/, infra/) are kvpipe's subpackages, in the wheel
(pyproject.toml) and in a checkout (kvpipe/__init__.py). A file reached under its folder's bare name
as well would be a second module object: a second Faust app, Struct classes msgspec tells apart,
counters nobody reads. So nothing in the repository may name a module the old way — not an import,
not a dotted string (dynamic imports, monkeypatch targets, `-m` runs, Faust's `-A` and autodiscover),
not a command in the docs — and importing everything loads each file once.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from kvpipe import FOLDERS

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()
# native/: the Rust crate's comments cite the Python reference; a change there rebuilds the
# extension in every checkout's venv (infra/scripts/native.sh keys its cache on the sources).
SKIPPED_DIRS = ("native/",)
SKIPPED_SUFFIXES = (".json", ".lock", ".png", ".whl", ".so")

_OLD = "|".join(FOLDERS)
# `from schemas import x`, `import gpu`, also inside strings run by `python -c`; not "import infra/" in prose.
IMPORT = re.compile(rf"(?<![\w.])(?:from|import)[ \t]+({_OLD})\b(?![/\w-])")
# `processors.app`, `"schemas.codec.decode"`: a dotted name that starts with a folder's bare name.
DOTTED = re.compile(rf"(?<![\w./\\-])({_OLD})((?:\.[A-Za-z_]\w*)+)")
# `python -m gpu`, `faust -A processors` with no dotted part.
RUN_FLAG = re.compile(rf"(?:^|\s)-[mA][ \t]+({_OLD})\b(?![./\w-])")


def _modules() -> set[str]:
    """Dotted names of every module and package under the folders, by their bare (old) names."""
    names = set()
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _repo_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    return sorted(f for f in out.split("\0") if f and f != SELF and not f.startswith(SKIPPED_DIRS)
                  and not f.endswith(SKIPPED_SUFFIXES) and (ROOT / f).is_file())


def old_names(text: str, modules: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each use of a folder's bare name as a module in `text`."""
    found = []
    for regex in (IMPORT, RUN_FLAG):
        found += [(m.start(), m.group(0).strip()) for m in regex.finditer(text)]
    for m in DOTTED.finditer(text):
        parts = (m.group(1) + m.group(2)).split(".")
        # A module's name, not an attribute of a variable that happens to be called `producer`.
        if any(".".join(parts[:i]) in modules for i in range(2, len(parts) + 1)):
            found.append((m.start(), m.group(0)))
    return sorted((text.count("\n", 0, pos) + 1, what) for pos, what in found)


def test_the_checks_see_old_names():
    modules = {"processors", "processors.app", "processors.analytics", "processors.analytics.app", "schemas",
               "schemas.codec"}
    text = ('from schemas.codec import decode\nfrom processors import app\n'
            'monkeypatch.setattr("processors.analytics.app.thing", 1)\nrun(["faust", "-A", "processors.app"])\n'
            'sh -c "python -m processors"\nproducer.poll(0)  # a variable\nsee processors/routing/app.py and infra/\n'
            'from kvpipe.schemas.codec import decode\nfaust -A kvpipe.processors.routing.app worker\n')
    assert [line for line, _ in old_names(text, modules)] == [1, 1, 2, 3, 4, 5]


def test_no_file_names_a_module_by_its_folder_alone():
    modules = _modules()
    problems = []
    for rel in _repo_files():
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        problems += [f"{rel}:{line}: {what}" for line, what in old_names(text, modules)]
    assert problems == [], ("modules named without `kvpipe.` (write kvpipe.<folder>…, or re-run the rewrite):\n"
                            + "\n".join(problems[:50]))


def test_every_module_loads_once_under_kvpipe(tmp_path):
    # A fresh interpreter imports every module of the distribution (torch is there: the GPU side too).
    code = r"""
import importlib, json, pkgutil, sys
import kvpipe
failed = []
for pkg in ["kvpipe"] + ["kvpipe." + f for f in kvpipe.FOLDERS]:
    for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        if not info.name.endswith("__main__"):
            try:
                importlib.import_module(info.name)
            except ImportError as exc:
                failed.append(f"{info.name}: {exc}")
try:
    import schemas
    bare = "imported"
except ImportError as exc:
    bare = str(exc)
files = {}
for name, mod in list(sys.modules.items()):
    f = getattr(mod, "__file__", None)
    if f:
        files.setdefault(f, []).append(name)
print(json.dumps({"failed": failed, "bare": bare, "modules": sorted(sys.modules), "files": files}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_")},
                              "PYTHONPATH": str(ROOT), "KVPIPE_STATE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # Optional baselines (e.g. the Dynamo bench's) import lazily; everything else must import.
    assert result["failed"] == []
    assert "kvpipe.processors.routing.app" in result["modules"] and "kvpipe.gpu.hit" in result["modules"]
    assert [m for m in result["modules"] if m.split(".")[0] in FOLDERS] == []
    ours = {f: names for f, names in result["files"].items() if Path(f).resolve().is_relative_to(ROOT)}
    assert {f: names for f, names in ours.items() if len(names) > 1} == {}, "a file loaded under two names"
    assert "import kvpipe.schemas, not schemas" in result["bare"]


def test_pyproject_maps_the_folders_and_lists_every_package():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"] == {"kvpipe": "kvpipe", **{f"kvpipe.{f}": f for f in FOLDERS}}
    packages = set()
    for top in ("kvpipe", *FOLDERS):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).parts
            packages.add(".".join(rel) if top == "kvpipe" else ".".join(("kvpipe", *rel)))
    assert sorted(tool["packages"]) == sorted(packages), "pyproject.toml's packages must list every package"
    assert set(tool["package-data"]) == {"kvpipe.infra"}
