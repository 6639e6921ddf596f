"""Offload inside a node run: a prefix stored to the CPU tier, evicted from the GPU by other
traffic, comes back for a later request byte for byte (checked against what the compute wrote)."""
from __future__ import annotations

import pytest

from kvpipe.gpu.hashing import hash_request_blocks
from kvpipe.gpu.node.kv_compute import KVCompute, ModelShape
from kvpipe.gpu.node.node import CaptureSink, Node, NodeConfig
from kvpipe.gpu.node.workload import RequestSpec, TraceWorkload
from kvpipe.gpu.specs import FullAttention, Mamba, SlidingWindow

SMALL = ModelShape(layers_per_group=2, num_kv_heads=1, head_size=8)
HYBRID = (FullAttention(16), SlidingWindow(16, 64), Mamba(16))


def prompt(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 31) % 32000 for i in range(n)]


def scenario(specs, corrupt_host: bool = False) -> tuple[Node, int]:
    shared = prompt(160, 1)
    requests = [RequestSpec("first", shared, max_tokens=2, arrival_step=0)]
    requests += [RequestSpec(f"filler{i}", prompt(160, 10 + i), max_tokens=2, arrival_step=4 + 3 * i)
                 for i in range(8)]
    requests.append(RequestSpec("again", shared + prompt(20, 99), max_tokens=3, arrival_step=60))
    sink = CaptureSink()
    node = Node(NodeConfig(specs=tuple(specs), gpu_blocks=48, cpu_chunks=256, token_budget=256, shape=SMALL),
                TraceWorkload(requests), sink)
    hashes = hash_request_blocks(node.hasher, shared, node.manager.hash_block_size)
    for _ in range(60):
        node.step()
    gpu_hit_before = node.manager.coordinator.find_longest_cache_hit(hashes, len(shared) - 1)[1]
    if corrupt_host:
        for t in node.offload.host.pools:
            t.add_(1)
    for _ in range(10):
        node.step()
    return node, gpu_hit_before


@pytest.mark.parametrize("specs", [HYBRID, (FullAttention(16),)], ids=["fa+swa+mamba", "fa-only"])
def test_prefix_evicted_from_gpu_is_loaded_back_from_cpu_with_the_same_bytes(specs) -> None:
    node, gpu_hit_before = scenario(specs)
    off = node.offload.stats
    tokens = node.scheduler.stats
    assert gpu_hit_before == 0, "the fillers did not evict the shared prefix from the GPU"
    assert tokens.cpu_hit_tokens == 160, "the second request should load the whole 160-token prefix"
    assert off.load_hits == 1 and off.loaded_chunks > 0 and off.loaded_bytes > 0
    assert off.verified_blocks > 0 and off.mismatched_blocks == 0
    assert tokens.finished == 10
    cpu_events = [ev for _, batch in node.sink.captured for ev in batch if ev.medium == "CPU"]
    assert {type(ev).__name__ for ev in cpu_events} >= {"BlockStored"}
    assert {ev.group_idx for ev in cpu_events} == set(range(len(specs)))


def test_corrupted_host_bytes_are_caught_by_the_load_verification() -> None:
    node, _ = scenario(HYBRID, corrupt_host=True)
    off = node.offload.stats
    assert off.load_hits == 1
    assert off.mismatched_blocks > 0 and off.verified_blocks == 0


def test_cpu_events_follow_the_gpu_events_of_their_step() -> None:
    node, _ = scenario(HYBRID)
    for _, batch in node.sink.captured:
        media = [ev.medium for ev in batch if hasattr(ev, "medium")]
        assert media == sorted(media, key=lambda m: m != "GPU"), f"CPU event before a GPU event in {media}"


def test_block_bytes_depend_on_group_and_hash_only() -> None:
    kv = KVCompute([FullAttention(16), SlidingWindow(16, 64), Mamba(16)], 8, SMALL)
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    kv.write(0, [1, 2], [h1, h2])
    kv.write(1, [1], [h1])
    kv.write(2, [3], [h2])
    assert kv.mismatched(0, [1, 2], [h1, h2]) == []
    assert kv.mismatched(0, [2, 1], [h1, h2]) == [0, 1]
    assert kv.mismatched(1, [1], [h1]) == [] and kv.mismatched(2, [3], [h2]) == []
    assert [r.tolist() for r in kv.expected_rows(0, [h1])] != [r.tolist() for r in kv.expected_rows(1, [h1])]
