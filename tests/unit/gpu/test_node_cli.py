"""`kvpipe node` flags: group parsing, the summary line, restarts in a dry run, exported prefixes."""
from __future__ import annotations

import json

import pytest

from kvpipe.gpu.node.cli import main, parse_groups
from kvpipe.gpu.node.kv_compute import ModelShape
from kvpipe.gpu.node.node import CaptureSink, Node, NodeConfig
from kvpipe.gpu.node.workload import SyntheticConfig, SyntheticWorkload
from kvpipe.gpu.specs import FullAttention, Mamba, SlidingWindow
from kvpipe.schemas.groupspec import GroupSpecError
from kvpipe.schemas.events import BlockStored


def test_groups_are_kind_block_size_and_window() -> None:
    assert parse_groups("full:16,sliding_window:16:128,mamba:16") == (
        FullAttention(16), SlidingWindow(16, 128), Mamba(16))
    for bad in ("full", "sliding_window:16", "attn:16", "full:x", ""):
        with pytest.raises(GroupSpecError):
            parse_groups(bad)


def test_dry_run_prints_the_summary_as_the_last_line_and_restart_bumps_the_epoch(capsys, tmp_path) -> None:
    out = tmp_path / "prefixes.json"
    rc = main(["--steps", "60", "--no-publish", "--summary-json", "--restart-at", "30", "--layers", "1",
               "--gpu-blocks", "128", "--cpu-chunks", "32", "--export-prefixes", str(out), "--retention", "none"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 60 and summary["epochs"] == 2
    assert summary["publisher"] is None
    assert summary["events"]["by_medium"]["GPU"] > 0
    assert summary["offload"]["mismatched_blocks"] == 0
    exported = json.loads(out.read_text())
    assert [p["name"] for p in exported] == [f"system-{i}" for i in range(6)]
    assert set(exported[0]["block_hashes"]) == {"0", "1", "2"}


def test_exported_prefix_hashes_are_the_hashes_the_node_publishes_per_group() -> None:
    sink = CaptureSink()
    wl = SyntheticWorkload(SyntheticConfig(seed=1, num_system_prompts=3, arrivals_per_step=1.0))
    node = Node(NodeConfig(specs=(FullAttention(32), SlidingWindow(16, 64)), gpu_blocks=256, cpu_chunks=0,
                           retention=None, shape=ModelShape(layers_per_group=1)), wl, sink)
    for _ in range(40):
        node.step()
    published: dict[int, set] = {0: set(), 1: set()}
    for _, batch in sink.captured:
        for ev in batch:
            if isinstance(ev, BlockStored):
                published[ev.group_idx].update(ev.block_hashes)
    exported = node.export_prefixes()
    for p in exported:
        assert len(p["block_hashes"]["0"]) == p["num_tokens"] // 32
        assert len(p["block_hashes"]["1"]) == p["num_tokens"] // 16
    # every system prompt was served, so each of its full-attention blocks was announced
    for p in exported:
        assert set(p["block_hashes"]["0"]) <= published[0]


def test_a_mamba_align_layout_with_an_explicit_unit_publishes_partial_entries(capsys) -> None:
    """`--groups full:64,mamba:256 --prefix-match-unit 16`: Mamba states and prompt tails inside
    blocks are keyed at the hash unit, so hits land between block ends."""
    rc = main(["--steps", "60", "--no-publish", "--summary-json", "--layers", "1", "--gpu-blocks", "200",
               "--cpu-chunks", "0", "--groups", "full:64,mamba:256", "--prefix-match-unit", "16"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["events"]["by_group"]["1"] > 0 and summary["tokens"]["gpu_hit_tokens"] > 0
    sink = CaptureSink()
    node = Node(NodeConfig(specs=parse_groups("full:64,mamba:256"), gpu_blocks=200, cpu_chunks=0,
                           prefix_match_unit=16, shape=ModelShape(layers_per_group=1)),
                SyntheticWorkload(SyntheticConfig(seed=1)), sink)
    for _ in range(40):
        node.step()
    units = [ev for _, events in sink.captured for ev in events if isinstance(ev, BlockStored) and ev.block_size == 16]
    assert {ev.group_idx for ev in units} == {0, 1} and all(len(ev.block_hashes) == 1 for ev in units)
    assert node.hash_config().prefix_match_unit == 16
