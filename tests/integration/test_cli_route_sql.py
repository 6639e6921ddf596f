"""`kvpipe route` and `kvpipe sql` as a user runs them: subprocesses against the two running apps
(real broker): `route` asks the routing app (KVPIPE_WEB_PORT), `sql` the analytics app that owns
the embedded chDB store (KVPIPE_ANALYTICS_WEB_PORT), both found through the settings. Plus `--help`
of every subcommand.

Two nodes, full-attention group 0 and sliding-window group 1, one step every 90 s (so the report's
time series span several one-minute buckets):
  node-x stores 11..14 in both groups, then its window slides (group 1 evicts 11, 12);
  node-y stores 11, 12 in both groups, then its window slides past 12.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpipe.bench.procrun import REPO, ProcessorProcess, free_port
from kvpipe.gpu.hashing import external_hash, hash_request_blocks, hasher_from_config
from kvpipe.producer.publisher import Publisher
from kvpipe.schemas.envelope import HashConfig
from kvpipe.schemas.settings import load_settings
from tests.integration.analytics_helpers import FA, SPECS, SWA, AnalyticsSession, Clock, RowModel, SimNode, \
    removed, stored, wait_written

pytestmark = pytest.mark.integration

SUBCOMMANDS = ["infra", "node", "bridge", "processor", "analytics", "route", "nodes", "stats", "sql", "plan", "report",
               "inspect", "demo", "bench"]


class Cli:
    """Runs `python -m kvpipe ...` with the processor's settings in the environment."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_")}
        self.env.update(env)
        self.env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        self.cwd = cwd  # not the checkout: no kvpipe.toml leaks in

    def popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "kvpipe", *args], env=self.env, cwd=self.cwd,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, *args: str, timeout: float = 60.0, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvpipe", *args], env=self.env, cwd=self.cwd,
                              capture_output=True, text=True, timeout=timeout, input=stdin)


class Running:
    def __init__(self, session: AnalyticsSession, index: ProcessorProcess, analytics: ProcessorProcess,
                 model: RowModel, cli: Cli) -> None:
        self.session, self.index, self.analytics, self.model, self.cli = session, index, analytics, model, cli


@pytest.fixture(scope="module")
def running(kafka_bootstrap: str, tmp_path_factory) -> Running:
    tmp = tmp_path_factory.mktemp("cli")
    session = AnalyticsSession(kafka_bootstrap, tmp, partitions=1)
    model, clock = RowModel(), Clock(step_s=90)
    try:
        index = session.processor()
        analytics = session.analytics(snapshot_every_s=3600)
        x, y = SimNode(session, model, clock, "node-x"), SimNode(session, model, clock, "node-y")
        x.step(stored([11, 12, 13, 14], FA), stored([11, 12, 13, 14], SWA))
        y.step(stored([11, 12], FA), stored([11, 12], SWA))
        x.step(removed([11, 12], SWA))
        y.step(removed([12], SWA))
        x.close()
        y.close()
        end = session.end_offsets()
        index.wait_offsets(end)
        wait_written(analytics, end)
        yield Running(session, index, analytics, model, Cli(session.env, tmp))
    finally:
        session.close()


def _hits(out: str) -> list[tuple[str, int, int]]:
    return [(n["node_id"], n["gpu_tokens"], n["loadable_tokens"]) for n in json.loads(out)["nodes"]]


def test_every_subcommand_answers_help_with_exit_0(tmp_path):
    cli = Cli({}, tmp_path)
    procs = {cmd: cli.popen(cmd, "--help") for cmd in SUBCOMMANDS}  # in parallel: `node` imports torch
    for cmd, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"kvpipe {cmd} --help exited {p.returncode}: {err[-2000:]}"
        assert f"kvpipe {cmd}" in out and "usage" in out.lower(), f"kvpipe {cmd} --help printed no usage: {out[:300]}"


