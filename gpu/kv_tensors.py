"""KV cache tensors of a simulated node, allocated in the layouts real attention backends use.

Only memory geometry lives here (how many bytes a block takes and where they sit); which attention
type a group serves is `kvpipe.gpu.specs`'s business. The offload path never looks at these typed tensors
directly: `kvpipe.gpu.canonical` turns them into uint8 `(num_blocks, page_bytes)` views first.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


class KVLayout(enum.Enum):
    """Where the block index sits in an attention layer's cache tensor."""

    # FlashAttention's `(2, num_blocks, block_size, kv_heads, head_dim)`: K and V of one block are
    # `num_blocks` pages apart, so a block is two separate byte runs.
    FLASH_ATTN = "flash_attn"
    # `(num_blocks, 2, block_size, kv_heads, head_dim)`: one contiguous byte run per block (the
    # layout vLLM standardised on, RFC #42082).
    BLOCK_OUTER = "block_outer"


@dataclass(frozen=True, slots=True)
class AttentionGeometry:
    """Per-layer cache geometry of an attention group (full, sliding window, chunked local)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    layout: KVLayout = KVLayout.FLASH_ATTN

    def page_size_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one block of one layer, K and V together."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * _itemsize(dtype)


@dataclass(frozen=True, slots=True)
class MambaGeometry:
    """Per-layer state geometry of a Mamba group: one conv and one SSM state per block.

    `page_size_padded` lets the page grow to the attention page size, as vLLM pads Mamba pages so
    that hybrid models can share one tensor pool; the padding is never transferred meaningfully
    and is excluded from the unpadded page size the canonical refs carry.
    """

    num_layers: int
    conv_dim: int
    conv_kernel: int  # the conv state keeps `conv_kernel - 1` past inputs
    ssm_heads: int
    ssm_head_dim: int
    d_state: int
    page_size_padded: int | None = None

    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.ssm_heads, self.ssm_head_dim, self.d_state)

    def unpadded_page_size_bytes(self, dtype: torch.dtype) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1)
        ssm = self.ssm_heads * self.ssm_head_dim * self.d_state
        return (conv + ssm) * _itemsize(dtype)

    def page_size_bytes(self, dtype: torch.dtype) -> int:
        unpadded = self.unpadded_page_size_bytes(dtype)
        if self.page_size_padded is None:
            return unpadded
        if self.page_size_padded < unpadded:
            raise ValueError(
                f"MambaGeometry: page_size_padded={self.page_size_padded} is smaller than the "
                f"state bytes per block ({unpadded})")
        return self.page_size_padded


Geometry = AttentionGeometry | MambaGeometry


@dataclass(slots=True)
class LayerKVCache:
    """One layer's cache. `raw` is the uint8 buffer of its bytes (a slice of one allocation per
    group, or of the shared one, whose slices other groups' layers may view too); `tensor` (attention) or `states` (Mamba: conv, ssm) are the typed
    views a model would write through."""

    name: str
    group_idx: int
    geometry: Geometry
    raw: torch.Tensor
    tensor: torch.Tensor | None = None
    states: tuple[torch.Tensor, ...] = ()
    page_size_bytes: int = 0
    unpadded_page_size_bytes: int = 0

    @property
    def is_mamba(self) -> bool:
        return isinstance(self.geometry, MambaGeometry)


@dataclass(slots=True)
class KVCacheTensors:
    """All layers of all groups; `group_layers[g]` lists group g's layer names in layer order."""

    num_blocks: int
    dtype: torch.dtype
    device: torch.device
    layers: dict[str, LayerKVCache] = field(default_factory=dict)
    group_layers: list[list[str]] = field(default_factory=list)

    def group(self, group_idx: int) -> list[LayerKVCache]:
        return [self.layers[name] for name in self.group_layers[group_idx]]


