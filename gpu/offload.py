"""Offload kernels: batched block copies between the canonical device views and host chunks.

A host chunk holds `blocks_per_chunk` consecutive device blocks of one group: for every canonical
tensor, host row `chunk_id * blocks_per_chunk + j` is the j-th block of the chunk. One `store` or
`load` call moves any number of (non-contiguous) blocks of any number of groups, across all their
layers, with a constant number of tensor ops per canonical tensor (plus one per run of adjacent
host rows on the fast path) — never a Python loop per block.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvpipe.gpu.canonical import CanonicalCaches

# A run-per-op copy pays ~10 us of dispatch per run; below this average run length the two-pass
# staging path (gather, then scatter: always 2 ops per tensor) is cheaper.
MIN_AVG_RUN = 4


@dataclass(slots=True)
class HostBuffers:
    """The CPU tier's bytes: per canonical tensor a contiguous uint8 tensor of shape
    `(num_chunks, page_size_bytes * blocks_per_chunk)`, pinned when a GPU is present so copies
    can be asynchronous. Padding bytes are allocated (rows mirror device rows) but never moved."""

    tensors: list[torch.Tensor]
    num_chunks: int
    blocks_per_chunk: int

    def rows(self, tensor_idx: int) -> torch.Tensor:
        """The same bytes as `(num_chunks * blocks_per_chunk, page)`: one row per device block."""
        t = self.tensors[tensor_idx]
        return t.view(self.num_chunks * self.blocks_per_chunk, t.shape[1] // self.blocks_per_chunk)


def allocate_host_buffers(canonical: CanonicalCaches, num_chunks: int, blocks_per_chunk: int,
                          pin: bool | None = None) -> HostBuffers:
    if num_chunks <= 0 or blocks_per_chunk <= 0:
        raise ValueError(f"allocate_host_buffers: num_chunks={num_chunks} and "
                         f"blocks_per_chunk={blocks_per_chunk} must be positive")
    if pin is None:
        pin = torch.cuda.is_available()
    tensors = [torch.zeros((num_chunks, ct.page_size_bytes * blocks_per_chunk), dtype=torch.uint8,
                           pin_memory=pin)
               for ct in canonical.tensors]
    return HostBuffers(tensors, num_chunks, blocks_per_chunk)


@dataclass(frozen=True, slots=True)
class GroupTransfer:
    """Blocks of one group and the host chunks they go to / come from.

    `gpu_block_ids[i]` is the block at position `skip + i` of the chunk sequence `cpu_chunk_ids`,
    i.e. `skip` leading blocks of the first chunk are not covered (the request's first fresh
    block is not chunk-aligned). The last chunk may be partially covered too.
    """

    group_idx: int
    gpu_block_ids: Sequence[int]
    cpu_chunk_ids: Sequence[int]
    skip: int = 0

    def host_rows(self, blocks_per_chunk: int) -> np.ndarray:
        n = len(self.gpu_block_ids)
        if not 0 <= self.skip < blocks_per_chunk:
            raise ValueError(f"group {self.group_idx}: skip={self.skip} must be in "
                             f"[0, blocks_per_chunk={blocks_per_chunk})")
        needed = -(-(self.skip + n) // blocks_per_chunk)
        if len(self.cpu_chunk_ids) != needed:
            raise ValueError(f"group {self.group_idx}: {n} blocks after skip {self.skip} span "
                             f"{needed} chunks of {blocks_per_chunk}, got "
                             f"{len(self.cpu_chunk_ids)} chunk ids")
        pos = np.arange(self.skip, self.skip + n, dtype=np.int64)
        chunks = np.asarray(self.cpu_chunk_ids, dtype=np.int64)
        return chunks[pos // blocks_per_chunk] * blocks_per_chunk + pos % blocks_per_chunk


@dataclass(slots=True)
class TransferHandle:
    """Completion of one store/load. On CPU it is done at creation; on CUDA `done()` polls the
    end event and `wait()` blocks on it. A deferred host-side step (scattering a pinned staging
    buffer into host chunks) runs inside the first `done()`/`wait()` that sees the event fired, so
    host bytes are final once either reports completion."""

    direction: str
    num_bytes: int
    event: object | None = None  # torch.cuda.Event on CUDA
    _finish: list[Callable[[], None]] = field(default_factory=list)
    _keepalive: list[torch.Tensor] = field(default_factory=list)

    def done(self) -> bool:
        if self.event is not None and not self.event.query():  # type: ignore[attr-defined]
            return False
        self._run_finish()
        return True

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()  # type: ignore[attr-defined]
        self._run_finish()

    def stream_wait(self, stream: object | None = None) -> None:
        """Make a CUDA stream (default: current) wait for this transfer without blocking the host."""
        if self.event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self.event)  # type: ignore[attr-defined]

    def _run_finish(self) -> None:
        while self._finish:
            self._finish.pop(0)()
        self._keepalive.clear()


@dataclass(slots=True)
class _Move:
    tensor_idx: int
    width: int
    dev_rows: np.ndarray
    host_rows: np.ndarray


class BlockMover:
    """Moves blocks between `canonical` (device) and `host`.

    Per canonical tensor a transfer is one gather + one scatter, or, when the host rows form few
    adjacent runs (fresh chunk ids are handed out sequentially), one op per run that writes straight
    into (or reads straight from) the host rows — a single pass over the bytes instead of two.
    Bytes are moved as the widest machine word that divides the row width and strides (8-byte
    words index ~3x faster than bytes on CPU). On CUDA every transfer runs on a per-direction side
    stream that first waits for the compute stream, so transfers of one direction stay FIFO; the
    model must not read loaded blocks before `handle.stream_wait()` (or `wait()`), and
    `CpuTier.complete_store` must not run before `handle.done()`.

    Without a GPU the same calls run synchronously and return a completed handle.
    """

    def __init__(self, canonical: CanonicalCaches, host: HostBuffers) -> None:
        if len(host.tensors) != len(canonical.tensors):
            raise ValueError(f"BlockMover: {len(host.tensors)} host tensors for "
                             f"{len(canonical.tensors)} canonical tensors")
        self.canonical = canonical
        self.host = host
        self.device = canonical.tensors[0].tensor.device
        self._cuda = self.device.type == "cuda"
        self._streams: dict[str, object] = {}
        # CPU path only (synchronous, so one buffer can be reused): staging for fragmented host
        # rows, kept across calls because a fresh multi-MiB allocation per tensor is page faults.
        self._scratch = torch.empty(0, dtype=torch.uint8)
        if self._cuda:
            self._streams = {"store": torch.cuda.Stream(self.device),
                             "load": torch.cuda.Stream(self.device)}

    # -- public API ------------------------------------------------------------------------------

    def store(self, transfers: Sequence[GroupTransfer]) -> TransferHandle:
        """Device blocks -> host chunks."""
        return self._transfer(transfers, "store")

    def load(self, transfers: Sequence[GroupTransfer]) -> TransferHandle:
        """Host chunks -> device blocks."""
        return self._transfer(transfers, "load")

    # -- planning --------------------------------------------------------------------------------

    def _plan(self, transfers: Sequence[GroupTransfer]) -> list[_Move]:
        """One move per canonical tensor: groups overlaying a tensor are concatenated."""
        bpc = self.host.blocks_per_chunk
        parts: dict[int, tuple[int, list[np.ndarray], list[np.ndarray]]] = {}
        for tr in transfers:
            if not tr.gpu_block_ids:
                continue
            dev_rows = np.asarray(tr.gpu_block_ids, dtype=np.int64)
            if dev_rows.min() < 0 or dev_rows.max() >= self.canonical.num_blocks:
                raise ValueError(f"group {tr.group_idx}: block ids must be in "
                                 f"[0, {self.canonical.num_blocks})")
            host_rows = tr.host_rows(bpc)
            if host_rows.min() < 0 or host_rows.max() >= self.host.num_chunks * bpc:
                raise ValueError(f"group {tr.group_idx}: chunk ids must be in "
                                 f"[0, {self.host.num_chunks})")
            for t_idx, width in self.canonical.group_copy_widths(tr.group_idx):
                w, devs, hosts = parts.get(t_idx, (0, [], []))
                devs.append(dev_rows)
                hosts.append(host_rows)
                parts[t_idx] = (max(w, width), devs, hosts)
        return [_Move(t, w, np.concatenate(d), np.concatenate(h)) for t, (w, d, h) in parts.items()]

    def _views(self, move: _Move) -> tuple[torch.Tensor, torch.Tensor]:
        """(device rows, host rows), narrowed to the moved width and widened to machine words."""
        dev = self.canonical.tensors[move.tensor_idx].tensor
        host = self.host.rows(move.tensor_idx)
        if move.width != dev.shape[1]:
            dev, host = dev[:, :move.width], host[:, :move.width]
        word = _word_dtype(dev, host, move.width)
        return _as_words(dev, word), _as_words(host, word)

    # -- execution -------------------------------------------------------------------------------

    def _transfer(self, transfers: Sequence[GroupTransfer], direction: str) -> TransferHandle:
        moves = self._plan(transfers)
        nbytes = sum(m.width * len(m.dev_rows) for m in moves)
        handle = TransferHandle(direction, nbytes)
        if not self._cuda:
            for m in moves:
                self._run_cpu(m, direction)
            return handle
        stream = self._streams[direction]
        stream.wait_stream(torch.cuda.current_stream(self.device))  # type: ignore[attr-defined]
        # Every canonical tensor of a group moves the same rows (one per layer and K/V): upload
        # each distinct index once per transfer, not once per tensor — the host-side issue time,
        # not the copy engine, bounded small transfers (measured on an H100; BENCHMARKS.md).
        indices: dict[bytes, torch.Tensor] = {}
        with torch.cuda.stream(stream):  # type: ignore[arg-type]
            for m in moves:
                self._run_cuda(m, direction, handle, indices)
            handle.event = torch.cuda.Event()
            handle.event.record(stream)  # type: ignore[attr-defined]
        return handle

    def _run_cpu(self, m: _Move, direction: str) -> None:
        dev, host = self._views(m)
        dev_idx = torch.from_numpy(m.dev_rows)
        runs = _runs(m.host_rows)
        contiguous_host = host.is_contiguous()
        if direction == "store":
            if contiguous_host and len(runs) * MIN_AVG_RUN <= len(m.dev_rows):
                for a, b, r in runs:  # one single-pass gather per adjacent run of host rows
                    torch.index_select(dev, 0, dev_idx[a:b], out=host[r:r + b - a])
                return
            staged = torch.index_select(dev, 0, dev_idx, out=self._staging(dev, len(m.dev_rows)))
            host.index_copy_(0, torch.from_numpy(m.host_rows), staged)
        else:
            if len(runs) * MIN_AVG_RUN <= len(m.dev_rows):
                for a, b, r in runs:  # source is a plain slice of host rows: no staging
                    dev.index_copy_(0, dev_idx[a:b], host[r:r + b - a])
                return
            staged = torch.index_select(host, 0, torch.from_numpy(m.host_rows),
                                        out=self._staging(host, len(m.dev_rows)))
            dev.index_copy_(0, dev_idx, staged)

    def _staging(self, like: torch.Tensor, rows: int) -> torch.Tensor:
        nbytes = rows * like.shape[1] * like.element_size()
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes].view(like.dtype).view(rows, like.shape[1])

    def _run_cuda(self, m: _Move, direction: str, handle: TransferHandle, indices: dict[bytes, torch.Tensor]) -> None:
        dev, host = self._views(m)
        n = len(m.dev_rows)
        key = m.dev_rows.tobytes()
        dev_idx = indices.get(key)
        if dev_idx is None:
            dev_idx = indices[key] = torch.from_numpy(m.dev_rows).pin_memory().to(self.device, non_blocking=True)
        staging = torch.empty((n, dev.shape[1]), dtype=dev.dtype, device=self.device)
        runs = _runs(m.host_rows)
        # per-run async copies need plain slices of host rows; narrowed rows (padded pages) and
        # fragmented chunk ids go through one pinned staging buffer instead
        few_runs = len(runs) * MIN_AVG_RUN <= n and host.is_contiguous()
        handle._keepalive += [dev_idx, staging]
        if direction == "store":
            torch.index_select(dev, 0, dev_idx, out=staging)
            if few_runs:
                for a, b, r in runs:
                    host[r:r + b - a].copy_(staging[a:b], non_blocking=True)
                return
            pinned = torch.empty(staging.shape, dtype=staging.dtype, pin_memory=True)
            pinned.copy_(staging, non_blocking=True)
            host_idx = torch.from_numpy(m.host_rows)
            # Scattering into arbitrary host rows is a host memcpy; it can only run once the
            # device-to-host copy has landed, so it is deferred to the handle's completion.
            handle._finish.append(lambda: host.index_copy_(0, host_idx, pinned))
            handle._keepalive.append(pinned)
        else:
            if few_runs:
                for a, b, r in runs:
                    staging[a:b].copy_(host[r:r + b - a], non_blocking=True)
            else:
                pinned = torch.empty(staging.shape, dtype=staging.dtype, pin_memory=True)
                torch.index_select(host, 0, torch.from_numpy(m.host_rows), out=pinned)
                staging.copy_(pinned, non_blocking=True)
                handle._keepalive.append(pinned)
            dev.index_copy_(0, dev_idx, staging)


def _runs(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs `(start, end, first_row)` of consecutive positions whose rows ascend by one."""
    if len(rows) == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(rows)]))
    return [(int(a), int(b), int(rows[a])) for a, b in zip(starts, ends)]


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _word_dtype(dev: torch.Tensor, host: torch.Tensor, width: int) -> torch.dtype:
    for word in _WORDS:
        size = torch.empty((), dtype=word).element_size()
        if width % size == 0 and all(
                t.stride(0) % size == 0 and t.storage_offset() % size == 0 for t in (dev, host)):
            return word
    return torch.uint8


def _as_words(t: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    return t if word == torch.uint8 else t.view(word)
