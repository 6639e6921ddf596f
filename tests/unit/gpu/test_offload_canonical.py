"""Canonical uint8 views of the KV caches, per layout."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvpipe.gpu.canonical import canonicalize
from kvpipe.gpu.kv_tensors import AttentionGeometry, KVLayout, MambaGeometry, allocate_kv_caches

NUM_BLOCKS = 12
FA = AttentionGeometry(num_layers=2, block_size=4, num_kv_heads=2, head_size=8)  # page 256 B in fp16
OUTER = AttentionGeometry(num_layers=3, block_size=4, num_kv_heads=2, head_size=8, layout=KVLayout.BLOCK_OUTER)
MAMBA = MambaGeometry(num_layers=2, conv_dim=6, conv_kernel=4, ssm_heads=2, ssm_head_dim=4, d_state=3)


def test_flash_attention_layer_gives_separate_k_and_v_rows_of_half_a_page():
    kv = allocate_kv_caches([FA], NUM_BLOCKS, dtype=torch.float16, device="cpu")
    layer = kv.group(0)[0]
    assert layer.tensor is not None and layer.tensor.shape == (2, NUM_BLOCKS, 4, 2, 8)
    canon = canonicalize(kv)
    assert len(canon.tensors) == 2 * FA.num_layers
    assert [r.part for r in canon.group_refs[0]] == ["k", "v", "k", "v"]
    k_rows = canon.tensors[canon.group_refs[0][0].tensor_idx].tensor
    v_rows = canon.tensors[canon.group_refs[0][1].tensor_idx].tensor
    assert k_rows.dtype == torch.uint8 and k_rows.shape == (NUM_BLOCKS, 128)
    # writing through the typed tensor shows up in the right canonical row, and nowhere else
    layer.tensor[1, 5].fill_(1.0)  # V of block 5
    assert torch.equal(v_rows[5], layer.tensor[1, 5].reshape(-1).view(torch.uint8))
    assert int(v_rows[5].count_nonzero()) > 0
    assert int(k_rows.count_nonzero()) == 0 and int(v_rows[4].count_nonzero()) == 0


def test_block_outermost_layer_is_one_row_per_block():
    kv = allocate_kv_caches([OUTER], NUM_BLOCKS, dtype=torch.bfloat16, device="cpu")
    canon = canonicalize(kv)
    assert len(canon.tensors) == OUTER.num_layers
    for ct, ref in zip(canon.tensors, canon.group_refs[0]):
        assert ct.tensor.dtype == torch.uint8
        assert ct.tensor.shape == (NUM_BLOCKS, 256) and ct.tensor.stride() == (256, 1)
        assert ref.part == "kv" and ref.page_size_bytes == 256
    layer = kv.group(0)[2]
    layer.tensor[7].normal_()
    row = canon.tensors[canon.group_refs[0][2].tensor_idx].tensor[7]
    assert torch.equal(row, layer.tensor[7].reshape(-1).view(torch.uint8))


def test_mamba_rows_cover_padded_page_while_refs_carry_the_unpadded_state_bytes():
    padded = replace(MAMBA, page_size_padded=256)
    kv = allocate_kv_caches([padded], NUM_BLOCKS, dtype=torch.float16, device="cpu")
    conv, ssm = kv.group(0)[0].states
    assert conv.shape == (NUM_BLOCKS, 6, 3) and ssm.shape == (NUM_BLOCKS, 2, 4, 3)
    canon = canonicalize(kv)
    unpadded = (6 * 3 + 2 * 4 * 3) * 2
    assert [ct.page_size_bytes for ct in canon.tensors] == [256, 256]
    assert [r.page_size_bytes for r in canon.group_refs[0]] == [unpadded, unpadded]
    assert canon.group_copy_widths(0) == [(0, unpadded), (1, unpadded)]
    ssm[3].fill_(2.0)
    row = canon.tensors[0].tensor[3]
    assert int(row[:36].count_nonzero()) == 0  # conv part untouched
    assert int(row[36:unpadded].count_nonzero()) > 0 and int(row[unpadded:].count_nonzero()) == 0


def test_groups_overlaying_the_same_buffers_share_canonical_tensors():
    sliding = AttentionGeometry(num_layers=2, block_size=4, num_kv_heads=2, head_size=8)
    kv = allocate_kv_caches([FA, sliding], NUM_BLOCKS, device="cpu", share_across_groups=True)
    canon = canonicalize(kv)
    assert len(canon.tensors) == 4  # 2 buffers x (K, V), not 8
    full_idx = [r.tensor_idx for r in canon.group_refs[0]]
    swa_idx = [r.tensor_idx for r in canon.group_refs[1]]
    assert full_idx == swa_idx
    assert [r.layer_name for r in canon.group_refs[1]] == ["layers.1", "layers.1", "layers.3", "layers.3"]


def test_mamba_and_attention_overlay_keep_distinct_views_because_strides_differ():
    mamba = MambaGeometry(num_layers=1, conv_dim=6, conv_kernel=4, ssm_heads=2, ssm_head_dim=4, d_state=3,
                          page_size_padded=256)
    attn = AttentionGeometry(num_layers=1, block_size=4, num_kv_heads=2, head_size=8)
    kv = allocate_kv_caches([attn, mamba], NUM_BLOCKS, device="cpu", share_across_groups=True)
    canon = canonicalize(kv)
    # same first byte, but K rows step 128 B and Mamba rows 256 B: not the same view
    assert len(canon.tensors) == 3
    assert canon.tensors[0].tensor.data_ptr() == canon.tensors[2].tensor.data_ptr()


def test_sharing_needs_equal_page_sizes():
    with pytest.raises(ValueError, match="page size"):
        allocate_kv_caches([FA, MAMBA], NUM_BLOCKS, device="cpu", share_across_groups=True)


def test_all_layers_of_a_group_form_one_stack_over_the_live_bytes():
    kv = allocate_kv_caches([FA, OUTER], NUM_BLOCKS, dtype=torch.float16, device="cpu")
    canon = canonicalize(kv)
    assert [(s.first, s.count) for s in canon.stacks] == [(0, 4), (4, 3)]  # FA: K, V per layer
    assert canon.stack_of == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2)]
    for t, ct in enumerate(canon.tensors):
        s, pos = canon.stack_of[t]
        view = canon.stacks[s].tensor[pos]
        assert view.data_ptr() == ct.tensor.data_ptr() and view.stride() == ct.tensor.stride()
    kv.group(0)[1].tensor[1, 6].fill_(3.0)  # V of block 6 in the second FA layer = tensor 3
    assert int(canon.stacks[0].tensor[3, 6].count_nonzero()) > 0
    assert int(canon.stacks[0].tensor.count_nonzero()) == int(canon.stacks[0].tensor[3, 6].count_nonzero())


def test_layers_in_separate_buffers_or_with_other_strides_are_not_stacked_together():
    kv = allocate_kv_caches([FA], NUM_BLOCKS, dtype=torch.float16, device="cpu")
    for layer in kv.layers.values():  # one allocation per layer: no equal spacing to rely on
        layer.raw = layer.raw.clone()
        layer.tensor = layer.raw.view(torch.float16).view(layer.tensor.shape)
    assert [(s.first, s.count) for s in canonicalize(kv).stacks] == [(0, 2), (2, 2)]
    mamba = MambaGeometry(num_layers=1, conv_dim=6, conv_kernel=4, ssm_heads=2, ssm_head_dim=4, d_state=3,
                          page_size_padded=256)
    overlay = allocate_kv_caches([FA, mamba], NUM_BLOCKS, device="cpu", share_across_groups=True)
    assert [(s.first, s.count) for s in canonicalize(overlay).stacks] == [(0, 4), (4, 1)]
