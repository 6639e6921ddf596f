"""`--log-format json` (kvpipe.schemas.logsetup): one JSON object per line with time, level, logger, message and
the exception's text; the settings' secrets masked in either format; the flag on every command that takes
`--log-level`, exported to the processes a command starts; Faust's worker configured the same way."""
from __future__ import annotations

import io
import json
import logging
import logging.config
import os
from datetime import datetime

import click
import pytest

from kvpipe.schemas import cliopts, logsetup
from kvpipe.schemas.redact import secret_values
from kvpipe.schemas.settings import load_settings

TOKEN = "tok-never-logged-7731"


def _record(formatter: logging.Formatter, msg: str, *args: object, exc: BaseException | None = None) -> str:
    logger = logging.getLogger("kvpipe.test.logformat")
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 1, msg, args, exc_info)
    return formatter.format(record)


def test_a_json_line_carries_time_level_logger_message_and_the_exception_text():
    try:
        raise ValueError("bad block size 7")
    except ValueError as exc:
        line = _record(logsetup.formatter("json"), "node %s: %s", "n1", "refused", exc=exc)
    assert "\n" not in line
    data = json.loads(line)
    assert list(data)[:4] == ["time", "level", "logger", "message"]
    assert (data["level"], data["logger"], data["message"]) == ("ERROR", "kvpipe.test.logformat", "node n1: refused")
    assert datetime.fromisoformat(data["time"]).utcoffset() is not None  # ISO 8601 with its zone (UTC)
    assert "Traceback" in data["exception"] and "ValueError: bad block size 7" in data["exception"]


def test_secrets_are_masked_in_both_formats_even_inside_exceptions_and_escaped():
    odd = 'pa"ss\\wörd'  # written escaped by JSON: masked in that form too
    secrets = (TOKEN, odd)
    exc = ConnectionError(f"http://u:{TOKEN}@h:1/ failed")
    for fmt in logsetup.LOG_FORMATS:
        line = _record(logsetup.formatter(fmt, secrets), "token %s, password %s", TOKEN, odd, exc=exc)
        assert TOKEN not in line and "ss\\\\w" not in line and "pa\\\"ss" not in line, (fmt, line)
        assert line.count("***") >= 3, line
    assert json.loads(_record(logsetup.formatter("json", secrets), "%s", odd))["message"] == "***"


def test_the_settings_secrets_are_what_is_masked(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file-token\n")
    settings = load_settings(env={"KVPIPE_API_TOKEN_FILE": str(token_file), "KVPIPE_KAFKA_SASL_PASSWORD": "sasl-pw-1",
                                  "KVPIPE_CLICKHOUSE_DSN": "http://alice:dsn-pw-22@ch:8123/db", "KVPIPE_KAFKA_SASL_USERNAME": "x",
                                  "KVPIPE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"})
    assert set(secret_values(settings)) == {"from-a-file-token", "sasl-pw-1", "dsn-pw-22"}
    assert secret_values(load_settings(env={"KVPIPE_API_TOKEN": "abc"})) == ()  # too short to mask in free text


def test_configure_writes_the_format_asked_for_and_keeps_a_test_runners_handlers(monkeypatch):
    root = logging.getLogger()
    saved = root.handlers[:], root.level, logging.getLogger("kvpipe").level
    monkeypatch.setenv("KVPIPE_API_TOKEN", TOKEN)
    stream = io.StringIO()
    try:
        root.handlers = []
        logsetup.configure("info", "json", stream)
        logsetup.configure("info", "json", stream)  # a second call replaces its handler, adds none
        assert len(root.handlers) == 1
        logging.getLogger("kvpipe.x").info("using %s", TOKEN)
        logging.getLogger("kvpipe.x").debug("not at info")
        (line,) = stream.getvalue().splitlines()
        assert json.loads(line)["message"] == "using ***"
        other = logging.NullHandler()
        root.handlers = [other]
        logsetup.configure("debug", "text", stream)
        assert root.handlers == [other] and logging.getLogger("kvpipe").level == logging.DEBUG
        with pytest.raises(ValueError, match="yaml"):
            logsetup.formatter("yaml")
    finally:
        root.handlers, _, _ = saved
        root.setLevel(saved[1])
        logging.getLogger("kvpipe").setLevel(saved[2])


def test_the_faust_worker_gets_json_lines_through_its_dict_config(monkeypatch, capsys):
    monkeypatch.setenv("KVPIPE_API_TOKEN", TOKEN)
    assert logsetup.faust_logging_config("info", "text") is None  # Faust's own lines, as before
    config = logsetup.faust_logging_config("info", "json")
    assert config is not None
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logging.config.dictConfig(config)  # what mode's Worker does with it at start
        logging.getLogger("faust.worker").info("[^Worker]: Starting... %s", TOKEN)
    finally:
        root.handlers = saved[0]
        root.setLevel(saved[1])
    data = json.loads(capsys.readouterr().out.strip())
    assert (data["logger"], data["message"]) == ("faust.worker", "[^Worker]: Starting... ***")


@click.command("fmt", cls=cliopts.Command)
@cliopts.log_level_option()
def _fmt_command(log_level: str) -> None:
    pass


def test_the_flag_is_exported_and_read_back_by_the_setting(monkeypatch):
    monkeypatch.setenv("KVPIPE_LOG_FORMAT", "text")  # so the export below is undone after the test
    assert cliopts.log_format() == "text"
    assert cliopts.parse(_fmt_command, ["--log-format", "JSON"]) == {"log_level": "warning"}  # no new parameter
    assert os.environ["KVPIPE_LOG_FORMAT"] == "json" and cliopts.log_format() == "json"
    monkeypatch.setenv("KVPIPE_LOG_FORMAT", "xml")
    with pytest.raises(SystemExit, match="KVPIPE_LOG_FORMAT"):
        cliopts.log_format()
    with pytest.raises(click.BadParameter, match="xml"):
        cliopts.parse(_fmt_command, ["--log-format", "xml"])
