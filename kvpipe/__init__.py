"""kvpipe: the one import package of the distribution.

Its subpackages are the repository's top-level folders: `kvpipe.schemas` (schemas/), `kvpipe.gpu`
(gpu/), `kvpipe.producer` (producer/), `kvpipe.processors` (processors/), `kvpipe.infra` (infra/).
The installed wheel holds them under kvpipe/ (pyproject.toml maps each folder to its subpackage), so
a `pip install kvpipe` adds no generic top-level name such as `schemas` or `gpu` to site-packages.

In a source checkout the folders stay where the repository layout puts them, beside this package;
`_CheckoutFolders` below lets `kvpipe.schemas` resolve to `<repository>/schemas`. Each file is then a
module under exactly one name: the folders' own `__init__` refuses to be imported as `schemas` etc.

This package's own modules sit above the others: the CLI dispatcher (`cli`), the end-to-end demo
(`demo`) and the benchmark drivers and their process helpers (`bench`). The subpackages may
use each other as their docstrings allow; none of them uses `kvpipe.cli`, `kvpipe.demo` or
`kvpipe.bench`.
"""
from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

# The repository's top-level folders that are kvpipe's subpackages (pyproject.toml maps the same).
FOLDERS = ("schemas", "gpu", "producer", "processors", "infra")

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent


class _CheckoutFolders(MetaPathFinder):
    """Finds `kvpipe.<folder>` at `<repository>/<folder>` when kvpipe runs from a source checkout.

    Only the five names above and only one level deep: `kvpipe.processors.app` is then found
    through `kvpipe.processors.__path__` as usual. A finder rather than the repository root on
    `__path__`, because the root also holds `kvpipe/` itself, `tests/` and `native/`: with the root
    on `__path__`, `kvpipe.kvpipe.cli` would load this package's files a second time."""

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        parent, _, name = fullname.rpartition(".")
        if parent != __name__ or name not in FOLDERS:
            return None
        return PathFinder.find_spec(fullname, [str(_ROOT)])


def _in_checkout() -> bool:
    # An installed wheel has the folders inside kvpipe/; a checkout has them beside it.
    return not (_HERE / "schemas").is_dir() and (_ROOT / "schemas" / "__init__.py").is_file()


# By class name: a reloaded kvpipe defines a new class, and the finder must still be installed once.
if _in_checkout() and not any(type(f).__name__ == "_CheckoutFolders" for f in sys.meta_path):
    sys.meta_path.append(_CheckoutFolders())
