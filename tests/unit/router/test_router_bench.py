"""The in-process route benchmark runs on a small fleet and reports hashing apart from the search."""
from __future__ import annotations

import pytest

from kvpipe.bench.route import run


def test_small_run_reports_hashing_and_search_separately_and_finds_hits():
    out = run(nodes=8, requests=10, documents=4, prompt_tokens=256, per_node=2, configs=2, seed=3)
    assert out["nodes"] == 8 and out["hash_configs"] == 2 and out["index_blocks"] > 0
    for part in ("hashing", "search", "route_total"):
        assert set(out[part]) == {"mean_us", "p50_us", "p99_us"} and out[part]["mean_us"] > 0
    assert out["route_total"]["mean_us"] >= out["search"]["mean_us"]
    assert out["mean_best_hit_tokens"] > 0  # requests share prefixes with what the nodes cached


def test_configs_beyond_the_known_ones_are_refused():
    with pytest.raises(ValueError, match="configs must be"):
        run(nodes=1, requests=1, configs=3)


def test_kvpipe_bench_route_is_registered_and_runs_in_process_without_a_broker():
    from kvpipe.bench import BENCHES
    from kvpipe.bench.route_http import run as bench_route

    assert BENCHES["route"][0] == "kvpipe.bench.route_http:run"
    out = bench_route(["--in-process-only", "--nodes", "4", "--requests", "5", "--documents", "2",
                       "--prompt-tokens", "128", "--per-node", "1"])
    assert out["bench"] == "route" and out["value"] == out["baseline"] > 0 and out["ratio"] == 1.0
    assert out["in_process"]["hashing"]["p50_us"] > 0 and "http" not in out


def test_the_snapshot_block_times_each_path_and_checks_them():
    from kvpipe.bench.route_http import run as bench_route
    from kvpipe.processors.core import native

    out = bench_route(["--in-process-only", "--snapshots", "--nodes", "6", "--requests", "2", "--documents", "2",
                       "--prompt-tokens", "256", "--per-node", "2", "--no-dynamo"])
    stores = out["in_process"]["stores"]
    entries = stores["python"]["entries"]
    assert entries > 0 and stores["python"]["snapshot"]["entries"] == entries
    assert stores["python"]["snapshot"]["python"]["chunks"] >= 1
    if native.engine() == "native":
        snap = stores["native"]["snapshot"]
        assert snap["same_bytes"] is True and snap["entries"] == entries
        assert snap["native"]["bytes"] == snap["python"]["bytes"] == stores["python"]["snapshot"]["python"]["bytes"]
        assert snap["native"]["import_s"] > 0 and snap["export_python_over_native"] > 0


def test_kvpipe_route_reads_token_ids_as_a_json_list_or_whitespace_separated():
    from kvpipe.processors.routing.cli import read_tokens

    assert read_tokens("[1, 2, 3]") == read_tokens("1 2\n3\n") == read_tokens("1,2, 3") == [1, 2, 3]
    for bad in ('["a"]', "[1.5]", "1 x", "[true]"):
        with pytest.raises(ValueError):
            read_tokens(bad)


def test_both_engines_are_timed_on_the_same_requests_and_checked_equal():
    from kvpipe.bench.route_dynamo import load
    from kvpipe.processors.core import native

    out = run(nodes=8, requests=6, documents=3, prompt_tokens=256, per_node=2, seed=1)
    engines = ["native", "python"] if native.engine() == "native" else ["python"]
    assert list(out["engines"]) == engines and out["engine"] == engines[0]
    assert out["answers_checked"] == (6 if len(engines) == 2 else 0)
    assert out["search"] == out["engines"][engines[0]]["search"]
    dyn = out["dynamo_radix_tree"]
    if load() is None:  # the bench extra is not installed: the baseline says so instead of a number
        assert dyn == {"missing": "ai-dynamo-runtime not installed (bench extra: pip install 'kvpipe[bench-dynamo]', "
                                  "or ai-dynamo-runtime==1.6.1)"}
    else:
        assert dyn["find_matches"]["p50_us"] > 0
        warm = dyn["back_to_back"]
        assert warm["dynamo"]["p50_us"] > 0 and warm["ratio_dynamo_p50_over_decision_p50"] > 0
        if native.engine() == "native":  # the settled calls include the decision of a prompt no node holds
            assert warm["uncached_decision"]["p50_us"] > 0
            # and the prompt as per-group block hashes, answered natively (checked equal to the token-id answer)
            assert warm["block_hashes_decision"]["p50_us"] > 0 and warm["block_hashes_full_answer"]["p50_us"] > 0
    if native.engine() == "native":
        blocks = out["native_route"]["block_hashes"]
        assert blocks["decision_top_k_1"]["p50_us"] > 0 and blocks["full_answer"]["p50_us"] > 0


def test_back_to_back_asks_each_call_twice_and_times_the_second(monkeypatch):
    """The steady-state comparison's order (no Dynamo needed: a tree that records what it is asked)."""
    from kvpipe.bench import route_dynamo

    monkeypatch.setattr(route_dynamo, "SETTLE_CALLS", 2)
    monkeypatch.setattr(route_dynamo.time, "sleep", lambda s: None)
    asked: list = []

    class Tree:
        def find_matches(self, seq):
            asked.append(("dynamo", tuple(seq)))
            return type("Scores", (), {"scores": {}})()

    def ours(name):
        return lambda: asked.append((name, None))

    cases = [([1, 2], {"decision": ours("decision"), "prefix_route": ours("prefix")}),
             ([b"\x00" * 24 + b"\x00\x00\x00\x00\x00\x00\x00\x03"], {"decision": ours("decision"), "prefix_route": ours("prefix")})]
    times = route_dynamo.back_to_back(Tree(), cases)
    assert {k: len(v) for k, v in times.items()} == {"dynamo": 2, "decision": 2, "prefix_route": 2}
    assert all(t >= 0 for v in times.values() for t in v)
    # settling, then every Dynamo lookup twice (the bytes hash by its last 8 bytes), then each of ours twice
    assert asked == [("dynamo", (1, 2))] * 4 + [("dynamo", (3,))] * 2 + [("decision", None)] * 2 \
        + [("prefix", None)] * 2 + [("decision", None)] * 2 + [("prefix", None)] * 2


def test_a_disagreement_between_the_engines_stops_the_bench(monkeypatch):
    from kvpipe.processors.core import native

    if native.engine() != "native":
        pytest.skip(f"one engine only, nothing to compare: {native.reason()}")
    from kvpipe.processors.router import cohort, decide

    real = cohort.cohort_hits

    def off_by_one(*args, **kw):  # the native cohort path gives one more GPU token than it found
        got = real(*args, **kw)
        return None if got is None else [(m, gpu + 1, any_ + 1, groups) for m, gpu, any_, groups in got]

    monkeypatch.setattr(decide, "cohort_hits", off_by_one)
    with pytest.raises(RuntimeError, match="answered differently"):
        run(nodes=8, requests=6, documents=3, prompt_tokens=256, per_node=2, seed=1)
