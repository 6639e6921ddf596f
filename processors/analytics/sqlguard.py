"""The gate in front of analyst SQL: parse the statement, allow only reads of kvpipe's own tables.

Safe by construction, not by pattern: the statement is parsed with sqlglot (ClickHouse dialect) and every node of
the tree is checked against allowlists; what runs is the SQL that sqlglot *generates* from the checked tree, never
the analyst's text. So a comment, an odd quote or an escape that sqlglot and ClickHouse would read differently
cannot smuggle anything past the check: the engine receives text with no comments, written by the same code whose
tree was checked (and `check_sql` re-parses its own output and requires the same text back).

What is allowed:

- `SELECT`, `WITH ... SELECT`, `UNION`/`INTERSECT`/`EXCEPT` of those, subqueries, joins (ARRAY JOIN of an
  expression too), window functions, `{name:Type}` parameters. Every table position (FROM, JOIN, `IN table`) must
  hold a plain name of a kvpipe table or view (`allowed_tables()`, parsed from the migrations), optionally qualified
  with kvpipe's database, or the name of a CTE defined around it. Anything else in table position is refused:
  table functions (`file`, `url`, `s3`, `remote`, `numbers`, `values`, `merge`, `view`, ... all of them, known or
  future), other databases (`system.tables`), `{t:Identifier}` parameters.
- Functions from `sqlfunctions.ALLOWED_FUNCTIONS`: an allowlist, not a denylist, because ClickHouse grows functions
  that reach the host or the network (scalar `file()`, `dictGet*`, `joinGet`, `getSetting`, `ai*`, ...); a new
  one is refused until reviewed. Aggregate combinators (`sumIf`, `uniqState`) are allowed on allowed aggregates.
- `SHOW TABLES`, `SHOW CREATE [TABLE|VIEW] <kvpipe table>`, `DESCRIBE [TABLE] <kvpipe table>` (not of a table
  function or a subquery), `EXPLAIN [AST|SYNTAX|PLAN|PIPELINE|ESTIMATE] <allowed SELECT>`.

Refused anywhere in the tree: `SETTINGS` (a query must not lift its own limits), `FORMAT`, `INTO OUTFILE`,
`VALUES`, quoted function names, more than one statement, and every other statement kind (INSERT, ALTER, SET,
SYSTEM, KILL, ...). This gate is the first line; the engine's `readonly=1` and per-query limits (`query.py`) and,
on a server, a read-only user (docs/analyst-sql.md) are the next ones.

Parameters: the placeholders the checked tree holds are returned with the text (`checked_sql`), so the caller binds
exactly those in the engine and refuses any other parameter (query.py: `bind_values`, `engine_query`). A
`{name:Type}` inside a string literal is text, not a placeholder, and is not returned.

Splitting kvpipe's own trusted migration files is not part of the gate: `ddltext` does that.
"""
from __future__ import annotations

import functools
import re
from typing import NamedTuple, cast

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, TokenError

from kvpipe.processors.analytics.migrations import _BOOTSTRAP, load_migrations
from kvpipe.processors.analytics.sqlfunctions import AGGREGATE_FUNCTIONS, ALLOWED_FUNCTIONS, MAX_AGGREGATE_PARAMETERS, \
    UNBOUNDED_FUNCTIONS

DIALECT = "clickhouse"
DEFAULT_DATABASE = "default"
READ_ONLY_KEYWORDS = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN"})
EXPLAIN_KINDS = frozenset({"AST", "SYNTAX", "PLAN", "PIPELINE", "ESTIMATE"})

_ALLOWED_LOWER = frozenset(n.lower() for n in ALLOWED_FUNCTIONS)
_AGGREGATES_LOWER = frozenset(n.lower() for n in AGGREGATE_FUNCTIONS)
_UNBOUNDED_LOWER = {n.lower(): (n, why) for n, why in UNBOUNDED_FUNCTIONS.items()}
# Longest first, so "MergeState" is not read as "State" after "Merge".
_COMBINATORS = ("SimpleState", "MergeState", "OrDefault", "Resample", "Distinct", "ForEach", "OrNull", "ArgMin",
                "ArgMax", "State", "Merge", "Array", "Map", "If")
