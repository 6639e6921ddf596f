"""The event stream is the cache: replaying a node's published batches into per-(group, medium)
ref-counted hash sets and running the router's pure hit function over them gives, at every step
boundary, exactly the hit the node's own coordinator computes — and the CPU tier's contents."""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from kvpipe.gpu.cpu_tier import LookupResult, offload_key_group, offload_key_hash
from kvpipe.gpu.hashing import external_hash, hash_request_blocks
from kvpipe.gpu.hit import longest_hybrid_hit
from kvpipe.gpu.node.kv_compute import ModelShape
from kvpipe.gpu.node.node import CaptureSink, Node, NodeConfig
from kvpipe.gpu.node.workload import SyntheticConfig, SyntheticWorkload
from kvpipe.gpu.offload_lookup import OffloadGroup, chunk_keys
from kvpipe.gpu.specs import FullAttention, Mamba, SlidingWindow
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored

SMALL = ModelShape(layers_per_group=1, num_kv_heads=1, head_size=8)


class Replay:
    """A consumer's model of one node: ref counts of external hashes per (group, medium)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, str], Counter] = defaultdict(Counter)
        self.epoch = None

    def apply(self, epoch: int, events: list) -> None:
        if epoch != self.epoch:  # a new epoch: the old cache is gone
            self.counts.clear()
            self.epoch = epoch
        for ev in events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    self.counts[(ev.group_idx, ev.medium)][h] += 1
            elif isinstance(ev, BlockRemoved):
                c = self.counts[(ev.group_idx, ev.medium)]
                for h in ev.block_hashes:
                    assert c[h] > 0, f"BlockRemoved for {h} (group {ev.group_idx}, {ev.medium}) never stored"
                    c[h] -= 1
                    if not c[h]:
                        del c[h]
            elif isinstance(ev, AllBlocksCleared):
                for (g, medium) in list(self.counts):
                    if medium == "GPU":
                        del self.counts[(g, medium)]

    def has(self, group: int, medium: str, digest: bytes) -> bool:
        return self.counts[(group, medium)].get(external_hash(digest), 0) > 0


def run_and_check(specs, *, gpu_blocks: int, steps: int, retention, restart_at=None, cpu_chunks=64,
                  prefix_match_unit=None, stats: Counter | None = None, eagle_groups=()):
    sink = CaptureSink()
    workload = SyntheticWorkload(SyntheticConfig(seed=3, num_system_prompts=4, system_prompt_tokens=(48, 160),
                                                 arrivals_per_step=0.6, max_prompt_tokens=512))
    node = Node(NodeConfig(specs=tuple(specs), gpu_blocks=gpu_blocks, cpu_chunks=cpu_chunks,
                           retention=retention, token_budget=128, max_running=8, shape=SMALL,
                           prefix_match_unit=prefix_match_unit, eagle_groups=tuple(eagle_groups)), workload, sink)
    replay = Replay()
    hbs = node.manager.hash_block_size
    prompts: list[list[bytes]] = [hash_request_blocks(node.hasher, p, hbs) for p in workload.system_prompts]
    checked = nonzero = cpu_checked = 0
    applied = 0
    for step in range(steps):
        if step == restart_at:
            node.restart()
            replay.apply(sink.epoch, [])  # on Kafka the new epoch's first envelope (or heartbeat) says so
        result = node.step()
        for st in result.chunks:  # the node's real requests join the sample
            if st.state.req.num_tokens > 1 and len(prompts) < 400:
                prompts.append(list(st.state.req.block_hashes))
        for epoch, events in sink.captured[applied:]:
            replay.apply(epoch, events)
            if stats is not None:
                for ev in events:
                    if isinstance(ev, BlockStored) and ev.block_size == hbs < node.manager.specs[ev.group_idx].block_size:
                        stats[f"partial_stores_group{ev.group_idx}"] += 1
        applied = len(sink.captured)
        for hashes in prompts[-12:] + prompts[:4]:
            max_len = len(hashes) * hbs - 1
            _, node_hit, _ = node.manager.coordinator.find_longest_cache_hit(hashes, max_len)
            replayed = longest_hybrid_hit(node.manager.specs, hashes, hbs,
                                          lambda g, h: replay.has(g, "GPU", h), max_len,
                                          eagle_groups=eagle_groups).length
            assert node_hit == replayed, f"step {step}: node hit {node_hit} != replayed hit {replayed}"
            if stats is not None and node_hit % node.manager.scheduler_block_size:
                stats["hits_between_block_ends"] += 1
            checked += 1
            nonzero += node_hit > 0
            if node.offload is not None:
                for g, spec in enumerate(node.manager.specs):
                    group = OffloadGroup.from_spec(g, spec, 1, hbs)
                    for key in chunk_keys(hashes, group):
                        in_tier = node.offload.tier.lookup(key) is LookupResult.HIT
                        assert in_tier == replay.has(offload_key_group(key), "CPU", offload_key_hash(key)), \
                            f"step {step}: CPU tier and replayed CPU events disagree on a group-{g} chunk"
                        cpu_checked += 1
    return node, checked, nonzero, cpu_checked


@pytest.mark.parametrize("retention", [0, None])
def test_replayed_events_give_the_nodes_own_hit_for_hybrid_fa_swa_mamba(retention) -> None:
    node, checked, nonzero, cpu_checked = run_and_check(
        [FullAttention(16), SlidingWindow(16, 64), Mamba(16)], gpu_blocks=96, steps=150, retention=retention)
    s = node.summary(1.0)
    assert s["events"]["by_type"].get("BlockRemoved", 0) > 0, "pool too large: nothing was evicted"
    assert s["tokens"]["gpu_hit_tokens"] > 0
    assert checked > 1000 and nonzero > 100 and cpu_checked > 1000


def test_replay_survives_a_restart_and_mixed_block_sizes() -> None:
    node, checked, nonzero, _ = run_and_check(
        [FullAttention(32), SlidingWindow(16, 48)], gpu_blocks=80, steps=120, retention=0, restart_at=60,
        cpu_chunks=0)
    assert node.epochs == 2
    assert checked > 500 and nonzero > 50


@pytest.mark.parametrize("specs, unit, retention", [
    ([FullAttention(16), Mamba(64)], None, 0),
    ([FullAttention(16), SlidingWindow(16, 48), Mamba(64)], None, None),
    ([FullAttention(64), Mamba(128)], 16, 0),  # an explicit hash unit below the gcd
])
def test_replay_reproduces_partial_hits_on_a_mamba_align_layout(specs, unit, retention) -> None:
    """Mamba in align mode with a block larger than the hash unit: states at the prompts' last
    hash-unit boundaries are partial entries (one-unit BlockStored, promoted or evicted later), and
    the replayed index gives the node's own hits, which land between block ends."""
    stats: Counter = Counter()
    node, checked, nonzero, _ = run_and_check(specs, gpu_blocks=120, steps=150, retention=retention,
                                              cpu_chunks=0, prefix_match_unit=unit, stats=stats)
    mamba = next(g for g, sp in enumerate(specs) if isinstance(sp, Mamba))
    assert stats[f"partial_stores_group{mamba}"] > 10, stats
    assert stats["hits_between_block_ends"] > 10, stats
    if unit is not None:  # full attention coarser than the unit keys prompt tails too
        assert stats["partial_stores_group0"] > 10, stats
    # what it publishes about itself is a layout the router accepts, with the same hit alignment
    from kvpipe.gpu.layout import layout_problem, node_layout

    cfg = node.hash_config()
    assert cfg.prefix_match_unit == unit and layout_problem(node.group_specs(), cfg) is None
    co = node.manager.coordinator
    assert node_layout(node.group_specs(), cfg).alignment == co.alignment
    assert co.partial_hits and co.alignment == co.hash_block_size < max(s.block_size for s in specs)
    assert checked > 1000 and nonzero > 100
    s = node.summary(1.0)
    assert s["events"]["by_type"].get("BlockRemoved", 0) > 0
    assert s["tokens"]["gpu_hit_tokens"] > 0


@pytest.mark.parametrize("specs, eagle, unit", [
    ([FullAttention(16), SlidingWindow(16, 48)], (0, 1), None),
    ([FullAttention(64), Mamba(128)], (0,), 16),
])
def test_replay_reproduces_eagle_hits(specs, eagle, unit) -> None:
    """EAGLE groups (published with `GroupSpec.eagle`): the replayed index, searched with the
    flags the node publishes, gives the node's own hits."""
    node, checked, nonzero, _ = run_and_check(specs, gpu_blocks=120, steps=120, retention=0, cpu_chunks=0,
                                              prefix_match_unit=unit, eagle_groups=eagle)
    assert [g.eagle for g in node.group_specs()] == [g in eagle for g in range(len(specs))]
    assert checked > 800 and nonzero > 50
