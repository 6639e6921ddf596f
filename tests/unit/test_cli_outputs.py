"""One `-o/--output` on every command that prints data, Faust's spellings on the apps, the shared options
where the help lists them, `kvpipe nodes` / `kvpipe stats` against a stand-in app, and the renamed
`kafka_local_brokers` setting. (Against the running apps: tests/integration/test_cli_route_sql.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import click
import msgspec
import pytest

from kvpipe.cli import COMMANDS, main
from kvpipe.processors.routing.answers import NodeGroup, NodeLoad, NodeRow, NodesPage
from kvpipe.schemas import cliopts
from kvpipe.schemas.codec import encode_vllm_batch
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvpipe.schemas.settings import load_settings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _environment_restored():
    """Commands export flags into the environment (for their children): keep them out of later tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# --- -o/--output and --json --------------------------------------------------------------------------------------


@click.command("printer", cls=cliopts.Command)
@cliopts.output_option(json_aliases=("--as-json",))
def _printer(output: str) -> str:
    return output


@pytest.mark.parametrize("argv, output", [([], "table"), (["-o", "json"], "json"), (["--output=table"], "table"),
                                          (["--json"], "json"), (["--json", "-o", "json"], "json")])
def test_output_and_its_older_json_spelling_resolve_to_one_format(argv, output, capsys):
    assert cliopts.parse(_printer, argv)["output"] == output
    assert "deprecated" not in capsys.readouterr().err  # --json is a plain alias


def test_output_and_json_that_disagree_are_a_usage_error(capsys):
    assert cliopts.run(_printer, ["--json", "-o", "table"], "printer") == 2
    assert "-o/--output table and --json disagree" in capsys.readouterr().err
    assert cliopts.parse(_printer, ["--as-json"])["output"] == "json"  # a deprecated alias of --json feeds it too
    assert "--as-json is deprecated; use --json" in capsys.readouterr().err


def test_plan_and_route_answer_a_disagreement_before_asking_anything(capsys):
    for argv in (["plan", "--json", "-o", "table"], ["route", "--hashes", "1", "-o", "table", "--json"],
                 ["nodes", "--json", "-o", "table"], ["infra", "status", "-o", "table", "--json"]):
        assert main(argv) == 2, argv
        assert "disagree" in capsys.readouterr().err


EVENTS = [BlockStored([1, 2, 3, 4], None, list(range(64)), 16, None, "GPU", None, group_idx=0),
          BlockRemoved([2], "CPU", group_idx=1), AllBlocksCleared()]


def _inspect(tmp_path: Path, capsys, *args: str) -> tuple[int, str]:
    from kvpipe.producer.inspect import main as inspect

    path = tmp_path / "two.bin"
    path.write_bytes(encode_vllm_batch(EVENTS, 1.5, dp_rank=2) + encode_vllm_batch(EVENTS[:1], 2.25))
    code = inspect([str(path), *args])
    return code, capsys.readouterr().out


def test_inspect_streams_json_lines_by_default_or_one_array_or_a_table_of_events(tmp_path, capsys):
    code, lines = _inspect(tmp_path, capsys)
    objects = [json.loads(line) for line in lines.splitlines()]
    assert code == 0 and len(objects) == 2 and _inspect(tmp_path, capsys, "--json")[1] == lines
    code, array = _inspect(tmp_path, capsys, "-o", "json")
    assert code == 0 and json.loads(array) == objects  # the same objects, one document
    code, table = _inspect(tmp_path, capsys, "-o", "table")
    rows = [line.split() for line in table.splitlines()]
    assert rows[0][:6] == ["where", "kind", "node", "ts", "rank", "event"]
    # one line per event: three in the first batch, one in the second (at its byte offset)
    assert [r[0] for r in rows[1:]] == ["@0", "@0", "@0", f"@{objects[1]['offset']}"]
    assert rows[1][1:] == ["vllm_batch", "1.500", "2", "BlockStored", "0", "GPU", "4", "1", "2", "…", "4"]
    assert rows[2][-5:] == ["BlockRemoved", "1", "CPU", "1", "2"] and rows[3][-1] == "AllBlocksCleared"