def test_route_by_hashes_ranks_by_the_hybrid_hit_in_tokens(running: Running):
    done = running.cli.run("route", "--hashes", "11,12,13,14", "--num-tokens", "65", "--include-zero", "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    # node-x's window (64 tokens = 4 blocks) lost 11, 12: no run the window needs → 0 tokens;
    # node-y: FA 11, 12 → 32, its window holds 11 only → a 1-block run from block 0 → 16
    assert answer["semantics"] == "hma" and answer["chosen"] == "node-y"
    assert _hits(done.stdout) == [("node-y", 16, 0), ("node-x", 0, 0)]
    human = running.cli.run("route", "--hashes", "11,12,13,14", "--num-tokens", "65")
    assert human.returncode == 0 and human.stdout.startswith("chosen: node-y"), human.stdout
    lines = human.stdout.splitlines()  # chosen, then a table: border, header, border, rows
    assert lines[2].split("|")[1].strip() == "node" and lines[4].split("|")[1].strip() == "node-y", human.stdout
    assert "node-x" not in human.stdout  # no hit, not listed


def test_route_by_file_explains_with_per_group_prefixes(running: Running, tmp_path):
    request = tmp_path / "req.json"
    request.write_text(json.dumps({"block_hashes": {"0": [11, 12, 13, 14], "1": [11, 12, 13, 14]}, "num_tokens": 65,
                                   "semantics": "prefix-per-group", "include_zero": True}))
    done = running.cli.run("route", "--file", str(request), "--json")
    assert done.returncode == 0, done.stderr
    prefixes = {n["node_id"]: [g["prefix_blocks"] for g in n["groups"]] for n in json.loads(done.stdout)["nodes"]}
    # node-x's window slid past 11 and 12 (prefix 0) though it still holds 13, 14; node-y holds 11, 12 / 11
    assert prefixes == {"node-x": [{"GPU": 4, "any": 4}, {"GPU": 0, "any": 0}],
                        "node-y": [{"GPU": 2, "any": 2}, {"GPU": 1, "any": 1}]}
    assert _hits(done.stdout) == [("node-y", 16, 0), ("node-x", 0, 0)]  # the ranking is still the hybrid hit


def test_route_mistakes_are_errors_with_the_reason(running: Running):
    refused = running.cli.run("route", "--hashes", "11,12,13", "--num-tokens", "100")
    assert refused.returncode == 1 and "group 0: 3 hashes, expected 6" in refused.stderr, refused.stderr
    bad = running.cli.run("route", "--tokens", "-", timeout=60.0)
    assert bad.returncode != 0 and "token_ids is empty" in bad.stderr, bad.stderr


def test_sql_prints_a_table_and_json_read_through_the_analytics_app(running: Running):
    expected = sum(running.model.events.values())
    done = running.cli.run("sql", "SELECT count() AS n FROM kv_events_final")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()  # a bordered table: border, header, border, rows, border
    assert lines[1] == "| n" + " " * (len(str(expected)) - 1) + " |" and lines[3] == f"| {expected} |", done.stdout
    assert lines[0] == lines[2] == lines[4] == "+" + "-" * (len(str(expected)) + 2) + "+"
    assert lines[5] == "(1 rows)"
    done = running.cli.run("sql", "--json", "SELECT kind, count() AS n FROM kv_events_final GROUP BY kind ORDER BY kind")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)  # ClickHouse's JSON layout
    assert [m["name"] for m in result["meta"]] == ["kind", "n"]
    assert result["data"] == [{"kind": "removed", "n": 2}, {"kind": "stored", "n": 4}] and result["rows"] == 2


def test_sql_refuses_a_write_with_the_reason_and_a_nonzero_exit(running: Running):
    done = running.cli.run("sql", "INSERT INTO kv_events (node_id) VALUES ('ghost')")
    assert done.returncode != 0 and done.stdout == ""
    assert "statement not allowed" in done.stderr and "read-only" in done.stderr, done.stderr
    count = running.cli.run("sql", "--json", "SELECT count() FROM kv_events WHERE node_id = 'ghost'")
    assert [list(r.values()) for r in json.loads(count.stdout)["data"]] == [[0]]


def test_sql_takes_clickhouse_clients_spellings(running: Running):
    """-q/--query, the statement on standard input, --param_NAME bound to {NAME:Type}, ClickHouse's formats."""
    stored = sum(n for (_node, _group, _medium, kind), n in running.model.events.items() if kind == "stored")
    q = "SELECT kind, count() AS n FROM kv_events_final WHERE kind = {kind:String} GROUP BY kind"
    tsv = running.cli.run("sql", "-q", q, "--param_kind=stored", "--format", "TSV")
    assert tsv.returncode == 0 and tsv.stdout == f"stored\t{stored}\n", (tsv.stdout, tsv.stderr)
    named = running.cli.run("sql", "--param_kind", "stored", "--format", "TabSeparatedWithNames", stdin=q)
    assert named.returncode == 0 and named.stdout == f"kind\tn\nstored\t{stored}\n", (named.stdout, named.stderr)
    rows = running.cli.run("sql", "-", "--param_kind=stored", "--format", "JSONEachRow", stdin=q)
    assert rows.returncode == 0 and [json.loads(line) for line in rows.stdout.splitlines()] == \
        [{"kind": "stored", "n": stored}], rows.stderr
    pretty = running.cli.run("sql", "-q", "SELECT 1 AS one, 'x' AS s", "--format", "PrettyCompact")
    assert pretty.stdout.splitlines() == ["┌─one─┬─s─┐", "│   1 │ x │", "└─────┴───┘"], pretty.stdout
    out = running.cli.run("sql", "-o", "json", "-q", "SELECT 2 AS two")
    assert json.loads(out.stdout)["data"] == [{"two": 2}], out.stderr
    # a parameter the statement has no placeholder for is refused by name, not formatted into the text
    stray = running.cli.run("sql", "-q", "SELECT 1", "--param_x=1")
    assert stray.returncode != 0 and "x" in stray.stderr, stray.stderr
    clash = running.cli.run("sql", "-o", "table", "--format", "CSV", "-q", "SELECT 1")
    assert clash.returncode == 2 and "disagree" in clash.stderr, clash.stderr


