"""Layouts, chunk patterns and a plain per-tensor reference copy for the offload tests.

Every layout is allocated twice with the same random bytes: `BlockMover` moves blocks of one copy,
the reference (`reference_store` / `reference_load`: one Python assignment per canonical tensor and
block, the semantics the per-tensor mover had) moves the same blocks of the twin, and then every
byte of both caches and both host buffers must agree (`assert_same`), untouched rows and padding
included.
"""
from __future__ import annotations

import numpy as np
import torch

from kvpipe.gpu.canonical import CanonicalCaches, canonicalize
from kvpipe.gpu.kv_tensors import AttentionGeometry, KVCacheTensors, KVLayout, MambaGeometry, allocate_kv_caches
from kvpipe.gpu.offload import GroupTransfer, HostBuffers, allocate_host_buffers

NUM_BLOCKS = 48
NUM_CHUNKS = 40
FA = AttentionGeometry(num_layers=3, block_size=4, num_kv_heads=2, head_size=8)  # 256 B pages in fp16
FA2 = AttentionGeometry(num_layers=2, block_size=4, num_kv_heads=2, head_size=8)
OUTER = AttentionGeometry(num_layers=3, block_size=8, num_kv_heads=2, head_size=8, layout=KVLayout.BLOCK_OUTER)
MAMBA = MambaGeometry(num_layers=2, conv_dim=6, conv_kernel=4, ssm_heads=2, ssm_head_dim=4, d_state=3,
                      page_size_padded=256)

# name -> (groups, share_across_groups, allocate every layer separately)
LAYOUTS = {
    "flash_attn": ([FA], False, False),
    "block_outer": ([OUTER], False, False),
    "hybrid_mixed_block_sizes": ([FA, OUTER, MAMBA], False, False),
    "overlaid_4_and_2_layers": ([AttentionGeometry(4, 4, 2, 8), FA2], True, False),
    "overlaid_attention_and_mamba": ([FA2, MAMBA], True, False),
    "layers_allocated_one_by_one": ([FA, OUTER], False, True),
}
PATTERNS = ["fresh", "permuted", "fragmented_host", "fragmented_both"]


def allocate(name: str, seed: int) -> KVCacheTensors:
    groups, share, separate = LAYOUTS[name]
    kv = allocate_kv_caches(groups, NUM_BLOCKS, dtype=torch.float16, device="cpu", share_across_groups=share)
    if separate:  # a buffer per layer: canonical stacks can then span one layer only
        for layer in kv.layers.values():
            layer.raw = layer.raw.clone()
            layer.tensor = layer.raw.view(kv.dtype).view(layer.tensor.shape)
    gen = torch.Generator().manual_seed(seed)
    for layer in kv.layers.values():
        layer.raw.copy_(torch.randint(0, 256, layer.raw.shape, dtype=torch.uint8, generator=gen))
    return kv


def twins(name: str, bpc: int, seed: int, pin: bool | None = None):
    """Mover side and reference side, byte-identical: caches, canonical views, host rows."""
    kv, twin = allocate(name, seed), allocate(name, seed)
    canon, ref_canon = canonicalize(kv), canonicalize(twin)
    host = allocate_host_buffers(canon, NUM_CHUNKS, bpc, pin=pin)
    gen = torch.Generator().manual_seed(seed + 1)
    for pool in host.pools:
        pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8, generator=gen))
    ref_host = [host.rows(t).clone() for t in range(len(canon.tensors))]
    return kv, twin, canon, ref_canon, host, ref_host


def transfers(name: str, pattern: str, bpc: int, rng: np.random.Generator) -> list[GroupTransfer]:
    """One transfer per group; groups get disjoint blocks and chunks (as the pools hand them out)."""
    groups = LAYOUTS[name][0]
    blocks = rng.permutation(NUM_BLOCKS)
    per_group_chunks, per_group_blocks = NUM_CHUNKS // len(groups), NUM_BLOCKS // len(groups)
    out = []
    for g in range(len(groups)):
        n_chunks = int(rng.integers(2, min(8, per_group_chunks // 2, per_group_blocks // bpc) + 1))
        own = np.arange(g * per_group_chunks, (g + 1) * per_group_chunks)
        if pattern == "fresh":
            chunks = own[:n_chunks]
        elif pattern == "permuted":
            chunks = rng.permutation(own[:n_chunks])
        else:  # every other chunk id: no two adjacent, in random order
            chunks = rng.permutation(own[::2])[:n_chunks]
        skip = int(rng.integers(0, bpc))
        n = n_chunks * bpc - skip - int(rng.integers(0, bpc))  # last chunk may be partly covered
        if pattern == "fragmented_host":  # adjacent device blocks (the dev-runs path)
            start = int(rng.integers(0, per_group_blocks - n + 1)) + g * per_group_blocks
            ids = np.arange(start, start + n)
        else:
            ids = blocks[g::len(groups)][:n]
        out.append(GroupTransfer(g, [int(b) for b in ids], [int(c) for c in chunks], skip))
    return out


def _widths(canon: CanonicalCaches, transfers: list[GroupTransfer]) -> dict[int, int]:
    """Each tensor moves the widest row any group of the call uses on it."""
    widths: dict[int, int] = {}
    for tr in transfers:
        for t, w in canon.group_copy_widths(tr.group_idx):
            widths[t] = max(widths.get(t, 0), w)
    return widths


def reference_store(canon: CanonicalCaches, ref_host: list[torch.Tensor], transfers, bpc: int) -> None:
    widths = _widths(canon, transfers)
    for tr in transfers:
        for t, _ in canon.group_copy_widths(tr.group_idx):
            w = widths[t]
            for d, h in zip(tr.gpu_block_ids, tr.host_rows(bpc)):
                ref_host[t][h, :w] = canon.tensors[t].tensor[d, :w]


def reference_load(canon: CanonicalCaches, ref_host: list[torch.Tensor], transfers, bpc: int) -> None:
    widths = _widths(canon, transfers)
    for tr in transfers:
        for t, _ in canon.group_copy_widths(tr.group_idx):
            w = widths[t]
            for d, h in zip(tr.gpu_block_ids, tr.host_rows(bpc)):
                canon.tensors[t].tensor[d, :w] = ref_host[t][h, :w]


def assert_same(kv, twin, host: HostBuffers, ref_host: list[torch.Tensor]) -> None:
    for name, layer in kv.layers.items():
        assert torch.equal(layer.raw, twin.layers[name].raw), f"device bytes of {name}"
    for t, rows in enumerate(ref_host):
        assert torch.equal(host.rows(t), rows), f"host rows of canonical tensor {t}"
