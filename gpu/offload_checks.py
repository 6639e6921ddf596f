"""Byte-for-byte verification of offloaded blocks (per-block checksums on both sides), and the
count of torch operations a call dispatches.

A block's checksum is, per canonical tensor it touches, two sums over the bytes the offload moves
(the ref's unpadded width): the plain sum of 32-bit words and their position-weighted sum. The
pair catches any changed word and any swap of words inside a row or of whole rows, and it is
vectorised (two reductions per tensor, no Python loop per block). It is a test and debug aid,
not a cryptographic digest.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvpipe.gpu.canonical import CanonicalCaches
from kvpipe.gpu.offload import GroupTransfer, HostBuffers


def row_checksums(rows: torch.Tensor) -> torch.Tensor:
    """`(n, 2)` int64 checksums of the rows of a 2-D uint8 tensor (computed on the CPU)."""
    if rows.dtype != torch.uint8 or rows.dim() != 2:
        raise ValueError(f"row_checksums: expected 2-D uint8 rows, got {rows.dtype} {tuple(rows.shape)}")
    rows = rows.detach().to("cpu").contiguous()
    # Words of 4 bytes keep both sums far from int64 overflow for any realistic page (< 2^28 B).
    words = (rows.view(torch.int32) if rows.shape[1] % 4 == 0 else rows).to(torch.int64)
    weights = torch.arange(1, words.shape[1] + 1, dtype=torch.int64)
    return torch.stack((words.sum(dim=1), (words * weights).sum(dim=1)), dim=1)


def device_block_checksums(canonical: CanonicalCaches, group_idx: int,
                           block_ids: Sequence[int]) -> torch.Tensor:
    """`(len(block_ids), num_tensors_of_group, 2)` checksums of a group's blocks on the device."""
    idx = torch.as_tensor(list(block_ids), dtype=torch.int64)
    out = []
    for t_idx, width in canonical.group_copy_widths(group_idx):
        view = canonical.tensors[t_idx].tensor[:, :width]
        out.append(row_checksums(view.index_select(0, idx.to(view.device))))
    return torch.stack(out, dim=1)


def host_block_checksums(canonical: CanonicalCaches, host: HostBuffers,
                         transfer: GroupTransfer) -> torch.Tensor:
    """Checksums of the host copies of `transfer`'s blocks, in the same order and shape as
    `device_block_checksums(canonical, transfer.group_idx, transfer.gpu_block_ids)`."""
    idx = torch.from_numpy(np.ascontiguousarray(transfer.host_rows(host.blocks_per_chunk)))
    out = []
    for t_idx, width in canonical.group_copy_widths(transfer.group_idx):
        out.append(row_checksums(host.rows(t_idx)[:, :width].index_select(0, idx)))
    return torch.stack(out, dim=1)


class _OpCounter(TorchDispatchMode):
    """Counts every aten op that reaches the dispatcher at the Python level: views (slice,
    permute, dtype views), allocations, index ops, copies. Ops an op runs internally are not seen
    (the mode is off while an op executes), so this is the number of calls a device would see."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_dispatched_ops(fn: Callable[[], object]) -> tuple[int, dict[str, int]]:
    """`(total, per op name)` of the torch ops `fn()` dispatches, including the `wait()` of a
    handle it returns (the deferred host step of a CUDA store runs there)."""
    counter = _OpCounter()
    with counter:
        out = fn()
        if hasattr(out, "wait"):
            out.wait()
    return sum(counter.ops.values()), dict(counter.ops)
