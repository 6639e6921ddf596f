"""The wire vocabulary of kvpipe: every record that crosses a process boundary.

Owns: vLLM's KV event structs (`events`, byte-compatible with vLLM 0.33, plus the <= 0.23 array
layout), our versioned `Envelope` (`envelope`), encoders/decoders with classified errors
(`codec`), and the typed `Settings` every process reads (`settings`).
May import: msgspec and the standard library; for the plumbing every command shares, click (`cliopts`),
python-json-logger (`logsetup`) and tenacity (`retrying`, the one retry policy) — never a Kafka, HTTP or
ClickHouse client, Faust or torch (pyproject.toml's import contracts hold this). Everything else of ours
imports this package.

Evolving the schema (the rule the golden vectors in tests/conformance enforce):
- Within major version 1, changes are additive: a new field is optional, has a default, and is
  appended after the existing ones. Old readers ignore it (the envelope is a map); new readers fill
  the default when it is absent. Never rename, retype, reorder or remove a field.
- Anything else bumps `SCHEMA_MAJOR`; readers reject unknown majors with `unknown_version` (and the
  processor sends them to the DLQ), so a mixed fleet fails loudly instead of misreading.
- Every release adds golden byte vectors for the new shape and keeps the old ones passing.
"""

if not __name__.startswith("kvpipe."):  # one module object per file (kvpipe/__init__.py)
    raise ImportError(f"import kvpipe.{__name__}, not {__name__}: the repository's top-level folders are "
                      "subpackages of kvpipe (kvpipe/__init__.py)")
