"""Numbered DDL migrations for the analytics store, applied at sink start.

Files: `infra/clickhouse/migrations/NNN_name.sql`, applied in version order; each may hold
several statements separated by `;`. Applied versions are recorded in `kvpipe_migrations`, so a
restart applies nothing. Statements are written `IF NOT EXISTS`, so a crash between a statement
and its record only re-runs harmless DDL. An applied file whose text changed is an error: the
store already has the old DDL, and silently ignoring the edit would hide that — add a new
migration instead.

The DDL is plain ClickHouse (MergeTree family, no chDB-only syntax) so the same files serve the
embedded engine and a server.
"""
from __future__ import annotations

import hashlib
import logging
import re
import time
from pathlib import Path
from typing import Any

import msgspec

from kvpipe.processors.analytics.ddltext import split_statements

log = logging.getLogger(__name__)

# Located relative to the package, not imported: processors/ must not import infra/ (layout
# rule), and the files sit at the same relative place in a checkout and in an installed wheel.
MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "infra" / "clickhouse" / "migrations"

_FILE = re.compile(r"^(\d{3,})_[A-Za-z0-9_]+\.sql$")

_BOOTSTRAP = """
CREATE TABLE IF NOT EXISTS kvpipe_migrations
(
    version    UInt32,
    name       String,
    checksum   String,
    applied_at DateTime64(3, 'UTC')
)
ENGINE = MergeTree
ORDER BY version
"""


class MigrationError(RuntimeError):
    pass


class Migration(msgspec.Struct, frozen=True):
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()[:16]


def load_migrations(directory: Path | None = None) -> list[Migration]:
    """The migration files in version order; a repeated version or stray name is an error."""
    directory = directory or MIGRATIONS_DIR
    if not directory.is_dir():
        raise MigrationError(f"no migrations directory at {directory} (is the kvpipe install complete?)")
    found: dict[int, Migration] = {}
    for path in sorted(directory.glob("*.sql")):
        m = _FILE.match(path.name)
        if not m:
            raise MigrationError(f"{path.name}: migration files are named NNN_name.sql")
        version = int(m.group(1))
        if version in found:
            raise MigrationError(f"{path.name}: version {version} already used by {found[version].name}")
        found[version] = Migration(version, path.name, path.read_text())
    return [found[v] for v in sorted(found)]


def applied_versions(client: Any) -> dict[int, str]:
    """`version → checksum` of what the store has applied."""
    client.command(_BOOTSTRAP)
    rows = client.query("SELECT version, any(checksum) FROM kvpipe_migrations GROUP BY version").result_rows
    return {int(v): str(c) for v, c in rows}


def apply_migrations(client: Any, directory: Path | None = None) -> list[int]:
    """Apply what is missing; returns the versions applied now (empty on a restart)."""
    done = applied_versions(client)
    applied: list[int] = []
    for mig in load_migrations(directory):
        if mig.version in done:
            if done[mig.version] != mig.checksum:
                raise MigrationError(
                    f"migration {mig.name} changed after it was applied (checksum {done[mig.version]} in the "
                    f"store, {mig.checksum} on disk); restore the file and add a new numbered migration")
            continue
        for statement in split_statements(mig.sql):
            try:
                client.command(statement)
            except Exception as exc:
                raise MigrationError(f"migration {mig.name} failed on: {statement[:120]}...: {exc}") from exc
        client.insert("kvpipe_migrations", [[mig.version, mig.name, mig.checksum, round(time.time() * 1000)]],
                      column_names=["version", "name", "checksum", "applied_at"])
        log.info("analytics: applied migration %s", mig.name)
        applied.append(mig.version)
    return applied
