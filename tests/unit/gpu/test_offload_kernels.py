"""Batched block copies device -> host -> device, verified byte for byte with checksums."""
from __future__ import annotations

import pytest
import torch

from kvpipe.gpu.canonical import canonicalize
from kvpipe.gpu.kv_tensors import AttentionGeometry, KVLayout, MambaGeometry, allocate_kv_caches, default_device
from kvpipe.gpu.offload import BlockMover, GroupTransfer, allocate_host_buffers
from kvpipe.gpu.offload_checks import device_block_checksums, host_block_checksums, row_checksums

NUM_BLOCKS = 40
GROUPS = [
    AttentionGeometry(num_layers=3, block_size=4, num_kv_heads=2, head_size=8),  # FlashAttention
    AttentionGeometry(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, layout=KVLayout.BLOCK_OUTER),
    MambaGeometry(num_layers=2, conv_dim=6, conv_kernel=4, ssm_heads=2, ssm_head_dim=4, d_state=3,
                  page_size_padded=512),
]


def _filled(dtype=torch.float16, blocks_per_chunk=2, num_chunks=16, share=False, groups=GROUPS):
    kv = allocate_kv_caches(groups, NUM_BLOCKS, dtype=dtype, device=default_device(), share_across_groups=share)
    gen = torch.Generator(device="cpu").manual_seed(7)
    for layer in kv.layers.values():
        layer.raw.copy_(torch.randint(0, 256, layer.raw.shape, dtype=torch.uint8, generator=gen))
    canon = canonicalize(kv)
    host = allocate_host_buffers(canon, num_chunks, blocks_per_chunk)
    return kv, canon, host, BlockMover(canon, host)


def _wipe(kv):
    for layer in kv.layers.values():
        layer.raw.zero_()


def test_checksums_see_a_single_flipped_byte_and_a_swap_of_words():
    rows = torch.randint(0, 256, (3, 64), dtype=torch.uint8)
    base = row_checksums(rows)
    flipped = rows.clone()
    flipped[1, 17] ^= 1
    swapped = rows.clone()
    swapped[2, 0:4], swapped[2, 4:8] = rows[2, 4:8].clone(), rows[2, 0:4].clone()
    assert not torch.equal(row_checksums(flipped)[1], base[1])
    assert torch.equal(row_checksums(flipped)[0], base[0])
    if not torch.equal(rows[2, 0:4], rows[2, 4:8]):
        assert not torch.equal(row_checksums(swapped)[2], base[2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scattered_blocks_of_three_groups_round_trip_byte_exact(dtype):
    kv, canon, host, mover = _filled(dtype=dtype)
    transfers = [
        GroupTransfer(0, [17, 3, 29, 8, 30], [5, 2, 9]),          # 5 blocks, last chunk half used
        GroupTransfer(1, [0, 39, 21, 22], [0, 7]),
        GroupTransfer(2, [11, 2, 35], [12, 3], skip=1),           # first chunk partially covered
    ]
    before = [device_block_checksums(canon, t.group_idx, t.gpu_block_ids) for t in transfers]
    handle = mover.store(transfers)
    handle.wait()
    assert handle.done()
    for t, sums in zip(transfers, before):
        assert torch.equal(host_block_checksums(canon, host, t), sums), f"group {t.group_idx} host copy"

    _wipe(kv)
    moved = [GroupTransfer(t.group_idx, [(b * 7 + 1) % NUM_BLOCKS for b in t.gpu_block_ids], t.cpu_chunk_ids, t.skip)
             for t in transfers]
    mover.load(moved).wait()
    for t, sums in zip(moved, before):
        assert torch.equal(device_block_checksums(canon, t.group_idx, t.gpu_block_ids), sums)
    # nothing else was written: the other blocks are still zero
    touched = {(t.group_idx, b) for t in moved for b in t.gpu_block_ids}
    for g, names in enumerate(kv.group_layers):
        untouched = [b for b in range(NUM_BLOCKS) if (g, b) not in touched]
        assert int(device_block_checksums(canon, g, untouched).abs().sum()) == 0


def test_store_lands_each_block_in_its_chunk_slot_after_the_skip():
    kv, canon, host, mover = _filled(blocks_per_chunk=4)
    mover.store([GroupTransfer(1, [5, 6, 7], [3], skip=1)]).wait()
    t_idx, width = canon.group_copy_widths(1)[0]
    host_rows = host.rows(t_idx)
    dev_rows = canon.tensors[t_idx].tensor.cpu()  # host rows are on the CPU whatever the device
    assert torch.equal(host_rows[3 * 4 + 1], dev_rows[5])
    assert torch.equal(host_rows[3 * 4 + 3], dev_rows[7])
    assert int(host_rows[3 * 4].count_nonzero()) == 0  # the skipped slot is not written


def test_fragmented_chunk_ids_take_the_staging_path_and_stay_exact():
    kv, canon, host, mover = _filled(blocks_per_chunk=1, num_chunks=32)
    blocks = list(range(0, 40, 2))[:16]
    chunks = [31, 4, 17, 0, 9, 22, 13, 27, 2, 19, 6, 25, 11, 29, 15, 8]  # no two adjacent
    t = GroupTransfer(0, blocks, chunks)
    sums = device_block_checksums(canon, 0, blocks)
    mover.store([t]).wait()
    assert torch.equal(host_block_checksums(canon, host, t), sums)
    _wipe(kv)
    mover.load([t]).wait()
    assert torch.equal(device_block_checksums(canon, 0, blocks), sums)


def test_overlaid_groups_move_their_own_blocks_of_the_shared_buffers():
    attn = AttentionGeometry(num_layers=2, block_size=4, num_kv_heads=2, head_size=8)
    kv, canon, host, mover = _filled(share=True, groups=[attn, attn], blocks_per_chunk=1)
    transfers = [GroupTransfer(0, [1, 2, 3], [0, 1, 2]), GroupTransfer(1, [10, 30], [3, 4])]
    sums = [device_block_checksums(canon, t.group_idx, t.gpu_block_ids) for t in transfers]
    mover.store(transfers).wait()
    _wipe(kv)
    mover.load(transfers).wait()
    for t, s in zip(transfers, sums):
        assert torch.equal(device_block_checksums(canon, t.group_idx, t.gpu_block_ids), s)


def test_bad_chunk_count_is_rejected_with_the_group_named():
    _, _, _, mover = _filled(blocks_per_chunk=2)
    with pytest.raises(ValueError, match="group 1: 3 blocks after skip 0 span 2 chunks"):
        mover.store([GroupTransfer(1, [1, 2, 3], [0])])
    with pytest.raises(ValueError, match="chunk ids"):
        mover.store([GroupTransfer(1, [1, 2], [99])])
