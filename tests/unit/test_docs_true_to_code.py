"""What README.md and docs/ tell a user to type exists: every `kvpipe …` command line in their code
(inline code and fenced blocks) names a real command, and every flag on it is one that command
takes; every file path they cite is in the repository.

every endpoint they name as `GET /path` or `POST /path` is in one of the apps' OpenAPI documents
(tests/unit/test_http_answers.py holds those documents equal to the routes each app registers) or
is the bridge's `/metrics`.
"""
from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from kvpipe.cli import COMMANDS, kvpipe

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.DOTALL)
_INLINE = re.compile(r"`([^`\n]+)`")
# `kvpipe sub [sub2] …` up to a shell separator; the line may start with env assignments or a venv path
_COMMAND = re.compile(r"(?:^|[\s;&|(])(?:[\w./$(){}-]*/)?kvpipe ([a-z][a-z-]*)((?:[ \t]+[^\s;&|)]+)*)", re.M)
_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
# flags a command takes by pattern rather than by name (clickhouse-client's --param_NAME)
PATTERN_FLAGS = {("sql",): re.compile(r"--param_\w+")}


def _code(text: str) -> list[str]:
    blocks = _FENCE.findall(text)
    rest = _FENCE.sub("", text)
    return blocks + _INLINE.findall(rest)


def _command_lines() -> list[tuple[str, str, str]]:
    """(doc, subcommand, the rest of the line) for each `kvpipe SUB …` in the docs' code."""
    found = []
    for doc in DOCS:
        for code in _code(doc.read_text()):
            for m in _COMMAND.finditer(code):
                found.append((doc.relative_to(ROOT).as_posix(), m.group(1), m.group(2)))
    return found


def _resolve(sub: str, rest: list[str]) -> tuple[tuple[str, ...], click.Command, list[str]]:
    """The click command `kvpipe sub [group members…]` names, and the words after it."""
    ctx = click.Context(kvpipe)
    command = kvpipe.get_command(ctx, sub)
    assert command is not None, sub
    path = (sub,)
    while isinstance(command, click.Group) and rest and rest[0] in command.list_commands(ctx):
        path += (rest[0],)
        command = command.get_command(ctx, rest.pop(0))
    return path, command, rest


def _flags(command: click.Command, tail: list[str] | None = None) -> set[str]:
    """The options `command` takes; for a group followed by a placeholder (`kvpipe bench <name> --json`),
    those any of its commands takes."""
    names = {"--help", "-h"}
    for p in command.params:
        names |= set(p.opts) | set(p.secondary_opts)
    if isinstance(command, click.Group) and tail and not tail[0].startswith("-"):
        ctx = click.Context(command)
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None:
                names |= _flags(sub)
    return names


def test_the_docs_name_commands_at_all():
    subs = {sub for _, sub, _ in _command_lines()}
    assert {"processor", "analytics", "sql", "route", "infra", "bench"} <= subs, subs


def test_every_kvpipe_command_line_in_the_docs_exists_with_its_flags():
    problems = []
    for doc, sub, rest in _command_lines():
        if sub not in COMMANDS:
            problems.append(f"{doc}: `kvpipe {sub}` is not a command (known: {', '.join(COMMANDS)})")
            continue
        words = rest.split()
        try:
            path, command, tail = _resolve(sub, words)
        except ModuleNotFoundError as exc:  # the GPU side needs torch: its flags are still declared by click
            pytest.fail(f"{doc}: cannot load `kvpipe {sub}` to check it: {exc}")
        known = _flags(command, tail)
        pattern = PATTERN_FLAGS.get(path)
        for word in tail:
            m = _FLAG.match(word)
            if not m or m.group(1) in ("-", "--"):
                continue
            flag = m.group(1).split("=")[0]
            if flag not in known and not (pattern and pattern.fullmatch(flag)):
                problems.append(f"{doc}: `kvpipe {' '.join(path)} … {flag}`: no such option")
    assert problems == [], "\n".join(problems)


def test_the_checker_catches_a_made_up_flag_and_command():
    path, command, tail = _resolve("sql", ["--no-such-flag"])
    assert "--no-such-flag" not in _flags(command) and path == ("sql",)
    assert "frobnicate" not in COMMANDS


def test_every_repository_path_the_docs_cite_exists():
    cited = re.compile(r"(?<![\w./-])((?:schemas|gpu|producer|processors|infra|kvpipe|native|tests|docs)/[\w./-]*\w)")
    problems = []
    for doc in DOCS:
        for code in _code(doc.read_text()):
            for path in cited.findall(code):
                if "*" in path or "<" in path or path.startswith("infra/secrets/"):  # made by the user
                    continue
                if not (ROOT / path).exists():
                    problems.append(f"{doc.relative_to(ROOT)}: {path}")
    assert problems == [], "paths the docs cite that the repository lacks:\n" + "\n".join(sorted(set(problems)))


def test_every_endpoint_the_docs_name_is_served():
    from kvpipe.processors.analytics.apidoc import document as analytics_document
    from kvpipe.processors.routing.apidoc import document as routing_document

    served = {(method.upper(), path) for doc in (routing_document(), analytics_document())
              for path, ops in doc["paths"].items() for method in ops}
    served.add(("GET", "/metrics"))  # the bridge's (producer/bridge/metrics.py), outside both documents
    named = re.compile(r"\b(GET|POST|PUT|PATCH|DELETE) (/[\w/.{}-]*\w)")
    found, problems = 0, []
    for doc in DOCS:
        for code in _code(doc.read_text()):
            for method, path in named.findall(code):
                found += 1
                if (method, path.split("?")[0]) not in served:
                    problems.append(f"{doc.relative_to(ROOT)}: {method} {path}")
    assert found >= 10, "the docs name endpoints as METHOD /path"
    assert problems == [], "endpoints the docs name that no app serves:\n" + "\n".join(sorted(set(problems)))
