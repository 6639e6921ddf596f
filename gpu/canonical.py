"""Canonical byte views of the KV caches: what the offload kernels see instead of typed layouts.

Every cache, whatever its layout and dtype, is exposed as 2-D **torch.uint8** tensors of shape
`(num_blocks, page_size_bytes)` whose row `b` is the bytes of block `b`. They are views (no copy)
built with `as_strided` over the cache's own storage, with the row stride equal to the layout's
block stride, so writing a row writes the live cache.

One dtype only: uint8 everywhere, never a mix of int8 and the cache's float dtype (a documented
int8 tensor that is really float16 misleads every consumer that sizes buffers by element count).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvpipe.gpu.kv_tensors import KVCacheTensors, KVLayout, LayerKVCache


@dataclass(frozen=True, slots=True)
class CanonicalTensor:
    """A uint8 `(num_blocks, page_size_bytes)` view; `page_size_bytes` is the row width, which
    includes any padding (e.g. a Mamba page padded to the attention page size)."""

    tensor: torch.Tensor
    page_size_bytes: int


@dataclass(frozen=True, slots=True)
class CanonicalRef:
    """One layer's share of a canonical tensor: the first `page_size_bytes` (unpadded) bytes of
    each row of `tensors[tensor_idx]`. `part` says which part of the layer it is: "kv" (K and V
    together), "k", "v" (FlashAttention halves) or "state" (Mamba conv + ssm)."""

    tensor_idx: int
    page_size_bytes: int
    layer_name: str
    part: str


@dataclass(frozen=True, slots=True)
class CanonicalStack:
    """Canonical tensors `first .. first + count - 1` seen as one uint8 `(count, num_blocks,
    page_size_bytes)` view: equal rows, one storage, equal distances between the tensors.

    Layers allocated back to back (`allocate_kv_caches`) give one stack per group however many
    layers it has (FlashAttention's K and V rows interleave at equal distances too), so a gather
    along dim 1 moves a block set of every layer in one op. Tensors that share no such spacing
    (buffers allocated one by one) are stacks of one."""

    tensor: torch.Tensor
    first: int
    count: int

    @property
    def page_size_bytes(self) -> int:
        return self.tensor.shape[2]


@dataclass(slots=True)
class CanonicalCaches:
    """All canonical tensors plus, per group, the refs of its layers in layer order.

    Invariants: every tensor has `num_blocks` rows and dtype uint8; layers whose views alias the
    same bytes (same data_ptr and strides) share one tensor, so a block is moved once however many
    layers overlay it; a ref's page size never exceeds its tensor's row width.

    FlashAttention layouts give **two** tensors per layer (K rows and V rows) because the K and V
    halves of a block are `num_blocks` pages apart: no single 2-D strided view covers both, and
    a gather on two views is as cheap as on one. Block-outermost layouts and Mamba give one.
    """

    num_blocks: int
    tensors: list[CanonicalTensor]
    group_refs: list[list[CanonicalRef]]
    stacks: list[CanonicalStack] = field(default_factory=list)
    # tensor index -> (stack index, position in the stack)
    stack_of: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.stacks:
            self.stacks = stack_tensors(self.tensors)
        self.stack_of = [(s, pos) for s, st in enumerate(self.stacks) for pos in range(st.count)]

    def group_copy_widths(self, group_idx: int) -> list[tuple[int, int]]:
        """`(tensor_idx, bytes per row to move)` for a group, each tensor once, in first-use
        order. The width is the widest unpadded ref of the group on that tensor."""
        widths: dict[int, int] = {}
        for ref in self.group_refs[group_idx]:
            widths[ref.tensor_idx] = max(widths.get(ref.tensor_idx, 0), ref.page_size_bytes)
        return list(widths.items())

    def group_bytes_per_block(self, group_idx: int) -> int:
        """Bytes one block of the group occupies across all its layers, padding excluded."""
        return sum(width for _, width in self.group_copy_widths(group_idx))


def canonicalize(caches: KVCacheTensors) -> CanonicalCaches:
    """Build the canonical views of every group's layers (see `CanonicalCaches`)."""
    tensors: list[CanonicalTensor] = []
    by_alias: dict[tuple[int, tuple[int, ...]], int] = {}
    group_refs: list[list[CanonicalRef]] = []
    for names in caches.group_layers:
        refs: list[CanonicalRef] = []
        for name in names:
            for view, unpadded, part in layer_byte_views(caches.layers[name], caches.num_blocks):
                alias = (view.data_ptr(), tuple(view.stride()))
                idx = by_alias.get(alias)
                if idx is None:
                    idx = len(tensors)
                    by_alias[alias] = idx
                    tensors.append(CanonicalTensor(view, view.shape[1]))
                elif tensors[idx].page_size_bytes != view.shape[1]:
                    raise ValueError(
                        f"{name} ({part}) aliases canonical tensor {idx} with a row of "
                        f"{view.shape[1]} bytes, but that tensor's rows are "
                        f"{tensors[idx].page_size_bytes} bytes")
                refs.append(CanonicalRef(idx, unpadded, name, part))
        group_refs.append(refs)
    return CanonicalCaches(caches.num_blocks, tensors, group_refs)


def stack_tensors(tensors: list[CanonicalTensor]) -> list[CanonicalStack]:
    """Cover `tensors` in index order with the fewest stacks (see `CanonicalStack`)."""
    stacks: list[CanonicalStack] = []
    i = 0
    while i < len(tensors):
        j, step = i + 1, None
        while j < len(tensors) and _stacks_with(tensors[j - 1].tensor, tensors[j].tensor, step):
            step = int(tensors[j].tensor.storage_offset() - tensors[j - 1].tensor.storage_offset())
            j += 1
        first = tensors[i].tensor
        rows, width = first.shape
        view = first.as_strided((j - i, rows, width), (step or rows * first.stride(0), first.stride(0), 1),
                                storage_offset=first.storage_offset())
        stacks.append(CanonicalStack(view, i, j - i))
        i = j
    return stacks


def _stacks_with(prev: torch.Tensor, nxt: torch.Tensor, step: int | None) -> bool:
    """Whether `nxt` continues a stack ending in `prev` whose tensors are `step` bytes apart."""
    if (prev.shape != nxt.shape or prev.stride() != nxt.stride() or prev.device != nxt.device
            or prev.untyped_storage().data_ptr() != nxt.untyped_storage().data_ptr()):
        return False
    gap = nxt.storage_offset() - prev.storage_offset()
    rows, width = prev.shape
    # the next tensor must start past the last byte of this one: rows of a stack never overlap,
    # so a write through the stacked view hits each byte at most once
    return bool((step is None or gap == step) and gap >= (rows - 1) * prev.stride(0) + width)


def layer_byte_views(layer: LayerKVCache, num_blocks: int) -> list[tuple[torch.Tensor, int, str]]:
    """`(uint8 view, unpadded bytes per row, part)` for each byte run a block of this layer has."""
    if layer.is_mamba:
        raw = layer.raw
        page = layer.page_size_bytes
        return [(_rows(raw, raw.storage_offset(), num_blocks, page, page),
                 layer.unpadded_page_size_bytes, "state")]
    t = layer.tensor
    assert t is not None
    isz = t.element_size()
    base = t.storage_offset() * isz
    if layer.geometry.layout is KVLayout.FLASH_ATTN:
        _require_dense(t, first_dim=2, what=layer.name)
        half = math.prod(t.shape[2:]) * isz
        row_stride = t.stride(1) * isz
        kv_stride = t.stride(0) * isz
        unpadded = layer.unpadded_page_size_bytes // 2
        return [(_rows(t, base, num_blocks, half, row_stride), unpadded, "k"),
                (_rows(t, base + kv_stride, num_blocks, half, row_stride), unpadded, "v")]
    _require_dense(t, first_dim=1, what=layer.name)
    width = math.prod(t.shape[1:]) * isz
    return [(_rows(t, base, num_blocks, width, t.stride(0) * isz),
             layer.unpadded_page_size_bytes, "kv")]


def _rows(t: torch.Tensor, byte_offset: int, num_rows: int, width: int, row_stride: int) -> torch.Tensor:
    # as_strided on the uint8 reinterpretation addresses the storage in bytes, so offsets and
    # strides computed from the typed tensor (times its itemsize) land on the same bytes.
    flat = t.detach().view(torch.uint8) if t.dtype != torch.uint8 else t.detach()
    return flat.as_strided((num_rows, width), (row_stride, 1), storage_offset=byte_offset)


def _require_dense(t: torch.Tensor, first_dim: int, what: str) -> None:
    """The dims after the block dim must be contiguous, or a block is not one byte run."""
    expected = 1
    for dim in range(t.dim() - 1, first_dim - 1, -1):
        if t.shape[dim] != 1 and t.stride(dim) != expected:
            raise ValueError(f"{what}: dims {first_dim}.. of shape {tuple(t.shape)} with strides "
                             f"{t.stride()} are not contiguous, so a block is not one byte run")
        expected *= t.shape[dim]
