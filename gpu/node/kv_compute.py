"""The node's "forward pass": real KV tensors per group, filled with bytes anyone can predict.

A block's content is a pure function of `(group, block hash)`: per canonical tensor the group
touches, a fixed random row of the group (`base`) XOR-ed word by word with the first 8 bytes of
the block's hash. The hash is chained over the whole prefix, so equal content means equal prefix
— exactly the property real KV has. That is what makes offload checkable end to end: bytes loaded
back from the CPU tier must equal `expected_rows(group, hash)`, whatever blocks they went through.

Only *full* blocks are written (they are the only ones cached, offloaded or hit); partial tail
blocks keep stale bytes, which nobody reads. Writes are one `index_copy_` per canonical tensor per
group per step (vectorised over blocks), never a Python loop per block.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpipe.gpu.canonical import CanonicalCaches, canonicalize
from kvpipe.gpu.kv_tensors import AttentionGeometry, Geometry, KVLayout, MambaGeometry, allocate_kv_caches
from kvpipe.gpu.offload_checks import device_block_checksums, row_checksums
from kvpipe.gpu.specs import KVSpec, Mamba


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A deliberately small model so a node runs on a CPU: a few layers per group, few heads."""

    layers_per_group: int = 2
    num_kv_heads: int = 2
    head_size: int = 16
    layout: KVLayout = KVLayout.FLASH_ATTN
    mamba_conv_dim: int = 64
    mamba_conv_kernel: int = 4
    mamba_heads: int = 2
    mamba_head_dim: int = 16
    mamba_d_state: int = 16
    dtype: torch.dtype = torch.float16

    def geometry(self, spec: KVSpec) -> Geometry:
        if isinstance(spec, Mamba):
            return MambaGeometry(self.layers_per_group, self.mamba_conv_dim, self.mamba_conv_kernel,
                                 self.mamba_heads, self.mamba_head_dim, self.mamba_d_state)
        return AttentionGeometry(self.layers_per_group, spec.block_size, self.num_kv_heads,
                                 self.head_size, self.layout)


def block_seed(digest: bytes) -> int:
    """The per-block word mixed into the group's base row (signed: it goes into an int64 tensor)."""
    return int.from_bytes(digest[:8], "little", signed=True)


class KVCompute:
    """KV tensors of every group plus the deterministic writer/verifier over their canonical views."""

    def __init__(self, specs: Sequence[KVSpec], num_blocks: int, shape: ModelShape | None = None,
                 device: str | torch.device = "cpu") -> None:
        self.shape = shape or ModelShape()
        self.specs = list(specs)
        self.caches = allocate_kv_caches([self.shape.geometry(s) for s in self.specs], num_blocks,
                                         dtype=self.shape.dtype, device=device)
        self.canonical: CanonicalCaches = canonicalize(self.caches)
        self._widths = [self.canonical.group_copy_widths(g) for g in range(len(self.specs))]
        # One base row per (group, canonical tensor): the group salt, so two groups that hold
        # the same hash (the FA and SWA blocks of one prefix) get different bytes.
        self._base: list[list[torch.Tensor]] = []
        for g, widths in enumerate(self._widths):
            gen = torch.Generator().manual_seed(1_000_003 * (g + 1))
            self._base.append([torch.randint(-(2 ** 62), 2 ** 62, (-(-w // 8),), generator=gen, dtype=torch.int64)
                               for _, w in widths])
        self.blocks_written = 0

    @property
    def bytes_per_block(self) -> list[int]:
        return [self.canonical.group_bytes_per_block(g) for g in range(len(self.specs))]

    def expected_rows(self, group_idx: int, digests: Sequence[bytes]) -> list[torch.Tensor]:
        """Per canonical tensor of the group (in `group_copy_widths` order): uint8 `(n, width)`."""
        seeds = torch.tensor([block_seed(d) for d in digests], dtype=torch.int64)
        out = []
        for base, (_, width) in zip(self._base[group_idx], self._widths[group_idx]):
            words = base.unsqueeze(0) ^ seeds.unsqueeze(1)
            out.append(words.view(torch.uint8)[:, :width])
        return out

    def write(self, group_idx: int, block_ids: Sequence[int], digests: Sequence[bytes]) -> None:
        """Compute the blocks: write the expected bytes of `digests[i]` into block `block_ids[i]`."""
        if not block_ids:
            return
        idx = torch.as_tensor(list(block_ids), dtype=torch.int64, device=self.caches.device)
        for rows, (t_idx, width) in zip(self.expected_rows(group_idx, digests), self._widths[group_idx]):
            view = self.canonical.tensors[t_idx].tensor[:, :width]
            view.index_copy_(0, idx, rows.to(view.device))
        self.blocks_written += len(block_ids)

    def expected_checksums(self, group_idx: int, digests: Sequence[bytes]) -> torch.Tensor:
        """Same shape and order as `kvpipe.gpu.offload_checks.device_block_checksums`."""
        return torch.stack([row_checksums(r) for r in self.expected_rows(group_idx, digests)], dim=1)

    def mismatched(self, group_idx: int, block_ids: Sequence[int], digests: Sequence[bytes]) -> list[int]:
        """Positions `i` whose device block `block_ids[i]` does not hold `digests[i]`'s bytes."""
        if not block_ids:
            return []
        have = device_block_checksums(self.canonical, group_idx, block_ids)
        want = self.expected_checksums(group_idx, digests)
        bad = (have != want).flatten(1).any(dim=1)
        return bad.nonzero().flatten().tolist()

    def reset(self) -> None:
        """A restarted node: every byte gone."""
        for layer in self.caches.layers.values():
            layer.raw.zero_()