def default_device() -> torch.device:
    """CUDA when a GPU is present, else the CPU (the offload API behaves the same on both)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def allocate_kv_caches(
    groups: Sequence[Geometry],
    num_blocks: int,
    *,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str | None = None,
    share_across_groups: bool = False,
) -> KVCacheTensors:
    """Allocate every layer of every group, zero-filled.

    With `share_across_groups`, layer j of every group views the same raw buffer j, the way
    vLLM's hybrid allocator overlays groups (the block pool hands each block id to one group
    only, so the overlay never collides). It requires equal page sizes across groups.
    Layer names interleave groups (`layers.{j * num_groups + g}`) like a hybrid model's stack.

    Each group's layers (or, with sharing, the shared buffers) are consecutive slices of one
    allocation, so their canonical views sit at equal distances and `kvpipe.gpu.canonical` can
    cover all layers with one strided view: one gather moves a block set of every layer at once.
    """
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"allocate_kv_caches: dtype must be float16, bfloat16 or float32, got {dtype}")
    if num_blocks <= 0:
        raise ValueError(f"allocate_kv_caches: num_blocks must be positive, got {num_blocks}")
    dev = torch.device(device) if device is not None else default_device()
    pages = [g.page_size_bytes(dtype) for g in groups]
    shared: list[torch.Tensor] = []
    if share_across_groups:
        if len(set(pages)) != 1:
            raise ValueError(
                f"allocate_kv_caches: sharing buffers across groups needs one page size, got "
                f"{pages} bytes per group (pad the Mamba page with page_size_padded)")
        shared = _layer_buffers(max(g.num_layers for g in groups), num_blocks * pages[0], dev)
    out = KVCacheTensors(num_blocks=num_blocks, dtype=dtype, device=dev)
    for g_idx, geometry in enumerate(groups):
        _check_items(geometry, dtype)
        own = shared or _layer_buffers(geometry.num_layers, num_blocks * pages[g_idx], dev)
        names: list[str] = []
        for j in range(geometry.num_layers):
            name = f"layers.{j * len(groups) + g_idx}"
            raw = own[j]
            out.layers[name] = _build_layer(name, g_idx, geometry, raw, num_blocks, dtype)
            names.append(name)
        out.group_layers.append(names)
    return out


def _layer_buffers(count: int, nbytes: int, device: torch.device) -> list[torch.Tensor]:
    """`count` zeroed uint8 buffers of `nbytes`, back to back in one allocation."""
    pool = torch.zeros(count * nbytes, dtype=torch.uint8, device=device)
    return list(pool.split(nbytes))


def _check_items(geometry: Geometry, dtype: torch.dtype) -> None:
    # Checked before any typed view: a layer buffer starts at a multiple of the page inside its
    # pool, so an odd page would misalign the typed view of every later layer.
    page = geometry.page_size_bytes(dtype)
    if page % _itemsize(dtype):
        raise ValueError(f"{type(geometry).__name__}: page of {page} bytes is not a whole number of "
                         f"{dtype} items")


def _build_layer(name: str, group_idx: int, geometry: Geometry, raw: torch.Tensor,
                 num_blocks: int, dtype: torch.dtype) -> LayerKVCache:
    typed = raw.view(dtype)
    page = geometry.page_size_bytes(dtype)
    if isinstance(geometry, AttentionGeometry):
        inner = (geometry.block_size, geometry.num_kv_heads, geometry.head_size)
        shape = ((2, num_blocks, *inner) if geometry.layout is KVLayout.FLASH_ATTN
                 else (num_blocks, 2, *inner))
        return LayerKVCache(name, group_idx, geometry, raw, tensor=typed.view(shape),
                            page_size_bytes=page, unpadded_page_size_bytes=page)
    # Mamba: each block's page is [conv state | ssm state | padding]; the typed state views
    # stride over whole (padded) pages, exactly as the raw rows do.
    itemsize = _itemsize(dtype)
    rows = typed.view(num_blocks, page // itemsize)
    conv_elems = geometry.conv_dim * (geometry.conv_kernel - 1)
    ssm_elems = geometry.ssm_heads * geometry.ssm_head_dim * geometry.d_state
    conv = rows[:, :conv_elems].unflatten(1, geometry.conv_shape())
    ssm = rows[:, conv_elems:conv_elems + ssm_elems].unflatten(1, geometry.ssm_shape())
    return LayerKVCache(name, group_idx, geometry, raw, states=(conv, ssm), page_size_bytes=page,
                        unpadded_page_size_bytes=geometry.unpadded_page_size_bytes(dtype))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
