"""kvpipe: the one import package of the distribution.

Its subpackages are the repository's top-level folders: `kvpipe.schemas` (schemas/), `kvpipe.gpu`
(gpu/), `kvpipe.producer` (producer/), `kvpipe.processors` (processors/), `kvpipe.infra` (infra/).
The installed wheel holds them under kvpipe/ (pyproject.toml maps each folder to its subpackage), so
a `pip install kvpipe` adds no generic top-level name such as `schemas` or `gpu` to site-packages.

In a source checkout the folders stay where the repository layout puts them, beside this package,
and kvpipe/ holds one relative symbolic link per folder (`kvpipe/schemas -> ../schemas`, ...): the
checkout has the wheel's shape, so `kvpipe.schemas` resolves by the standard import system, and
editors, type checkers and import-linter follow every import without a custom finder. Each file is
a module under exactly one name: the folders' own `__init__` refuses to be imported as `schemas` etc.

This package's own modules sit above the others: the CLI dispatcher (`cli`), the end-to-end demo
(`demo`) and the benchmark drivers and their process helpers (`bench`). The subpackages may
use each other as their docstrings allow; none of them uses `kvpipe.cli`, `kvpipe.demo` or
`kvpipe.bench`.
"""
from __future__ import annotations

# The repository's top-level folders that are kvpipe's subpackages (pyproject.toml maps the same;
# kvpipe/<folder> links to each in a checkout).
FOLDERS = ("schemas", "gpu", "producer", "processors", "infra")