_LEADING_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(")
# Typed sqlglot nodes that render as syntax rather than `name(...)`: operators (AND, =, +, NOT, ...) and CASE;
# they only combine their arguments, which the walk checks on their own.
_SYNTAX_FUNCS = (exp.Case, exp.If, exp.Binary, exp.Unary, exp.Connector)
_QUERY = (exp.Select, exp.SetOperation, exp.Subquery)
_NEVER = (exp.Values, exp.Into, exp.Command, exp.Lateral, exp.Unnest, exp.Set, exp.SetItem, exp.Insert,
          exp.Create, exp.Drop, exp.Alter, exp.Delete, exp.Update, exp.Merge, exp.Use, exp.Kill)


def _teach_sqlglot_our_aggregates() -> None:
    """Make sqlglot read `f(params)(args)` for every allowlisted aggregate, not only the ones it lists.

    sqlglot's ClickHouse parser recognises parametric aggregates by name from a fixed table; for a name missing
    there (`quantilesExactInclusive`, `medianDD`, ...) it reads `f(0.5)(x)` as `f(0.5) AS (x)` and the regenerated
    text no longer means what the analyst wrote (the engine then rejects it). Adding our names to that table is the
    narrowest fix; should a sqlglot upgrade move the table, those functions fail to parse (refused, never
    misread), and tests/unit/test_sqlguard.py says so.
    """
    try:
        from sqlglot.parsers import clickhouse as parser_module

        # sqlglot types the table as a read-only Mapping; it is the module's own dict, extended in place.
        mapping = cast(dict, parser_module._AGG_FUNC_MAPPING)
        suffixes = parser_module._AGG_FUNCTIONS_SUFFIXES
    except (ImportError, AttributeError):
        return
    for name in AGGREGATE_FUNCTIONS:
        if name not in mapping:
            mapping[name] = (name, None)
            for suffix in suffixes:
                mapping.setdefault(name + suffix, (name, suffix))


_teach_sqlglot_our_aggregates()


class SqlRefused(ValueError):
    """The statement is valid SQL that analysts may not run here; the message names what and why."""


class SqlSyntaxError(ValueError):
    """The statement does not parse; the message gives the parser's reason and position."""


@functools.lru_cache(maxsize=1)
def allowed_tables() -> frozenset[str]:
    """Names of the tables and views kvpipe's migrations create, parsed from their DDL."""

    names: set[str] = set()
    # The bookkeeping table the migration runner creates is kvpipe's too (which versions a store has applied).
    for migration in [_BOOTSTRAP, *(m.sql for m in load_migrations())]:
        for statement in sqlglot.parse(migration, read=DIALECT):
            if isinstance(statement, exp.Create):
                target = statement.this
                table = target.this if isinstance(target, exp.Schema) else target
                if isinstance(table, exp.Table):
                    names.add(table.name)
    return frozenset(names)


class CheckedSql(NamedTuple):
    """A statement that passed the gate: the text to run and the `{name:Type}` placeholders of its tree."""

    text: str
    placeholders: dict[str, str]  # name -> ClickHouse type, as written in `text`


def check_sql(sql: str, *, database: str = DEFAULT_DATABASE) -> str:
    """The SQL to run for `sql` (regenerated from the checked tree), or SqlRefused / SqlSyntaxError saying why not."""
    return checked_sql(sql, database=database).text


def checked_sql(sql: str, *, database: str = DEFAULT_DATABASE) -> CheckedSql:
    """`check_sql`, with the placeholders found in the checked tree (the only names a parameter may bind)."""
    if not isinstance(sql, str) or not sql.strip():
        raise SqlRefused("empty SQL: expected one SELECT / WITH / SHOW / DESCRIBE / EXPLAIN statement")
    statement = _parse_one(sql)
    if isinstance(statement, exp.Describe):
        return CheckedSql(_describe(statement, database), {})
    if isinstance(statement, exp.Command) and statement.name.upper() in ("SHOW", "EXPLAIN"):
        tail = statement.expression.name if statement.expression else ""
        return CheckedSql(_show(tail, database), {}) if statement.name.upper() == "SHOW" else _explain(tail, database)
    if isinstance(statement, _QUERY):
        return _checked_query(statement, database)
    raise SqlRefused(f"{_statement_kind(statement, sql)} statements are not allowed: analyst SQL is read-only "
                     f"(allowed: SELECT, WITH ... SELECT, SHOW, DESCRIBE, EXPLAIN)")


def _placeholders(tree: exp.Expression) -> dict[str, str]:
    """The placeholders of a checked tree (the tree of the text that runs: `_checked_query` re-parses it)."""
    found: dict[str, str] = {}
    for node in tree.find_all(exp.Placeholder):
        kind = node.args.get("kind")
        type_name = kind.sql(dialect=DIALECT) if isinstance(kind, exp.Expression) else str(kind or "")
        if node.name in found and found[node.name] != type_name:
            raise SqlRefused(f"parameter {node.name!r} is used with two types ({found[node.name]}, {type_name})")
        found[node.name] = type_name
    return found


# Compatibility name: the sink and the CLI called the read-only check this.
check_read_only = check_sql


# --- statements -----------------------------------------------------------------------------------------------

def _parse_one(sql: str) -> exp.Expression:
    keyword = _first_token(sql)
    if keyword and keyword not in READ_ONLY_KEYWORDS and keyword != "(":
        # Named before parsing: KILL or SYSTEM may not even parse, and the analyst needs "not allowed", not a syntax hint.
        raise SqlRefused(f"{keyword} statements are not allowed: analyst SQL is read-only "
                         f"(allowed: SELECT, WITH ... SELECT, SHOW, DESCRIBE, EXPLAIN)")
    try:
        statements = [s for s in sqlglot.parse(sql, read=DIALECT) if s is not None]
    except (ParseError, TokenError) as exc:
        words = [w.upper() for w in _tokens(sql)] if isinstance(exc, ParseError) else []
        if any(a == "INTO" and b == "OUTFILE" for a, b in zip(words, words[1:])):
            # sqlglot cannot parse it; say what it is, since the engine would write a file even under readonly=1
            raise SqlRefused("SELECT ... INTO OUTFILE writes a file on the engine's host; not allowed") from None
        raise SqlSyntaxError(f"cannot parse the statement: {_parse_reason(exc)}") from None
    if not statements:
        raise SqlRefused("empty SQL: expected one SELECT / WITH / SHOW / DESCRIBE / EXPLAIN statement")
    if len(statements) > 1:
        raise SqlRefused(f"{len(statements)} statements given; run one read-only statement at a time")
    statement = statements[0]
    if not isinstance(statement, exp.Expression):  # every statement sqlglot parses is one; refuse rather than guess
        raise SqlRefused(f"cannot check a {type(statement).__name__}: expected a statement")
    return statement


def _checked_query(query: exp.Expression, database: str) -> CheckedSql:
    _check_tree(query, database)
    out = query.sql(dialect=DIALECT, comments=False)
    # Fixed point: what we run must parse back to a tree that passes and prints the same text.
    again = _parse_one(out)
    _check_tree(again, database)
    if again.sql(dialect=DIALECT, comments=False) != out:
        raise SqlRefused("the statement does not print back to itself after parsing; rewrite it more plainly")
    return CheckedSql(out, _placeholders(again))


def _describe(statement: exp.Describe, database: str) -> str:
    extra = [k for k, v in statement.args.items() if v and k not in ("this", "kind", "as_json")]
    target = statement.this
    if extra or not isinstance(target, exp.Table):
        raise SqlRefused("DESCRIBE is allowed on kvpipe's tables only (DESCRIBE TABLE kv_events), not on table "
                         "functions, subqueries or with options")
    name = _table_name(target, database, ctes=frozenset())
    return f"DESCRIBE TABLE {name}"


def _show(tail: str, database: str) -> str:
    words = _tokens(tail)
    upper = [w.upper() for w in words]
    if upper == ["TABLES"]:
        return "SHOW TABLES"
    if upper[:1] == ["CREATE"]:
        rest = words[2:] if upper[1:2] in (["TABLE"], ["VIEW"]) else words[1:]
        if len(rest) == 1:
            name = rest[0]
            if name in allowed_tables():
                return f"SHOW CREATE TABLE {name}"
            raise SqlRefused(f"SHOW CREATE {name}: not one of kvpipe's tables ({', '.join(sorted(allowed_tables()))})")
    raise SqlRefused("SHOW is allowed as SHOW TABLES or SHOW CREATE TABLE <kvpipe table> only")


def _explain(tail: str, database: str) -> CheckedSql:
    tokens = _raw_tokens(tail)
    kind = ""
    body = tail
    if tokens and tokens[0].text.upper() in EXPLAIN_KINDS:
        kind = tokens[0].text.upper()
        body = tail[tokens[0].end + 1:]
    if _first_token(body) not in ("SELECT", "WITH", "("):
        raise SqlRefused(f"EXPLAIN is allowed as EXPLAIN [{'|'.join(sorted(EXPLAIN_KINDS))}] <SELECT ...> only")
    query = _parse_one(body)
    if not isinstance(query, _QUERY):
        raise SqlRefused("EXPLAIN is allowed on a SELECT only")
    checked = _checked_query(query, database)
    return CheckedSql(f"EXPLAIN {kind + ' ' if kind else ''}{checked.text}", checked.placeholders)


# --- the tree walk ----------------------------------------------------------------------------------------------

def _check_tree(root: exp.Expression, database: str) -> None:
    for node in root.walk():
        if isinstance(node, _NEVER):
            raise SqlRefused(f"{_describe_node(node)} is not allowed in analyst SQL")
        if isinstance(node, exp.Query) and (node.args.get("settings") or node.args.get("format")):
            what = "SETTINGS" if node.args.get("settings") else "FORMAT"
            raise SqlRefused(f"a {what} clause is not allowed: the service sets the engine's settings and the "
                             f"answer's format")
        if isinstance(node, exp.Placeholder):
            _check_placeholder(node)
        elif isinstance(node, exp.Table):
            _table_name(node, database, _ctes_in_scope(node))
        elif isinstance(node, (exp.From, exp.Join)):
            _check_source(node)
        elif isinstance(node, exp.In) and node.args.get("field") is not None:
            _check_in_table(node.args["field"], database)
        elif isinstance(node, exp.Func):
            _check_function(node)


def _check_source(node: exp.From | exp.Join) -> None:
    source = node.this
    if isinstance(node, exp.Join) and str(node.args.get("kind") or "").upper() == "ARRAY":
        return  # ARRAY JOIN unfolds an expression of the rows already read; its functions are checked on their own
    while isinstance(source, exp.Final):
        source = source.this
    if isinstance(source, exp.Alias):
        source = source.this
    if not isinstance(source, (exp.Table, exp.Subquery)):
        raise SqlRefused(f"{_describe_node(source)} in FROM/JOIN is not allowed: read kvpipe's tables by name "
                         f"({', '.join(sorted(allowed_tables()))})")


def _table_name(table: exp.Table, database: str, ctes: frozenset[str]) -> str:
    """The plain name of an allowed table reference, or SqlRefused."""
    target = table.this
    if not isinstance(target, exp.Identifier):
        raise SqlRefused(f"{_describe_node(target)} is not allowed in table position: analyst SQL reads kvpipe's "
                         f"tables by name only ({', '.join(sorted(allowed_tables()))}); table functions such as "
                         f"file, url, s3, remote or numbers are refused")
    name = target.name
    if table.args.get("catalog") is not None:
        raise SqlRefused(f"{table.sql(dialect=DIALECT)}: names with a catalog are not allowed")
    db = table.args.get("db")
    if db is not None:
        if db.name != database:
            raise SqlRefused(f"{db.name}.{name}: only kvpipe's database {database!r} may be read")
        if name not in allowed_tables():
            raise SqlRefused(f"{db.name}.{name} is not one of kvpipe's tables ({', '.join(sorted(allowed_tables()))})")
        return name
    if name in ctes or name in allowed_tables():
        return name
    raise SqlRefused(f"table {name!r} is not one of kvpipe's tables ({', '.join(sorted(allowed_tables()))}) "
                     f"nor a CTE defined in the statement")


def _check_in_table(field: exp.Expression, database: str) -> None:
    """`x IN name` reads the table `name` in ClickHouse; hold it to the table rules."""
    if isinstance(field, exp.Column) and not field.args.get("catalog"):
        table = exp.Table(this=field.this, db=field.args.get("table"))
        db = field.args.get("db")
        if db is not None:
            raise SqlRefused(f"{field.sql(dialect=DIALECT)}: names with a catalog are not allowed")
        _table_name(table, database, _ctes_in_scope(field))
        return
    raise SqlRefused(f"IN {_describe_node(field)} is not allowed: use IN (subquery), IN (values) or IN a kvpipe table")


def _ctes_in_scope(node: exp.Expression) -> frozenset[str]:
    names: set[str] = set()
    parent = node.parent
    while parent is not None:
        with_ = parent.args.get("with_") if isinstance(parent, exp.Query) else None
        if with_ is not None:
            names.update(cte.alias_or_name for cte in with_.expressions if isinstance(cte, exp.CTE))
        parent = parent.parent
    return frozenset(names)


def _check_placeholder(node: exp.Placeholder) -> None:
    kind = node.args.get("kind")
    type_name = kind.sql(dialect=DIALECT) if isinstance(kind, exp.Expression) else str(kind or "")
    if not type_name.strip() or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", node.name or ""):
        raise SqlRefused(f"placeholder {node.sql(dialect=DIALECT)!r} is not allowed: parameters are written "
                         f"{{name:Type}} (a name of letters, digits and _, and a ClickHouse type)")
    if type_name.strip().lower() == "identifier":
        raise SqlRefused(f"parameter {{{node.name}:Identifier}} is not allowed: parameters bind values, not names")


def _check_function(node: exp.Func) -> None:
    name = function_name(node)
    if name is None:
        return  # CASE / if(): syntax over their arguments, which the walk checks
    if name.lower() in _UNBOUNDED_LOWER:  # named with the reason: these are on purpose, not merely unreviewed
        known, why = _UNBOUNDED_LOWER[name.lower()]
        raise SqlRefused(f"function {known}() is not allowed in analyst SQL: no time limit can stop one call of it, "
                         f"because {why}")
    if not function_allowed(name):
        raise SqlRefused(f"function {name}() is not allowed in analyst SQL (it is not on the allowlist of pure "
                         f"functions in processors/analytics/sqlfunctions.py)")
    levels = node.expressions if isinstance(node, (exp.ParameterizedAgg, exp.CombinedParameterizedAgg)) else []
    if len(levels) > MAX_AGGREGATE_PARAMETERS:
        raise SqlRefused(f"{name}(...) has {len(levels)} parameters; at most {MAX_AGGREGATE_PARAMETERS}: each one "
                         f"is a pass over the group's values that no time limit can stop")


def function_name(node: exp.Func) -> str | None:
    """The name ClickHouse will see for a function node (None for syntax such as CASE)."""
    this = node.args.get("this")
    if isinstance(node, (exp.Anonymous, exp.AnonymousAggFunc, exp.ParameterizedAgg, exp.CombinedAggFunc,
                         exp.CombinedParameterizedAgg)):
        if isinstance(this, exp.Identifier):
            if this.quoted:
                raise SqlRefused(f"quoted function name {this.sql(dialect=DIALECT)} is not allowed; write the name "
                                 f"plainly")
            return this.name
        if isinstance(this, str):
            return this
        raise SqlRefused(f"{_describe_node(node)} is not allowed: call functions by a plain name")
    if isinstance(node, _SYNTAX_FUNCS):
        return None
    rendered = node.sql(dialect=DIALECT, comments=False)
    match = _LEADING_NAME.match(rendered)
    if match:
        return match.group(1)
    raise SqlRefused(f"expression {rendered[:60]!r} ({type(node).__name__}) is not supported in analyst SQL")


def function_allowed(name: str) -> bool:
    lower = name.lower()
    if lower in _ALLOWED_LOWER:
        return True
    base = name
    stripped = True
    while stripped and base:
        stripped = False
        for suffix in _COMBINATORS:
            if base.endswith(suffix) and len(base) > len(suffix):
                base = base[: -len(suffix)]
                stripped = True
                if base.lower() in _AGGREGATES_LOWER:
                    return True
                break
    return False


# --- small helpers -------------------------------------------------------------------------------------------------

def _raw_tokens(text: str) -> list:
    """Tokens of `text` by sqlglot's ClickHouse tokenizer (comments dropped, identifiers unquoted)."""
    try:
        return sqlglot.Dialect.get_or_raise(DIALECT).tokenize(text)
    except TokenError as exc:
        raise SqlSyntaxError(f"cannot read the statement: {_parse_reason(exc)}") from None


def _tokens(text: str) -> list[str]:
    return [t.text for t in _raw_tokens(text)]


def _first_token(sql: str) -> str:
    words = _tokens(sql)
    return words[0].upper() if words else ""


def _statement_kind(statement: exp.Expression, sql: str) -> str:
    if isinstance(statement, exp.Command):
        return statement.name.upper()
    return _first_token(sql) or type(statement).__name__.upper()


def _describe_node(node: exp.Expression) -> str:
    if isinstance(node, exp.Func):
        try:
            name = function_name(node) or type(node).__name__
        except SqlRefused:
            name = type(node).__name__
        return f"table function {name}(...)" if isinstance(node.parent, exp.Table) else f"{name}(...)"
    if isinstance(node, exp.Into):
        return "INTO OUTFILE / INTO"
    if isinstance(node, exp.Values):
        return "VALUES / values(...)"
    if isinstance(node, exp.Placeholder):
        return f"parameter {{{node.name}}}"
    return f"{type(node).__name__.upper()} ({node.sql(dialect=DIALECT)[:40]})"


def _parse_reason(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if errors:
        first = errors[0]
        return f"{first.get('description')} at line {first.get('line')}, column {first.get('col')}"
    return re.sub(r"\x1b\[[0-9;]*m", "", str(exc))[:200]