def test_node_prints_its_summary_as_a_table_or_json(capsys):
    from kvpipe.gpu.node.cli import main as node

    argv = ["--steps", "2", "--no-publish", "--layers", "1", "--gpu-blocks", "64", "--cpu-chunks", "0"]
    assert node(argv) == 0
    table = capsys.readouterr().out
    cells = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in table.splitlines() if "|" in line}
    assert cells["steps"] == "2" and cells["requests.finished"] == "0" and "events.total" in cells
    assert node([*argv, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 2


def _kvpipe(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_")}
    base.update(PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-m", "kvpipe", *argv], cwd=REPO, env=base, capture_output=True,
                          text=True, timeout=60)


def test_infra_status_as_json_keeps_its_exit_status(tmp_path):
    r = _kvpipe("infra", "status", "-o", "json", "--bootstrap-server", "127.0.0.1:1", KVPIPE_STATE_DIR=str(tmp_path))
    assert r.returncode == 3, r.stderr
    assert json.loads(r.stdout) == {"kafka": "external", "bootstrap": "127.0.0.1:1", "running": True,
                                    "answers": False, "topics": None}
    r = _kvpipe("infra", "status", "--json", KVPIPE_STATE_DIR=str(tmp_path / "never"))  # a local broker never started
    report = json.loads(r.stdout)
    assert r.returncode == 3 and (report["kafka"], report["running"], report["pid"]) == ("local", False, None)


# --- Faust's spellings, one meaning each -------------------------------------------------------------------------


@pytest.mark.parametrize("app, port_variable", [("processor", "KVPIPE_WEB_PORT"),
                                                ("analytics", "KVPIPE_ANALYTICS_WEB_PORT")])
def test_each_app_maps_fausts_and_kvpipes_spellings_to_one_variable(app, port_variable, monkeypatch, tmp_path):
    from kvpipe.processors.analytics import cli as analytics_cli
    from kvpipe.processors.routing import cli as routing_cli

    module = routing_cli if app == "processor" else analytics_cli
    seen: list[dict] = []
    monkeypatch.setattr(module, "worker_settings", lambda prog, flags, insecure: seen.append(dict(flags)))
    for argv in (["--web-bind", "10.0.0.1", "--datadir", str(tmp_path)],
                 ["--web-host", "10.0.0.1", "--state-dir", str(tmp_path)]):
        assert main([app, *argv, "--web-port", "7001", "-l", "info"]) == 2  # worker_settings said no: exit 2
    for flags in seen:
        given = {k: v for k, v in flags.items() if v is not None}
        assert given == {"KVPIPE_WEB_HOST": "10.0.0.1", "KVPIPE_STATE_DIR": str(tmp_path), port_variable: 7001}


def _all_commands() -> list[list[str]]:
    from kvpipe.infra import cli as infra_cli

    return [["infra", name] for name in infra_cli.infra.commands] + [[name] for name in COMMANDS
                                                                     if name not in ("infra", "bench")]


def test_every_command_that_lists_the_shared_options_takes_the_log_level(capsys):
    listed = []
    for argv in _all_commands():
        assert main([*argv, "--help"]) == 0, argv
        text = capsys.readouterr().out
        if cliopts.SHARED_HEADING in text:
            listed.append(argv[-1])
            shared = text.split(cliopts.SHARED_HEADING)[1]
            assert "-l, --log-level, --loglevel LEVEL" in shared, argv
    assert {"up", "status", "down", "route", "nodes", "stats", "sql", "plan", "report", "inspect"} <= set(listed)


# --- kvpipe nodes / kvpipe stats against a stand-in routing app -----------------------------------------------------

TOKEN = "tok-nodes"
IDS = [f"node-{i:02}" for i in range(7)]


def _row(node_id: str) -> NodeRow:
    state = "suspect" if node_id == "node-03" else "healthy"
    return NodeRow(node_id=node_id, epoch=1, seq=9, model="m", dp_rank=0, partition=int(node_id[-1]) % 2,
                   state=state, last_seen=1.0, silent_s=0.5, expired=False, suspect=state == "suspect",
                   suspect_reason=None, partial=False, partial_since=None, clock_skew_s=0.0,
                   load=NodeLoad(running=2, waiting=1, kv_usage=0.25),
                   groups=[NodeGroup(0, "full_attention", 16), NodeGroup(1, "sliding_window", 16, 128)],
                   blocks={"0/GPU": 3, "1/GPU": 2}, counters={})


class _App(BaseHTTPRequestHandler):
    asked: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._send(401, {"error": "unauthorized", "detail": "a bearer token is required"})
        elif url.path == "/nodes":
            type(self).asked.append(query)
            chosen = [i for i in IDS if i > query.get("after", "") and (
                "state" not in query or _row(i).state == query["state"])]
            page, limit = chosen[:int(query["limit"])], int(query["limit"])
            more = len(chosen) > limit
            self._send(200, NodesPage(nodes=[_row(i) for i in page][:3], partial=page[:1] == ["node-00"],
                                      next_after=(page[:3][-1] if more or len(page) > 3 else None),
                                      missing_partitions=[1] if page[:1] == ["node-00"] else []))
        else:
            self._send(200, {"processor_id": "an older app"})  # /stats in a shape this kvpipe does not know

    def _send(self, status: int, body) -> None:
        data = msgspec.json.encode(body)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def app_url(monkeypatch):
    """A routing app that answers at most three rows a page (so the command must follow next_after)."""
    monkeypatch.setenv("KVPIPE_API_TOKEN", TOKEN)
    _App.asked = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _App)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_nodes_follows_next_after_to_the_last_page_with_the_settings_token(app_url, capsys):
    assert main(["nodes", "--url", app_url, "-o", "json"]) == 0
    page = msgspec.json.decode(capsys.readouterr().out, type=NodesPage)
    assert [n.node_id for n in page.nodes] == IDS and page.next_after is None
    assert page.partial and page.missing_partitions == [1]  # a partial page makes the whole answer partial
    assert [q.get("after") for q in _App.asked] == [None, "node-02", "node-05"]


def test_nodes_limit_and_state_filter_and_the_table(app_url, capsys):
    assert main(["nodes", "--url", app_url, "--limit", "4", "--json"]) == 0
    page = json.loads(capsys.readouterr().out)
    assert [n["node_id"] for n in page["nodes"]] == IDS[:4] and page["next_after"] == "node-03"
    assert [q["limit"] for q in _App.asked] == ["4", "1"]  # never asks for more than it still needs
    assert main(["nodes", "--url", app_url, "--state", "suspect"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [c.strip() for c in lines[3].strip("|").split("|")][:2] == ["node-03", "suspect"]
    assert "full_attention:16,sliding_window:16:128" in lines[3] and lines[-1] == "(1 nodes)"
    assert _App.asked[-1]["state"] == "suspect"


def test_nodes_and_stats_say_what_went_wrong(app_url, monkeypatch, capsys):
    assert main(["stats", "--url", app_url]) == 1
    assert "another kvpipe version" in capsys.readouterr().err
    monkeypatch.setenv("KVPIPE_API_TOKEN", "wrong")
    assert main(["nodes", "--url", app_url]) == 1
    assert "HTTP 401" in capsys.readouterr().err
    assert main(["nodes", "--url", "http://127.0.0.1:1"]) == 1
    assert "start one with `kvpipe processor`" in capsys.readouterr().err
    assert main(["stats", "--analytics", "--url", "http://127.0.0.1:1"]) == 1
    assert "start one with `kvpipe analytics`" in capsys.readouterr().err


# --- kafka_local_brokers, once kafka_brokers ------------------------------------------------------------------------


def test_the_local_broker_count_has_an_unambiguous_name_and_the_old_one_still_works(tmp_path):
    assert load_settings(env={"KVPIPE_KAFKA_LOCAL_BROKERS": "3"}).kafka_local_brokers == 3
    with pytest.warns(FutureWarning, match="KVPIPE_KAFKA_BROKERS is deprecated; use KVPIPE_KAFKA_LOCAL_BROKERS"):
        assert load_settings(env={"KVPIPE_KAFKA_BROKERS": "3"}).kafka_local_brokers == 3
    with pytest.warns(FutureWarning):  # both given: the new name wins
        both = load_settings(env={"KVPIPE_KAFKA_BROKERS": "3", "KVPIPE_KAFKA_LOCAL_BROKERS": "2"})
        assert both.kafka_local_brokers == 2
    toml = tmp_path / "kvpipe.toml"
    toml.write_text("kafka_brokers = 3\n")
    with pytest.warns(FutureWarning, match="kafka_brokers .* is deprecated; use kafka_local_brokers"):
        assert load_settings(env={"KVPIPE_CONFIG": str(toml)}).kafka_local_brokers == 3
