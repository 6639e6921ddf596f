"""One set of CLI conventions across `kvpipe` subcommands: broker, log level and JSON flags, one
group grammar, redacted secrets, a progress display that stays plain in pipes, one HTTP client."""
from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import click
import pytest

from kvpipe.schemas import cliopts
from kvpipe.cli import main
from kvpipe.schemas.envelope import GroupSpec
from kvpipe.schemas.groupspec import GroupSpecError, format_groups, parse_groups

REPO = Path(__file__).resolve().parents[2]
KAFKA = "--bootstrap-server"
LOG = ["-l", "--log-level", "--loglevel", "--log-format"]  # --log-format beside every --log-level
OUTPUT = ["-o", "--output", "--json"]  # every command that prints data; --json is the older spelling
FAUST_APP = ["--web-bind", "--web-host", "--datadir", "--state-dir", "--web-port"]

# subcommand argv → the flags its --help must list
EXPECTED = {
    ("infra", "up"): [KAFKA, *LOG],
    ("infra", "status"): [KAFKA, *LOG, *OUTPUT],
    ("infra", "down"): [KAFKA, *LOG],
    ("node",): [KAFKA, *LOG, *OUTPUT, "--summary-json", "--groups"],
    ("bridge",): [KAFKA, *LOG, "--groups", "--bootstrap"],
    ("processor",): [KAFKA, *LOG, *FAUST_APP],
    ("analytics",): [KAFKA, *LOG, *FAUST_APP],
    ("demo",): [KAFKA, *LOG],
    ("route",): [*LOG, *OUTPUT],
    ("nodes",): [*LOG, *OUTPUT, "--state", "--limit"],
    ("stats",): [*LOG, *OUTPUT, "--analytics"],
    ("sql",): [*LOG, *OUTPUT],
    ("plan",): [*LOG, *OUTPUT],
    ("report",): LOG,
    ("inspect",): [*LOG, *OUTPUT],
}


