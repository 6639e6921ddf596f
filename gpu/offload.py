"""Offload kernels: batched block copies between the canonical device views and host chunks.

A host chunk holds `blocks_per_chunk` consecutive device blocks of one group: for every canonical
tensor, host row `chunk_id * blocks_per_chunk + j` is the j-th block of the chunk. One `store` or
`load` call moves any number of (non-contiguous) blocks of any number of groups, across all their
layers, with a constant number of tensor ops per transfer and group: the canonical tensors of a
group form one stacked view (`kvpipe.gpu.canonical.CanonicalStack`), so one gather or scatter
along the block dim moves every layer at once — never a Python loop per block or per layer.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvpipe.gpu.canonical import CanonicalCaches

# Runs of adjacent host rows (or device rows) are moved with one single-pass op each while there
# are at most MAX_RUNS of them or they average MIN_AVG_RUN rows; else a transfer goes through a
# staging buffer (two passes over the bytes, 2 ops). A run spans every layer of a stack, so the op
# count of a call depends on how fragmented its chunk ids are, never on the layer count; fresh
# chunk ids, in any order, are one run.
MAX_RUNS = 4
MIN_AVG_RUN = 4


@dataclass(slots=True)
class HostBuffers:
    """The CPU tier's bytes: per canonical stack one contiguous uint8 tensor of shape
    `(num_chunks * blocks_per_chunk, tensors_in_stack, page_size_bytes)`, pinned when a GPU is
    present so copies can be asynchronous. Host row r holds block-row r of every tensor of the
    stack side by side, so a chunk is one contiguous byte range across all layers and a run of
    chunks is one plain copy. Padding bytes are allocated (rows mirror device rows) but never
    moved."""

    pools: list[torch.Tensor]
    num_chunks: int
    blocks_per_chunk: int
    stack_of: list[tuple[int, int]]  # canonical tensor index -> (pool index, position)

    def rows(self, tensor_idx: int) -> torch.Tensor:
        """One canonical tensor's host bytes as `(num_chunks * blocks_per_chunk, page)`: one row
        per device block (a strided view into its stack's pool)."""
        pool, pos = self.stack_of[tensor_idx]
        return self.pools[pool][:, pos]


def allocate_host_buffers(canonical: CanonicalCaches, num_chunks: int, blocks_per_chunk: int,
                          pin: bool | None = None) -> HostBuffers:
    if num_chunks <= 0 or blocks_per_chunk <= 0:
        raise ValueError(f"allocate_host_buffers: num_chunks={num_chunks} and "
                         f"blocks_per_chunk={blocks_per_chunk} must be positive")
    if pin is None:
        pin = torch.cuda.is_available()
    pools = [torch.zeros((num_chunks * blocks_per_chunk, st.count, st.page_size_bytes),
                         dtype=torch.uint8, pin_memory=pin)
             for st in canonical.stacks]
    return HostBuffers(pools, num_chunks, blocks_per_chunk, list(canonical.stack_of))


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
    _finish: list[Callable[[], object]] = field(default_factory=list)
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


@dataclass(frozen=True, slots=True)
class _Segment:
    """Positions `lo .. hi - 1` of one stack that the same transfers (`users`, positions in the
    call's list of non-empty transfers) touch with the same row width."""

    stack: int
    lo: int
    hi: int
    width: int
    users: tuple[int, ...]


@dataclass(slots=True)
class _Move:
    segment: _Segment
    dev_rows: np.ndarray
    host_rows: np.ndarray  # ascending; dev_rows[i] pairs with host_rows[i]


class BlockMover:
    """Moves blocks between `canonical` (device) and `host`.

    Per stack segment a transfer is one gather along the block dim straight into the host rows
    (or one scatter straight from them) per run of adjacent host rows, sorted, when they form few
    runs (fresh chunk ids are handed out sequentially; a permutation of them is one run too);
    else the same per run of device rows; else one gather into staging plus one scatter.
    Bytes are moved as the widest machine word that divides the row width and strides (8-byte
    words index ~3x faster than bytes on CPU). On CUDA every transfer runs on a per-direction side
    stream that first waits for the compute stream, so transfers of one direction stay FIFO; the
    model must not read loaded blocks before `handle.stream_wait()` (or `wait()`), and
    `CpuTier.complete_store` must not run before `handle.done()`.

    Without a GPU the same calls run synchronously and return a completed handle.
    """

    def __init__(self, canonical: CanonicalCaches, host: HostBuffers) -> None:
        shapes = [tuple(st.tensor.shape[::2]) for st in canonical.stacks]
        if [tuple(p.shape[1:]) for p in host.pools] != shapes:
            raise ValueError(f"BlockMover: host pools of shapes {[tuple(p.shape) for p in host.pools]} "
                             f"do not match the canonical stacks (tensors, page) {shapes}")
        self.canonical = canonical
        self.host = host
        self.device = canonical.tensors[0].tensor.device
        self._cuda = self.device.type == "cuda"
        self._streams: dict[str, object] = {}
        self._segments: dict[tuple[int, ...], list[_Segment]] = {}
        self._view_cache: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # CPU path only (synchronous, so one buffer can be reused): staging for fragmented rows,
        # kept across calls because a fresh multi-MiB allocation per call is page faults.
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
        """One move per segment; the rows of groups sharing a segment are concatenated."""
        live = [tr for tr in transfers if len(tr.gpu_block_ids)]
        rows = [self._checked_rows(tr) for tr in live]
        moves = []
        for seg in self._segments_of(tuple(tr.group_idx for tr in live)):
            dev = np.concatenate([rows[u][0] for u in seg.users])
            host = np.concatenate([rows[u][1] for u in seg.users])
            order = np.argsort(host, kind="stable")
            moves.append(_Move(seg, dev[order], host[order]))
        return moves

    def _checked_rows(self, tr: GroupTransfer) -> tuple[np.ndarray, np.ndarray]:
        bpc = self.host.blocks_per_chunk
        dev_rows = np.asarray(tr.gpu_block_ids, dtype=np.int64)
        if dev_rows.min() < 0 or dev_rows.max() >= self.canonical.num_blocks:
            raise ValueError(f"group {tr.group_idx}: block ids must be in "
                             f"[0, {self.canonical.num_blocks})")
        host_rows = tr.host_rows(bpc)
        if host_rows.min() < 0 or host_rows.max() >= self.host.num_chunks * bpc:
            raise ValueError(f"group {tr.group_idx}: chunk ids must be in "
                             f"[0, {self.host.num_chunks})")
        return dev_rows, host_rows

    def _segments_of(self, groups: tuple[int, ...]) -> list[_Segment]:
        """Each canonical tensor moves the widest row any of the call's groups uses on it; runs of
        adjacent stack positions with the same width and the same groups are one segment. Cached:
        the mix of groups in a call repeats from step to step."""
        cached = self._segments.get(groups)
        if cached is not None:
            return cached
        widths: dict[int, int] = {}
        users: dict[int, list[int]] = {}
        for pos, g in enumerate(groups):
            for t_idx, width in self.canonical.group_copy_widths(g):
                widths[t_idx] = max(widths.get(t_idx, 0), width)
                users.setdefault(t_idx, []).append(pos)
        segments: list[_Segment] = []
        for t_idx in sorted(widths):
            stack, p = self.canonical.stack_of[t_idx]
            seg = _Segment(stack, p, p + 1, widths[t_idx], tuple(users[t_idx]))
            last = segments[-1] if segments else None
            if last is not None and (last.stack, last.hi, last.width, last.users) == (stack, p, seg.width, seg.users):
                segments[-1] = _Segment(stack, last.lo, p + 1, seg.width, seg.users)
            else:
                segments.append(seg)
        self._segments[groups] = segments
        return segments

    def _views(self, seg: _Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """(device, host) views `(blocks, tensors, width)` of a segment, as machine words; the
        device view is the stack with its block dim first, so both index along dim 0."""
        key = (seg.stack, seg.lo, seg.hi, seg.width)
        views = self._view_cache.get(key)
        if views is None:
            dev = self.canonical.stacks[seg.stack].tensor[seg.lo:seg.hi, :, :seg.width].permute(1, 0, 2)
            host = self.host.pools[seg.stack][:, seg.lo:seg.hi, :seg.width]
            word = _word_dtype(dev, host, seg.width)
            views = self._view_cache[key] = (_as_words(dev, word), _as_words(host, word))
        return views

    # -- execution -------------------------------------------------------------------------------

    def _transfer(self, transfers: Sequence[GroupTransfer], direction: str) -> TransferHandle:
        moves = self._plan(transfers)
        nbytes = sum(m.segment.width * (m.segment.hi - m.segment.lo) * len(m.dev_rows) for m in moves)
        handle = TransferHandle(direction, nbytes)
        if not self._cuda:
            for m in moves:
                self._run_cpu(m, direction)
            return handle
        stream = self._streams[direction]
        stream.wait_stream(torch.cuda.current_stream(self.device))  # type: ignore[attr-defined]
        with torch.cuda.stream(stream):  # type: ignore[arg-type]
            if moves:
                self._issue_cuda(moves, direction, handle)
            handle.event = torch.cuda.Event()
            handle.event.record(stream)  # type: ignore[arg-type]
        return handle

    def _issue_cuda(self, moves: list[_Move], direction: str, handle: TransferHandle) -> None:
        # One upload of every move's device rows per call, not one per tensor or move: host-side
        # issue time, not the copy engine, bounded small transfers (BENCHMARKS.md).
        dev_idx = torch.from_numpy(np.concatenate([m.dev_rows for m in moves])).pin_memory()
        dev_idx = dev_idx.to(self.device, non_blocking=True)
        handle._keepalive.append(dev_idx)
        start = 0
        for m in moves:
            end = start + len(m.dev_rows)
            self._run_cuda(m, direction, handle, _part(dev_idx, start, end))
            start = end

    def _run_cpu(self, m: _Move, direction: str) -> None:
        dev, host = self._views(m.segment)
        store = direction == "store"
        runs = _runs(m.host_rows)
        if runs is not None:  # each run of host rows is a plain slice: one pass, no staging
            idx = torch.from_numpy(m.dev_rows)
            for a, b, r in runs:
                rows, part = _part(host, r, r + b - a), _part(idx, a, b)
                if store:
                    torch.index_select(dev, 0, part, out=rows)
                else:
                    dev.index_copy_(0, part, rows)
            return
        order = np.argsort(m.dev_rows, kind="stable")
        dev_runs = _runs(m.dev_rows[order])
        if dev_runs is not None:  # scattered chunks, but adjacent device blocks
            idx = torch.from_numpy(m.host_rows[order])
            for a, b, d in dev_runs:
                rows, part = _part(dev, d, d + b - a), _part(idx, a, b)
                if store:
                    host.index_copy_(0, part, rows)
                else:
                    torch.index_select(host, 0, part, out=rows)
            return
        dev_idx, host_idx = torch.from_numpy(m.dev_rows), torch.from_numpy(m.host_rows)
        if store:
            staged = torch.index_select(dev, 0, dev_idx, out=self._staging(dev, len(m.dev_rows)))
            host.index_copy_(0, host_idx, staged)
        else:
            staged = torch.index_select(host, 0, host_idx, out=self._staging(host, len(m.dev_rows)))
            dev.index_copy_(0, dev_idx, staged)

    def _staging(self, like: torch.Tensor, rows: int) -> torch.Tensor:
        shape = (rows, *like.shape[1:])
        nbytes = int(np.prod(shape)) * like.element_size()
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes].view(like.dtype).view(shape)

    def _run_cuda(self, m: _Move, direction: str, handle: TransferHandle, dev_idx: torch.Tensor) -> None:
        dev, host = self._views(m.segment)
        n = len(m.dev_rows)
        staging = torch.empty((n, *dev.shape[1:]), dtype=dev.dtype, device=self.device)
        runs = _runs(m.host_rows)
        # Asynchronous copies need plain contiguous host slices: a segment narrowed to part of a
        # stack or of a row (padded pages) and fragmented chunk ids go through one pinned
        # staging buffer instead.
        direct = runs is not None and host.is_contiguous()
        handle._keepalive.append(staging)
        if direction == "store":
            torch.index_select(dev, 0, dev_idx, out=staging)
            if direct:
                for a, b, r in runs:  # type: ignore[union-attr]
                    _part(host, r, r + b - a).copy_(_part(staging, a, b), non_blocking=True)
                return
            pinned = torch.empty(staging.shape, dtype=staging.dtype, pin_memory=True)
            pinned.copy_(staging, non_blocking=True)
            host_idx = torch.from_numpy(m.host_rows)
            # Scattering into arbitrary host rows is a host memcpy; it can only run once the
            # device-to-host copy has landed, so it is deferred to the handle's completion.
            handle._finish.append(lambda: host.index_copy_(0, host_idx, pinned))
            handle._keepalive.append(pinned)
        else:
            if direct:
                for a, b, r in runs:  # type: ignore[union-attr]
                    _part(staging, a, b).copy_(_part(host, r, r + b - a), non_blocking=True)
            else:
                pinned = torch.empty(staging.shape, dtype=staging.dtype, pin_memory=True)
                torch.index_select(host, 0, torch.from_numpy(m.host_rows), out=pinned)
                staging.copy_(pinned, non_blocking=True)
                handle._keepalive.append(pinned)
            dev.index_copy_(0, dev_idx, staging)


def _part(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows `start:end` of `t`; `t` itself when that is all of it (a slice is one more op)."""
    return t if start == 0 and end == t.shape[0] else t[start:end]


def _runs(rows: np.ndarray) -> list[tuple[int, int, int]] | None:
    """Maximal runs `(start, end, first_row)` of consecutive positions whose rows ascend by one,
    or None when they are too many to move one op each (see `MAX_RUNS`)."""
    if len(rows) == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    if len(breaks) >= max(MAX_RUNS, len(rows) // MIN_AVG_RUN):
        return None
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(rows)]))
    return [(int(a), int(b), int(rows[a])) for a, b in zip(starts, ends)]


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _word_dtype(dev: torch.Tensor, host: torch.Tensor, width: int) -> torch.dtype:
    for word in _WORDS:
        size = torch.empty((), dtype=word).element_size()
        if width % size == 0 and all(
                all(s % size == 0 for s in t.stride()[:-1]) and t.storage_offset() % size == 0
                for t in (dev, host)):
            return word
    return torch.uint8


def _as_words(t: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    return t if word == torch.uint8 else t.view(word)
