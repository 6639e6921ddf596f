"""A small SQL scanner: split statements and tell read-only statements from the rest.

Not a parser. It masks what cannot hold a keyword — string literals, quoted identifiers and
comments — and then looks at what is left: the first keyword, statement separators, and
`INTO OUTFILE`. The engine's `readonly=1` setting is the second line of defence; this one exists
because it names the offending statement for the analyst, and because `SELECT ... INTO OUTFILE`
writes a file even under `readonly=1` (checked on chDB 4.4 / ClickHouse 26.9).
"""
from __future__ import annotations

import re

READ_ONLY_KEYWORDS = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN"})

_WORD = re.compile(r"[A-Za-z_]+")
_OUTFILE = re.compile(r"\bINTO\s+OUTFILE\b", re.IGNORECASE)


def mask(sql: str) -> str:
    """`sql` with string/identifier contents and comments blanked out, same length."""
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
    """Statements separated by `;` outside literals and comments; empty ones dropped."""
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
    found = _WORD.search(mask(sql))
    return found.group(0).upper() if found else ""


def check_read_only(sql: str) -> str:
    """The single read-only statement in `sql` (trailing `;` removed), or ValueError saying why not."""
    statements = split_statements(sql)
    if not statements:
        raise ValueError("empty SQL: expected one SELECT / WITH / SHOW / DESCRIBE / EXPLAIN statement")
    if len(statements) > 1:
        raise ValueError(f"{len(statements)} statements given; run one read-only statement at a time")
    statement = statements[0]
    keyword = first_keyword(statement)
    if keyword not in READ_ONLY_KEYWORDS:
        shown = keyword or statement[:40]
        raise ValueError(f"{shown} statements are not allowed: analytics SQL is read-only "
                         f"(allowed: {', '.join(sorted(READ_ONLY_KEYWORDS))})")
    if _OUTFILE.search(mask(statement)):
        raise ValueError("SELECT ... INTO OUTFILE writes a file on the processor's host; not allowed")
    return statement