def _help(argv: list[str], capsys) -> str:
    assert main([*argv, "--help"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", sorted(EXPECTED))
def test_help_lists_the_shared_flags(argv, capsys):
    text = _help(list(argv), capsys)
    for flag in EXPECTED[argv]:
        assert re.search(re.escape(flag) + r"(?![\w-])", text), (argv, flag)


def test_bench_help_lists_the_flags_every_benchmark_takes(capsys):
    assert main(["bench", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--json", "--output", KAFKA, "--log-level", "--loglevel", "--log-format"):
        assert flag in text


def test_bench_takes_out_only_the_shared_flags():
    from kvpipe.bench import split_common

    rest, common = split_common(["--nodes", "3", "--json", KAFKA, "h:1", "--log-level", "INFO", "--jitter", "2",
                                 "--extra=-0.5", "--help"])
    assert rest == ["--nodes", "3", "--jitter", "2", "--extra=-0.5", "--help"]  # --jitter is not abbreviated --json
    assert (common["output"], common["bootstrap_server"], common["log_level"]) == ("json", "h:1", "info")
    rest, common = split_common(["-o", "json", "--seed", "1", "-l", "debug"])
    assert rest == ["--seed", "1"] and (common["output"], common["log_level"]) == ("json", "debug")
    assert split_common(["--seed", "1"])[1]["output"] == "table"


def test_bench_hands_help_to_the_benchmark(capsys):
    assert main(["bench", "faults", "--help"]) == 0
    out = capsys.readouterr().out
    assert "kvpipe bench faults" in out and "--outage-s" in out  # the benchmark's own flags
    assert main(["bench", "faults", "--only", "nothing"]) == 2  # its usage error, with its exit code
    assert "unknown probes" in capsys.readouterr().err


# benchmark → flags BENCHMARKS.md and RELIABILITY.md run it with (its help must list them)
BENCH_FLAGS = {
    "ingest": ["--envelopes", "--events", "--nodes", "--partitions", "--delivery", "--probes", "--paced-rate",
               "--paced-s", "--probe-every-ms", "--keep-topics"],
    "analytics": ["--envelopes", "--events", "--nodes", "--partitions", "--probes", "--queries-rows",
                  "--capacity-events", "--report-steps", "--capacity-only"],
    "route": ["--nodes", "--requests", "--warmup", "--documents", "--prompt-tokens", "--per-node", "--configs",
              "--partitions", "--seed", "--no-dynamo", "--in-process-only", "--keep-topics", "--snapshots"],
    "fuzz": ["--inputs", "--seed", "--node-flood", "--oversize-live"],
    "route-load": ["--connections", "--duration-s", "--ingest-rate", "--probes", "--processor-env", "--share",
                   "--delay-ms", "--form", "--cpus", "--replicas"],
}


@pytest.mark.parametrize("name", sorted(BENCH_FLAGS))
def test_each_benchmark_lists_its_flags_and_refuses_unknown_ones_with_2(name, capsys):
    assert main(["bench", name, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"kvpipe bench {name}" in out
    for flag in BENCH_FLAGS[name]:
        assert re.search(re.escape(flag) + r"(?![\w-])", out), (name, flag)
    assert main(["bench", name, "--no-such-flag"]) == 2  # refused before anything is measured
    assert "No such option: --no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["route", "--configs", "3"], "--configs"),  # one or two hash configurations
    (["ingest", "--delivery", "message,stream"], "a comma-separated list of message, batch; got 'message,stream'"),
    (["analytics", "--envelopes", "many"], "--envelopes"),
])
def test_benchmark_values_out_of_range_are_usage_errors(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_ingest_delivery_is_the_list_of_modes_in_order():
    from kvpipe.bench.ingest import ingest_bench

    assert cliopts.parse(ingest_bench, [])["delivery"] == ["message", "batch"]
    assert cliopts.parse(ingest_bench, ["--delivery", " batch , message"])["delivery"] == ["batch", "message"]


def test_bench_fuzz_runs_from_the_command_line_and_prints_one_json_object(capsys):
    assert main(["bench", "fuzz", "--inputs", "300", "--seed", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "fuzz" and result["inputs"] == 300 and result["crashes"] == 0
    assert result["value"] > 0 and result["baseline"] > 0


def test_kvpipe_code_parses_flags_with_click_only():
    from kvpipe import FOLDERS

    users = [str(path.relative_to(REPO)) for folder in ("kvpipe", *FOLDERS) for path in (REPO / folder).rglob("*.py")
             if re.search(r"^\s*(import argparse|from argparse import)", path.read_text(), re.M)]
    assert users == []


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("kvpipe ")


@pytest.fixture(autouse=True)
def _environment_restored():
    """--bootstrap-server exports KVPIPE_KAFKA_BOOTSTRAP (for the command's children): keep it out of
    the tests that run after these in the same process."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# --- --bootstrap-server ------------------------------------------------------------------------------------------


def test_bootstrap_server_is_exported_for_settings_and_children(monkeypatch):
    monkeypatch.delenv("KVPIPE_KAFKA_BOOTSTRAP", raising=False)
    from kvpipe.producer.bridge.cli import bridge
    from kvpipe.schemas.settings import load_settings

    params = cliopts.parse(bridge, ["--zmq", "tcp://x:1", "--node-id", "n", KAFKA, "b1:9092,b2:9092"])
    assert cliopts.apply_bootstrap(params["bootstrap_server"]) == "b1:9092,b2:9092"
    assert os.environ["KVPIPE_KAFKA_BOOTSTRAP"] == "b1:9092,b2:9092"
    assert load_settings().bootstrap() == "b1:9092,b2:9092"


def test_the_bridge_bootstrap_flag_is_a_deprecated_alias(capsys):
    from kvpipe.producer.bridge.cli import bridge

    params = cliopts.parse(bridge, ["--zmq", "tcp://x:1", "--node-id", "n", "--bootstrap", "old:9092"])
    assert params["bootstrap_server"] == "old:9092"
    assert "--bootstrap is deprecated; use --bootstrap-server" in capsys.readouterr().err


def _kvpipe(*argv: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_")}
    base.update(PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-m", "kvpipe", *argv], cwd=REPO, env=base, capture_output=True,
                          text=True, timeout=timeout)


def test_infra_status_uses_the_flag_not_the_local_broker(tmp_path):
    # nothing listens on port 1: an external cluster that does not answer, not the local broker's state
    r = _kvpipe("infra", "status", KAFKA, "127.0.0.1:1", KVPIPE_STATE_DIR=str(tmp_path))
    assert r.returncode == 3, r.stderr
    assert "external cluster, bootstrap 127.0.0.1:1" in r.stdout and "does not answer" in r.stdout


# --- --log-level / KVPIPE_LOG_LEVEL ------------------------------------------------------------------------------


@click.command("levels", cls=cliopts.Command)
@cliopts.log_level_option(default="info")
def _levels_command(log_level: str) -> None:
    pass


def _levels(argv: list[str]) -> str:
    """The level a command with `--log-level` (default info; `-l`, Faust's `--loglevel`) receives."""
    return cliopts.parse(_levels_command, argv)["log_level"]


def test_log_level_flag_env_and_default(monkeypatch, capsys):
    monkeypatch.delenv("KVPIPE_LOG_LEVEL", raising=False)
    assert _levels([]) == "info"
    monkeypatch.setenv("KVPIPE_LOG_LEVEL", "ERROR")
    assert _levels([]) == "error"
    assert _levels(["--log-level", "DEBUG"]) == "debug"  # the flag wins
    assert capsys.readouterr().err == ""
    assert _levels(["--loglevel", "warning"]) == "warning"  # Faust's spelling
    assert _levels(["-l", "critical"]) == "critical"
    assert _levels(["--loglevel", "warning", "--log-level", "debug"]) == "debug"  # one option: the last one given
    monkeypatch.setenv("KVPIPE_LOG_LEVEL", "loud")
    with pytest.raises(SystemExit, match="KVPIPE_LOG_LEVEL"):
        _levels([])
    with pytest.raises(click.BadParameter, match="loud"):
        _levels(["--log-level", "loud"])


def test_configure_logging_sets_kvpipe_loggers(monkeypatch):
    monkeypatch.setenv("KVPIPE_LOG_LEVEL", "debug")
    root = logging.getLogger()
    before = (root.level, logging.getLogger("kvpipe").level)
    try:
        assert cliopts.configure_logging(_levels([])) == "debug"
        assert logging.getLogger("kvpipe.bridge").getEffectiveLevel() == logging.DEBUG
    finally:
        root.setLevel(before[0])
        logging.getLogger("kvpipe").setLevel(before[1])


# --- one group grammar -------------------------------------------------------------------------------------------


def test_group_grammar_short_and_vllm_names():
    want = [GroupSpec(0, "full_attention", 16), GroupSpec(1, "sliding_window", 16, 128),
            GroupSpec(2, "mamba", 16, mamba_cache_mode="align"),
            GroupSpec(3, "chunked_local_attention", 16, attention_chunk_size=512)]
    assert parse_groups("full_attention:16,sliding_window:16:128,mamba:16,chunked_local_attention:16:512") == want
    assert parse_groups("full:16, swa:16:128 ,mamba:16,local:16:512") == want
    assert parse_groups(format_groups(want)) == want


@pytest.mark.parametrize("bad", ["", "full", "attn:16", "full:x", "full:0", "sliding_window:16", "full:16:8",
                                 "mamba:16:4", "0:full_attention", "full:16,0:mamba:16"])
def test_group_grammar_errors_name_the_item(bad):
    with pytest.raises(GroupSpecError):
        parse_groups(bad)


def test_the_older_indexed_form_is_read_and_reported():
    heard: list[str] = []
    specs = parse_groups("0:full_attention:16,1:sliding_window:16:4096", on_deprecated=heard.append)
    assert specs == parse_groups("full_attention:16,sliding_window:16:4096")
    assert heard == ["0:full_attention:16", "1:sliding_window:16:4096"]
    assert parse_groups("full:16", on_deprecated=heard.append) and len(heard) == 2  # the new form: silent


def test_node_and_bridge_read_the_same_groups(capsys):
    from kvpipe.gpu.node.cli import parse_groups as node_groups
    from kvpipe.gpu.specs import FullAttention, SlidingWindow
    from kvpipe.producer.bridge.cli import _warn_legacy_group
    from kvpipe.producer.bridge.specs import parse_group_spec

    assert node_groups("full_attention:16,swa:16:64") == (FullAttention(16), SlidingWindow(16, 64))
    assert capsys.readouterr().err == ""
    assert node_groups("0:full:16,1:sliding_window:16:64") == (FullAttention(16), SlidingWindow(16, 64))
    assert "deprecated" in capsys.readouterr().err
    legacy = parse_group_spec("1:sliding_window:16:64", on_deprecated=_warn_legacy_group)
    assert legacy == parse_groups("full:16,sliding_window:16:64")[1]
    err = capsys.readouterr().err
    assert "deprecated" in err and "--groups" in err


def test_bridge_groups_flag_declares_the_specs(monkeypatch, capsys):
    from kvpipe.producer.bridge import cli

    seen: dict = {}

    def capture(config, args, declared, hash_config, model):  # stands in for the Kafka side only
        seen["declared"] = declared
        return object()

    monkeypatch.setattr(cli, "_forwarding_bridge", capture)
    monkeypatch.setattr(cli, "_serve", lambda bridge, args: 0)
    argv = ["--zmq", "tcp://127.0.0.1:1", "--node-id", "n"]
    assert cli.main([*argv, "--groups", "full:16,sliding_window:16:64"]) == 0
    assert seen["declared"] == parse_groups("full_attention:16,swa:16:64")
    assert cli.main([*argv, "--group-spec", "0:full_attention:16", "--group-spec", "1:sliding_window:16:64"]) == 0
    assert seen["declared"] == parse_groups("full_attention:16,swa:16:64")
    assert "deprecated" in capsys.readouterr().err
    assert cli.main([*argv, "--groups", "full:16,mamba:16:4"]) == 2  # mamba takes no window: refused


# --- secrets -----------------------------------------------------------------------------------------------------


def test_store_errors_never_print_the_password():
    dsn = "http://alice:s3cret-pw@127.0.0.1:1/db"
    for argv in (["sql", "SELECT 1"], ["plan"]):
        r = _kvpipe(*argv, KVPIPE_CLICKHOUSE_DSN=dsn, timeout=90)
        assert r.returncode == 1
        assert "s3cret-pw" not in r.stdout + r.stderr, argv
        assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_redact_text_covers_quoted_urls():
    from kvpipe.processors.analytics.query import redact_text

    dsn = "https://bob:pw123@ch.example:8443/kv?password=pw123"
    text = f"cannot connect to {dsn} (https://bob:pw123@ch.example:8443)"
    assert "pw123" not in redact_text(text, dsn)
    assert "pw123" not in redact_text("GET http://u:pw123@h/ failed")


# --- progress ----------------------------------------------------------------------------------------------------


class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_progress_in_a_pipe_is_plain_lines():
    from kvpipe.progress import Progress

    out = _Pipe()
    with Progress("work", stream=out) as bar:
        for i in range(101):
            bar.update(i / 100, f"item {i}")
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 11 and lines[-1].startswith("work: 100.0%")


def test_progress_on_a_terminal_draws_a_rich_bar():
    from kvpipe.progress import Progress

    out = io.StringIO()
    with Progress("work", stream=out, terminal=True) as bar:
        bar.update(0.5, "half")
    assert "\x1b" in out.getvalue() and "work" in out.getvalue()  # a live display: control codes


# --- one HTTP client ---------------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/metrics":
            self._send(200, b"kvpipe_up 1\n", "text/plain")
        elif self.path == "/auth":
            self._send(200, json.dumps({"auth": self.headers.get("Authorization")}).encode(), "application/json")
        else:
            self._send(404, b'{"error": "not found", "detail": "no such page"}', "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send(200, json.dumps({"echo": body}).encode(), "application/json")


def test_one_http_helper(monkeypatch):
    from kvpipe.processors.core.remote import HttpStatusError, get_json, ok_json, post_json

    monkeypatch.setenv("KVPIPE_API_TOKEN", "tok-123")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert get_json(base + "/metrics") == (200, "kvpipe_up 1\n")
        assert ok_json(base + "/auth") == {"auth": "Bearer tok-123"}  # the settings' token by default
        assert post_json(base + "/x", {"a": 1}) == (200, {"echo": {"a": 1}})
        assert get_json(base + "/nope")[0] == 404
        with pytest.raises(HttpStatusError, match="404: no such page"):
            ok_json(base + "/nope")
    finally:
        server.shutdown()
    with pytest.raises(OSError):
        get_json(base + "/metrics", timeout=2)


def test_node_json_and_its_older_spelling(capsys):
    from kvpipe.gpu.node.cli import main as node

    for flag in ("--json", "--summary-json"):
        assert node(["--steps", "3", "--no-publish", flag, "--layers", "1", "--gpu-blocks", "64",
                     "--cpu-chunks", "0"]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 3


# --- deprecated spellings say so ---------------------------------------------------------------------------------


def test_fausts_loglevel_spellings_are_the_same_option_without_a_warning(capsys):
    assert _levels(["--loglevel", "error"]) == "error"
    assert _levels(["-l", "DEBUG"]) == "debug"
    assert capsys.readouterr().err == ""


def test_the_summary_json_spelling_warns_naming_the_replacement(capsys):
    from kvpipe.gpu.node.cli import main as node

    argv = ["--steps", "2", "--no-publish", "--layers", "1", "--gpu-blocks", "64", "--cpu-chunks", "0"]
    assert node([*argv, "--summary-json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 2
    assert err.count("warning: --summary-json is deprecated; use --json") == 1
    assert node([*argv, "--json"]) == 0
    assert "deprecated" not in capsys.readouterr().err


def test_the_processor_takes_fausts_spellings_as_a_start_script_gives_them():
    # a fresh process, as a start script runs it; refused at the exposure check, before any worker starts:
    # --web-bind is the address it would have bound, and -l/--loglevel warn of nothing
    r = _kvpipe("processor", "-l", "info", "--web-bind", "0.0.0.0")
    assert r.returncode == 2 and "refusing to serve HTTP on 0.0.0.0" in r.stderr, r.stderr
    assert "deprecated" not in r.stderr
