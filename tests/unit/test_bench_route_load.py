"""`kvpipe bench route-load`'s pure parts: its flags, wrk's output, the Lua script, the bodies and the
ingest envelopes. Nothing here starts wrk, a broker or a processor; nothing is timed."""
from __future__ import annotations

import json
import random
import re

import click
import pytest

from kvpipe.bench import BENCHES, route_load as rl
from kvpipe.schemas import cliopts
from kvpipe.schemas.codec import decode_envelope, envelope_events
from kvpipe.schemas.events import BlockRemoved, BlockStored

# what wrk 4.1 prints with --latency and the script's done() (a run against a stub server)
WRK_OK = """Running 1s test @ http://127.0.0.1:18777/route
  2 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    43.03ms    8.81ms  48.44ms   95.83%
    Req/Sec    45.57      9.04    60.00     71.43%
  Latency Distribution
     50%   44.03ms
     75%   44.56ms
     90%   47.96ms
     99%   48.44ms
  96 requests in 1.10s, 12.25KB read
Requests/sec:     87.23
Transfer/sec:     11.13KB
KVPIPE_WRK {"requests": 96, "duration_us": 1100569, "bytes": 12544, "connect_errors": 0, "read_errors": 0, \
"write_errors": 0, "status_errors": 0, "timeouts": 0, "p50_us": 44032.0, "p90_us": 47960.0, "p99_us": 48444.0, \
"max_us": 48444.0, "mean_us": 43027.9}
"""

WRK_ERRORS_TEXT = """Running 10s test @ http://127.0.0.1:6066/route
  2 threads and 128 connections
  Latency Distribution
     50%  635.91us
     75%  712.00us
     90%    1.20ms
     99%    2.01s
  12345 requests in 10.00s, 1.50MB read
  Socket errors: connect 0, read 3, write 0, timeout 7
  Non-2xx or 3xx responses: 5
Requests/sec:   1234.50
Transfer/sec:    153.60KB
"""


def test_route_load_is_registered():
    assert BENCHES["route-load"][0] == "kvpipe.bench.route_load:run"


def test_defaults_are_the_issue_s():
    p = cliopts.parse(rl.route_load_bench, [])
    assert p["connections"] == [1, 8, 32, 128] and p["duration_s"] == 10 and p["ingest_rate"] == 8000
    assert p["cpus"] == [] and p["bodies"] == 50 and p["uncached"] == 0.3
    assert (p["nodes"], p["documents"], p["prompt_tokens"], p["per_node"]) == (256, 64, 2048, 8)


def test_flags_parse():
    p = cliopts.parse(rl.route_load_bench, ["--connections", " 32, 1,32 ", "--duration-s", "2",
                                            "--ingest-rate", "100000", "--cpus", "0"])
    assert p["connections"] == [32, 1] and p["duration_s"] == 2 and p["ingest_rate"] == 100_000
    assert p["cpus"] == [0]


@pytest.mark.parametrize("argv, message", [
    (["--connections", "0"], "--connections"),
    (["--connections", "8,x"], "positive connection counts"),
    (["--connections", ""], "--connections"),
    (["--cpus", "9999"], "not available here"),
    (["--cpus", "1-0"], "runs upwards"),
    (["--duration-s", "0"], "--duration-s"),
    (["--no-such-flag"], "No such option"),
])
def test_bad_flags_are_usage_errors(argv, message, capsys):
    assert rl.run(argv) == 2
    assert message in capsys.readouterr().err


