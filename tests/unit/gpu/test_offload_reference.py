"""The stacked offload path against a plain per-tensor, per-row reference copy, byte for byte
(`offload_fixtures`). The chunk patterns cover each execution path: host rows in few runs (fresh or
permuted chunk ids), fragmented host rows over adjacent device blocks, and fragmented rows on both
sides (staging). A last test checks the op count of a call does not depend on the layer count.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpipe.gpu.canonical import canonicalize
from kvpipe.gpu.kv_tensors import AttentionGeometry, KVLayout, allocate_kv_caches
from kvpipe.gpu.offload import BlockMover, GroupTransfer, allocate_host_buffers
from kvpipe.gpu.offload_checks import count_dispatched_ops
from tests.unit.gpu.offload_fixtures import (
    LAYOUTS, NUM_BLOCKS, NUM_CHUNKS, PATTERNS, assert_same, reference_load, reference_store, transfers, twins,
)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("bpc", [1, 2, 4])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_store_then_load_match_the_per_tensor_reference(name, pattern, bpc, seed):
    kv, twin, canon, ref_canon, host, ref_host = twins(name, bpc, seed)
    rng = np.random.default_rng(seed)
    mover = BlockMover(canon, host)
    stored = transfers(name, pattern, bpc, rng)
    assert mover.store(stored).done()
    reference_store(ref_canon, ref_host, stored, bpc)
    assert_same(kv, twin, host, ref_host)
    # load the chunks back into the same blocks in another pairing, so loaded rows overwrite
    # bytes that mostly differ from them
    loaded = [GroupTransfer(tr.group_idx, [int(b) for b in rng.permutation(tr.gpu_block_ids)[::-1]],
                            tr.cpu_chunk_ids, tr.skip) for tr in stored]
    mover.load(loaded).wait()
    reference_load(ref_canon, ref_host, loaded, bpc)
    assert_same(kv, twin, host, ref_host)


@pytest.mark.parametrize("name", ["flash_attn", "hybrid_mixed_block_sizes", "overlaid_4_and_2_layers"])
def test_a_round_trip_restores_the_stored_blocks_in_new_places(name):
    kv, _, canon, _, host, _ = twins(name, 2, 5)
    rng = np.random.default_rng(5)
    mover = BlockMover(canon, host)
    stored = transfers(name, "permuted", 2, rng)
    expected = [[canon.tensors[t].tensor[tr.gpu_block_ids, :w].clone()
                 for t, w in canon.group_copy_widths(tr.group_idx)] for tr in stored]
    mover.store(stored).wait()
    for layer in kv.layers.values():
        layer.raw.zero_()
    moved = [GroupTransfer(tr.group_idx, [(b * 5 + 3) % NUM_BLOCKS for b in tr.gpu_block_ids], tr.cpu_chunk_ids,
                           tr.skip) for tr in stored]
    mover.load(moved).wait()
    for tr, rows in zip(moved, expected):
        for (t, w), want in zip(canon.group_copy_widths(tr.group_idx), rows):
            assert torch.equal(canon.tensors[t].tensor[tr.gpu_block_ids, :w], want)


def _steady_ops(layers: int, layout: KVLayout, pattern: str) -> tuple[int, int]:
    geometry = AttentionGeometry(layers, 4, 2, 8, layout=layout)
    canon = canonicalize(allocate_kv_caches([geometry], NUM_BLOCKS, device="cpu"))
    mover = BlockMover(canon, allocate_host_buffers(canon, NUM_CHUNKS, 1))
    rng = np.random.default_rng(3)
    blocks = list(range(8, 24)) if pattern == "fragmented_host" else [int(b) for b in rng.permutation(NUM_BLOCKS)[:16]]
    fragmented = [int(c) for c in rng.permutation(np.arange(0, 32, 2))]
    chunks = {"fresh": list(range(16)), "permuted": [int(c) for c in rng.permutation(16)],
              "fragmented_host": fragmented, "fragmented_both": fragmented}[pattern]
    transfer = GroupTransfer(0, blocks, chunks)
    mover.store([transfer])
    mover.load([transfer])  # first calls build and cache the stacked views
    return (count_dispatched_ops(lambda: mover.store([transfer]))[0],
            count_dispatched_ops(lambda: mover.load([transfer]))[0])


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_ops_dispatched_per_call_do_not_grow_with_the_layer_count(layout, pattern):
    one, many = _steady_ops(1, layout, pattern), _steady_ops(24, layout, pattern)
    assert one == many, f"{pattern}: store/load ops {one} with 1 layer, {many} with 24"
