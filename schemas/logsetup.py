"""How kvpipe's processes log: text lines for people (the default), or one JSON object per line for a log pipeline
(`--log-format json`, the `log_format` setting, KVPIPE_LOG_FORMAT). kvpipe's commands log on stderr
(`configure`); the two Faust apps' workers where Faust logs, its standard output, with Faust's own text format
unless JSON is asked for (`faust_logging_config`).

Here, beside `cliopts`, because every package with a command may import `schemas`; python-json-logger is the one
library it adds, a base dependency imported only when JSON is asked for.

A JSON line (python-json-logger's `JsonFormatter`): `time` (UTC, ISO 8601), `level`, `logger`, `message`, and
`exception` (the traceback's text) when the record carries one, plus any `extra=` fields of the call.

Secrets: every line these formatters write, text or JSON, has the secret values of the settings (the API token,
Kafka passwords, the OIDC client secret, the DSN's password: `redact.secret_values`) replaced by *** first, so a
secret in an exception's text (a URL with its password, a client's arguments) never reaches the log. That is
every line of kvpipe's commands, and of the workers with JSON; a worker's text lines are Faust's formatter's.
"""
from __future__ import annotations

import json
import logging
import sys
from typing import Any, TextIO

from kvpipe.schemas.redact import mask_secrets

LOG_FORMATS = ("text", "json")
LOG_FORMAT_ENV = "KVPIPE_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# JSON: the record attributes kept, and their names in the line
JSON_FIELDS = "%(levelname)s %(name)s %(message)s"
JSON_NAMES = {"levelname": "level", "name": "logger", "exc_info": "exception", "stack_info": "stack"}


def librdkafka_logging(log_format: str) -> dict[str, Any]:
    """confluent-kafka client configuration for `log_format`: with JSON, librdkafka's own log lines (raw text on
    stderr otherwise, `%3|...|FAIL|...`) go through Python's logging as `kvpipe.librdkafka` records, so every line
    stays one JSON object; with text, nothing (librdkafka's lines as before). The client must be polled for them,
    as kvpipe's producers are."""
    return {"logger": logging.getLogger("kvpipe.librdkafka")} if log_format == "json" else {}


class RedactingText(logging.Formatter):
    """The text format, secrets masked."""

    def __init__(self, secrets: tuple[str, ...] = (), fmt: str = TEXT_FORMAT) -> None:
        super().__init__(fmt)
        self.secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        return mask_secrets(super().format(record), self.secrets)


def json_formatter(secrets: tuple[str, ...] = ()) -> logging.Formatter:
    """One JSON object per record (module doc), secrets masked: raw and as JSON escapes them (a secret with a
    quote or a non-ASCII letter is written escaped)."""
    from pythonjsonlogger.json import JsonFormatter

    variants = tuple(dict.fromkeys([*secrets, *(json.dumps(s)[1:-1] for s in secrets)]))

    class RedactingJson(JsonFormatter):
        def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
            return {"time": log_data.pop("time"), **log_data}  # the time first, as in a text line

        def serialize_log_record(self, log_data: dict[str, Any]) -> str:
            return mask_secrets(super().serialize_log_record(log_data), variants)

    return RedactingJson(JSON_FIELDS, rename_fields=JSON_NAMES, timestamp="time")


def formatter(log_format: str, secrets: tuple[str, ...] = ()) -> logging.Formatter:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: expected one of {', '.join(LOG_FORMATS)}")
    return json_formatter(secrets) if log_format == "json" else RedactingText(secrets)


def known_secrets() -> tuple[str, ...]:
    """The secret values of this process's settings; none when the settings do not load (the command that needs
    them says why, through the logging set up here)."""
    from kvpipe.schemas.settings import SettingsError, load_settings
    from kvpipe.schemas.redact import secret_values

    try:
        return secret_values(load_settings())
    except SettingsError:
        return ()


class _Handler(logging.StreamHandler):
    """The stderr handler `configure` installs (a class of its own, so a second call finds and replaces it)."""


def configure(level: str, log_format: str, stream: TextIO | None = None) -> None:
    """The root logger and `kvpipe`'s at `level`, one handler on `stream` (stderr) writing `log_format`. As
    `logging.basicConfig` does, a root logger that has handlers of someone else's (a test runner's) keeps them
    and gets none of ours; one of ours from an earlier call is replaced."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    if not root.handlers:
        handler = _Handler(sys.stderr if stream is None else stream)
        handler.setFormatter(formatter(log_format, known_secrets()))
        root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("kvpipe").setLevel(level.upper())


def faust_logging_config(level: str, log_format: str) -> dict[str, Any] | None:
    """A Faust worker's `logging_config` (dictConfig, applied when the worker starts) for `log_format`: JSON lines
    on the stream Faust logs to (standard output), secrets masked; None for text, Faust's own colored lines."""
    if log_format != "json":
        return None
    return {
        "version": 1,
        "disable_existing_loggers": False,  # kvpipe's and aiokafka's loggers exist by then: keep them
        "formatters": {"json": {"()": json_formatter, "secrets": known_secrets()}},
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "json", "level": level.upper(),
                                 "stream": "ext://sys.stdout"}},
        "root": {"level": level.upper(), "handlers": ["default"]},
    }