def test_sql_without_the_analytics_app_says_how_to_start_it(running: Running):
    cli = Cli({**running.session.env, "KVPIPE_ANALYTICS_WEB_PORT": str(free_port())}, running.cli.cwd)
    done = cli.run("sql", "SELECT 1")
    assert done.returncode == 1 and "kvpipe analytics" in done.stderr, done.stderr


def test_report_writes_one_html_page_with_plots_and_tables(running: Running, tmp_path):
    out = tmp_path / "report.html"
    done = running.cli.run("report", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    text = out.read_text()
    assert text.count("<figure class='plot'") == 5 and text.count("<svg") == 5
    # 3 sliding-window blocks evicted: a table row, ratio NULL (no FA eviction) as an empty cell
    assert "<td>GPU</td><td>3</td><td>0</td><td></td>" in text, text


def test_saved_queries_by_name_as_table_csv_and_json(running: Running):
    listed = running.cli.run("sql", "--list")
    assert listed.returncode == 0 and "capacity_curve" in listed.stdout and "wasted_recompute" in listed.stdout
    table = running.cli.run("sql", "--saved", "swa_fa_eviction_ratio")
    assert table.returncode == 0 and [c.strip() for c in table.stdout.splitlines()[1].strip("|").split("|")] == \
        ["medium", "swa_evicted", "fa_evicted", "swa_fa_ratio"], table.stdout
    markdown = running.cli.run("sql", "--saved", "swa_fa_eviction_ratio", "--format", "markdown")
    row = markdown.stdout.splitlines()[2]  # header, alignment row, rows: numbers right-aligned, NULL empty
    assert markdown.returncode == 0 and row == "| GPU    |           3 |          0 |              |", markdown.stdout
    csv_out = running.cli.run("sql", "--saved", "swa_fa_eviction_ratio", "--format", "csv")
    assert csv_out.stdout.splitlines() == ["medium,swa_evicted,fa_evicted,swa_fa_ratio", "GPU,3,0,"], csv_out.stdout
    js = json.loads(running.cli.run("sql", "--saved", "lifetime_quantiles", "--param", "reasons=evicted",
                                    "--format", "json").stdout)
    assert [m["name"] for m in js["meta"]][:3] == ["group_idx", "group_kind", "medium"] and js["rows"]
    bad = running.cli.run("sql", "--saved", "no_such_query")
    assert bad.returncode == 2 and "capacity_curve" in bad.stderr
    plan = running.cli.run("plan", "--json")
    assert plan.returncode == 0 and "LRU" in json.loads(plan.stdout)["method"], plan.stderr


def test_nodes_and_stats_read_the_running_apps_as_tables_and_json(running: Running):
    done = running.cli.run("nodes", "-o", "json")
    assert done.returncode == 0, done.stderr
    page = json.loads(done.stdout)
    assert [n["node_id"] for n in page["nodes"]] == ["node-x", "node-y"]
    assert page["next_after"] is None and not page["partial"]
    # node-x: 11..14 in the full-attention group, its window evicted 11, 12; node-y: 11, 12 and its window 11
    assert [n["blocks"] for n in page["nodes"]] == [{"0/GPU": 4, "1/GPU": 2}, {"0/GPU": 2, "1/GPU": 1}]
    assert [g["sliding_window"] for g in page["nodes"][0]["groups"]] == [None, 64]
    first = running.cli.run("nodes", "--limit", "1", "--state", "healthy")
    lines = first.stdout.splitlines()  # border, header, border, one row, border, the count
    assert first.returncode == 0 and [c.strip() for c in lines[3].strip("|").split("|")][:2] == ["node-x", "healthy"]
    assert lines[-1] == "(1 nodes; more after 'node-x': --limit)", first.stdout
    stats = running.cli.run("stats", "--json")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["processor_id"] == running.session.env["KVPIPE_PROCESSOR_ID"]
    table = running.cli.run("stats")
    cells = {row.split("|")[1].strip(): row.split("|")[2].strip() for row in table.stdout.splitlines() if "|" in row}
    assert cells["nodes.healthy"] == "2" and int(cells["index.0.GPU"]) > 0, table.stdout
    analytics = running.cli.run("stats", "--analytics", "-o", "json")
    assert analytics.returncode == 0 and json.loads(analytics.stdout)["app"] == "analytics", analytics.stderr
    assert json.loads(analytics.stdout)["store"]["up"] is True


def test_route_by_token_ids_from_stdin_hashes_per_node(running: Running):
    # runs last: its node's events are not in the analytics model the sql tests count
    cfg = HashConfig(algorithm="sha256", hash_block_size=16)
    tokens = list(range(500, 500 + 80))  # 5 blocks of 16
    fine = hash_request_blocks(hasher_from_config(cfg), tokens, 16)
    hashes = [external_hash(h, True) for h in fine]
    settings = load_settings(overrides={"kafka_bootstrap": running.session.bootstrap,
                                        "events_topic": running.session.events, "heartbeat_s": 3600.0})
    pub = Publisher(settings, "node-t", group_specs=SPECS, hash_config=cfg, epoch=1, model="test-model")
    assert pub.publish([stored(hashes, FA), stored(hashes[-4:], SWA)])
    pub.close()
    running.index.wait_offsets(running.session.end_offsets())
    spaced = " ".join(map(str, tokens)) + " 7"  # one more token: the cap keeps all 80 cached tokens
    done = subprocess.run([sys.executable, "-m", "kvpipe", "route", "--tokens", "-", "--json"], input=spaced,
                          env=running.cli.env, cwd=running.cli.cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["chosen"] == "node-t" and _hits(done.stdout)[0] == ("node-t", 80, 0)
    assert answer["hash_configs"][0]["label"] == "sha256/16/default/int" and answer["num_tokens"] == 81
    # nodes without a published hash configuration cannot be hashed for: no signal, with the reason
    assert {n["node_id"]: n["cause"] for n in answer["no_signal"]} == {"node-x": "config", "node-y": "config"}
    listed = running.cli.cwd / "tokens.json"  # the JSON-list form, from a file
    listed.write_text(json.dumps(tokens + [7]))
    again = running.cli.run("route", "--tokens", str(listed), "--json")
    assert again.returncode == 0 and _hits(again.stdout)[0] == ("node-t", 80, 0), again.stderr



def _exported(text: str) -> set[str]:
    """Series names a Prometheus exposition declares or carries: its samples, and each `# TYPE` family's
    series (a labelled family with no sample yet, e.g. no DLQ message so far, is declared all the same)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            names |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
        elif line and not line.startswith("#"):
            names.add(line.split("{")[0].split(" ")[0])
    return names


def test_alert_rules_and_the_operations_dashboard_name_only_metrics_the_apps_export(running: Running):
    """infra/prometheus/kvpipe-alerts.yaml and infra/grafana/dashboards/kvpipe-operations.json, against
    what the two running apps serve on /metrics and what the bridge's collector renders."""
    import re
    import urllib.request

    import yaml

    from kvpipe.bench.procrun import REPO
    from kvpipe.producer.bridge.metrics import Counters, render

    exported = set()
    for app in (running.index, running.analytics):
        req = urllib.request.Request(app.url + "/metrics", headers=app.headers)
        exported |= _exported(urllib.request.urlopen(req, timeout=30).read().decode())
    exported |= _exported(render([("node-a", Counters(), [])]))
    rules = yaml.safe_load((REPO / "infra/prometheus/kvpipe-alerts.yaml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    board = json.loads((REPO / "infra/grafana/dashboards/kvpipe-operations.json").read_text())
    exprs += [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert len(exprs) >= 20 and all(r.get("alert") and r.get("annotations", {}).get("summary")
                                    for g in rules["groups"] for r in g["rules"])
    named = {m for e in exprs for m in re.findall(r"\b((?:kvpipe|process)_[a-z0-9_]+)\b", e)}
    missing = sorted(named - exported)
    assert missing == [], f"metrics no running app exports: {missing}"
    families = {"kvpipe_processor_", "kvpipe_analytics_", "kvpipe_bridge_"}
    assert all(any(n.startswith(f) for n in named) for f in families), "each process has alerts or panels"