def test_help_lists_the_flags(capsys):
    assert rl.run(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--connections", "--duration-s", "--ingest-rate", "--cpus", "--probes", "--bodies"):
        assert flag in out


def test_parse_connections_and_cpus():
    assert rl.parse_connections("1,8,32,128") == [1, 8, 32, 128]
    assert rl.parse_cpus("", {0, 1}) == []
    assert rl.parse_cpus("0,1", {0, 1}) == [0, 1]
    assert rl.parse_cpus("0-1", {0, 1, 2}) == [0, 1]
    with pytest.raises(ValueError):
        rl.parse_cpus("a", {0})


def test_wrk_threads_and_command():
    assert [rl.wrk_threads(c) for c in (1, 8, 32, 128)] == [1, 2, 2, 2]
    cmd = rl.wrk_command("wrk", "http://127.0.0.1:1/route", 32, 10, "s.lua", 10)
    assert cmd == ["wrk", "-t", "2", "-c", "32", "-d", "10s", "--timeout", "10s", "--latency", "-s", "s.lua",
                   "http://127.0.0.1:1/route"]
    assert rl.wrk_command("wrk", "u", 1, 0.2, "s", 0.1)[1:9] == ["-t", "1", "-c", "1", "-d", "1s", "--timeout", "1s"]


@pytest.mark.parametrize("text, us", [("635.91us", 635.91), ("1.20ms", 1200.0), ("2.00s", 2e6), ("1.50m", 90e6)])
def test_wrk_durations(text, us):
    assert rl.duration_us(text) == pytest.approx(us)


def test_the_lua_summary_line_wins():
    r = rl.parse_wrk(WRK_OK)
    assert r["source"] == "lua" and r["requests"] == 96 and r["errors"] == 0 and r["non_2xx"] == 0
    assert r["p50_us"] == 44032.0 and r["p99_us"] == 48444.0 and r["max_us"] == 48444.0
    assert r["requests_per_s"] == pytest.approx(96 / 1.100569)
    assert rl.step_problem(r) is None


def test_the_text_is_parsed_without_the_lua_line():
    r = rl.parse_wrk(WRK_OK.split("KVPIPE_WRK")[0])
    assert r["source"] == "text" and r["requests"] == 96 and r["duration_s"] == 1.1
    assert r["p50_us"] == pytest.approx(44030.0) and r["p99_us"] == pytest.approx(48440.0) and r["errors"] == 0


def test_errors_and_non_2xx_fail_the_step():
    r = rl.parse_wrk(WRK_ERRORS_TEXT)
    assert r["socket_errors"] == {"connect": 0, "read": 3, "write": 0, "timeout": 7} and r["non_2xx"] == 5
    assert r["errors"] == 15 and r["p50_us"] == pytest.approx(635.91) and r["p99_us"] == pytest.approx(2.01e6)
    problem = rl.step_problem(r)
    assert "15 request(s) errored" in problem and "non-2xx 5" in problem and "timeout 7" in problem
    lua = WRK_OK.replace('"status_errors": 0', '"status_errors": 4')
    assert "non-2xx 4" in rl.step_problem(rl.parse_wrk(lua))
    nothing = WRK_OK.replace('"requests": 96', '"requests": 0')
    assert rl.step_problem(rl.parse_wrk(nothing)) == "wrk completed no request"


def test_output_without_a_result_is_an_error():
    with pytest.raises(ValueError, match="wrk printed no result"):
        rl.parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")


def test_the_lua_script_reads_the_bodies_cycles_and_reports():
    script = rl.lua_script('/tmp/a "b"\\c/bodies.jsonl')
    assert 'local bodies_path = "/tmp/a \\"b\\"\\\\c/bodies.jsonl"' in script
    assert 'wrk.format("POST", "/route", headers, line)' in script
    assert f'os.getenv("{rl.TOKEN_ENV}")' in script and '"Bearer " .. token' in script
    for fn in ("setup(thread)", "init(args)", "request()", "done(summary, latency, requests)"):
        assert f"function {fn}" in script
    assert "latency:percentile(99)" in script and rl.WRK_MARK in script
    # every key the parser reads is written by done()
    for key in ("requests", "duration_us", "bytes", "connect_errors", "read_errors", "write_errors",
                "status_errors", "timeouts", "p50_us", "p90_us", "p99_us", "max_us", "mean_us"):
        assert f'"{key}": %' in script
    # balanced blocks: one `end` per function, if and for
    opened = len(re.findall(r"\b(function|if|for)\b", script))
    assert opened == len(re.findall(r"\bend\b", script))
    assert "\n" not in rl._lua_string("a\nb")


def test_bodies_mix_and_lines():
    rng = random.Random(0)
    docs = [[rng.randrange(150_000) for _ in range(256)] for _ in range(4)]
    bodies = rl.make_bodies(docs, 50, 0.3, 0.1, 256, random.Random(1))
    kinds = [k for k, _ in bodies]
    assert kinds.count("uncached") == 15 and kinds.count("whole") == 5 and kinds.count("prefix") == 30
    assert all(len(t) == 256 for _, t in bodies)
    for kind, tokens in bodies:
        if kind == "whole":
            assert tokens in docs
        elif kind == "prefix":
            assert any(tokens[:64] == d[:64] for d in docs) and tokens not in docs
    line = rl.body_line(bodies[0][1])
    assert "\n" not in line and json.loads(line) == {"token_ids": bodies[0][1], "top_k": 1}
    with pytest.raises(ValueError):
        rl.make_bodies(docs, 10, 0.8, 0.3, 256, random.Random(1))


def test_a_body_as_its_unit_chain_or_block_hashes_and_paced_scripts():
    rng = random.Random(2)
    tokens = [rng.randrange(150_000) for _ in range(100)]
    body = json.loads(rl.body_line(tokens, "units"))
    assert body["hash_block_size"] == 16 and body["num_tokens"] == 100 and body["top_k"] == 1
    assert len(body["unit_hashes"]) == 100 // 16 and all(0 <= h < 1 << 64 for h in body["unit_hashes"])
    # the chain is the prompt's: the same tokens give the same chain, one token changed moves it from there on
    other = json.loads(rl.body_line(tokens[:40] + [tokens[40] + 1] + tokens[41:], "units"))["unit_hashes"]
    assert other[:2] == body["unit_hashes"][:2] and other[2] != body["unit_hashes"][2]
    # as block hashes: each group of the fleet's layout its view of the same chain, at its own block size
    blocks = json.loads(rl.body_line(tokens, "blocks"))
    assert blocks["num_tokens"] == 100 and blocks["top_k"] == 1 and "unit_hashes" not in blocks
    sizes = {str(s.group_idx): s.block_size for s in rl.bench.layout(rl.FLEET_WINDOWS)}
    assert set(blocks["block_hashes"]) == set(sizes) and len(sizes) == 2
    for g, hashes in blocks["block_hashes"].items():
        k = sizes[g] // 16
        assert hashes == body["unit_hashes"][k - 1::k] and len(hashes) == 100 // sizes[g]
    with pytest.raises(ValueError):
        rl.body_of(tokens, "hashes")
    assert "function delay()\n  return 3\nend" in rl.lua_script("/tmp/b.jsonl", delay_ms=3)
    assert "function delay" not in rl.lua_script("/tmp/b.jsonl")


def test_a_rate_paced_script_keeps_one_schedule_per_thread():
    script = rl.lua_script("/tmp/b.jsonl", rate_per_thread=4000)
    assert "local pace = 0.25\n" in script and "function delay()" in script  # 4 000 a second: one per 0.25 ms
    assert "clock_gettime(1, now_ts)" in script  # the monotonic clock, not the wall clock
    assert "if slot < now - lag then\n    slot = now - lag" in script  # behind: a bounded catch-up only
    assert "local pace = 3.333333\n" in rl.lua_script("/tmp/b.jsonl", rate_per_thread=300)
    with pytest.raises(ValueError, match="not both"):
        rl.lua_script("/tmp/b.jsonl", delay_ms=1, rate_per_thread=100)


def test_shares_need_ingest_and_no_delay():
    p = cliopts.parse(rl.route_load_bench, ["--share", "0.8", "--share", "0.5"])
    assert p["share"] == (0.8, 0.5)
    for argv in (["--share", "0"], ["--share", "1.5"]):
        with pytest.raises(click.BadParameter):
            cliopts.parse(rl.route_load_bench, argv)
    for argv in (["--share", "0.8", "--ingest-rate", "0"], ["--share", "0.8", "--delay-ms", "2"]):
        with pytest.raises(click.BadParameter, match="--share paces"):  # refused before anything starts
            rl.route_load_bench.callback(**cliopts.parse(rl.route_load_bench, argv))


def test_value_is_at_32_connections_or_the_nearest():
    assert rl.pick_value({1: 10.0, 8: 20.0, 32: 30.0, 128: 25.0}) == (32, 30.0)
    assert rl.pick_value({1: 10.0, 8: 20.0}) == (8, 20.0)


def test_proc_parsers():
    stat = "1234 (kvpipe worker (x)) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 3 0 100 0 0"
    assert rl.proc_cpu_s(stat, 100) == 3.0
    assert rl.host_busy("cpu  100 5 50 800 20 1 2 3 0 0") == (161, 981)


def test_ingest_envelopes_announce_then_store_and_evict_evenly():
    src = rl.IngestSource(nodes=2, events_per=25)
    first = [decode_envelope(v) for _, v in src.announce()]
    assert [(e.node_id, e.seq, e.model) for e in first] == [("ingest-node-00", 0, "bench"),
                                                             ("ingest-node-01", 0, "bench")]
    assert all(e.group_specs and e.hash_config and e.num_events == 0 for e in first)
    envs = [decode_envelope(v) for _, v in src.take(60)]
    assert [e.seq for e in envs if e.node_id == "ingest-node-00"] == list(range(1, 31))
    assert all(e.group_specs is None for e in envs)
    events = [envelope_events(e) for e in envs]
    assert all(len(ev) == 25 for ev in events)
    stored = sum(len(x.block_hashes) for ev in events for x in ev if isinstance(x, BlockStored))
    removed = sum(len(x.block_hashes) for ev in events for x in ev if isinstance(x, BlockRemoved))
    assert removed > 0 and all(len(f) <= 256 + 25 for f in src.fifo.values())  # steady size
    assert stored + removed == 60 * 25


def test_processor_env_is_kvpipe_settings_only(capsys):
    assert rl.parse_processor_env(["KVPIPE_ROUTE_PORT=auto", "KVPIPE_PROCESSOR_DELIVERY=message"]) == {
        "KVPIPE_ROUTE_PORT": "auto", "KVPIPE_PROCESSOR_DELIVERY": "message"}
    assert cliopts.parse(rl.route_load_bench, [])["processor_env"] == {}
    for bad in ("PATH=/x", "KVPIPE_X", "kvpipe_x=1"):
        with pytest.raises(ValueError):
            rl.parse_processor_env([bad])
    assert rl.run(["--processor-env", "HOME=/"]) == 2
    assert "KVPIPE_NAME=VALUE" in capsys.readouterr().err
