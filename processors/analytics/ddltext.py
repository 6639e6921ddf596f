"""Text helpers for kvpipe's own, trusted DDL: statements of a migration file split at `;`
outside literals and comments, and a statement's first keyword.

Not part of the analyst SQL gate (`sqlguard` parses and checks a tree; nothing here checks
anything): the migration runner and the sink's own statements use these.
"""
from __future__ import annotations

import re

def mask(sql: str) -> str:
    """`sql` with string/identifier contents and comments blanked out, same length (for splitting DDL files)."""
    out = list(sql)
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c in "'\"`":
            j = i + 1
            while j < n and sql[j] != c:
                j += 2 if sql[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                out[k] = " "
            i = j + 1
        elif sql.startswith("--", i) or c == "#":
            j = sql.find("\n", i)
            j = n if j < 0 else j
            out[i:j] = " " * (j - i)
            i = j
        elif sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out[i:j] = " " * (j - i)
            i = j
        else:
            i += 1
    return "".join(out)


def split_statements(sql: str) -> list[str]:
    """Statements of a trusted migration file separated by `;` outside literals and comments."""
    masked = mask(sql)
    parts, start = [], 0
    for pos, ch in enumerate(masked):
        if ch == ";":
            parts.append((start, pos))
            start = pos + 1
    parts.append((start, len(sql)))
    return [sql[a:b].strip() for a, b in parts if masked[a:b].strip()]


def first_keyword(sql: str) -> str:
    """The statement's first keyword, upper case, skipping comments ("" if none)."""
    found = re.search(r"[A-Za-z_]+", mask(sql))
    return found.group(0).upper() if found else ""
