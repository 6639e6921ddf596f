"""The block pool: physical KV blocks, the LRU free queue, the prefix-cache map, and the events.

Invariants and decisions:
* Block 0 is the null block: a placeholder for skipped slots (outside a sliding window, between
  Mamba states). It is never free, never cached, and its ref count is not kept.
* A free block may still be cached. Eviction is lazy: a cached block is dropped from the map only
  when `get_new_blocks` hands it out again, which is when `BlockRemoved` is emitted (one event per
  removed hash). Freeing never emits anything.
* Free-queue order is the eviction order: `free_blocks` takes blocks most-evictable first; cached
  ones go to the tail (LRU), uncached ones to the head (reused first, they can never hit). A hit
  (`touch`) takes a free block out of the queue.
* Identical blocks are not de-duplicated: two requests computing the same prefix in one step each
  cache their own block under the same `(hash, group)` key, so the map holds up to several blocks
  per key and the event stream carries two `BlockStored` for that key. Consumers ref-count. The
  reason (vLLM's): block tables stay append-only, a block id handed to a request never changes.
* Map keys are `hash || u32_be(group)` bytes and single-block values are stored bare (a dict only
  for the rare duplicate): fewer GC-tracked objects than tuples and nested dicts on the hot path.
* Partial entries (fine-grained hits, vllm-semantics §3.1): `cache_partial_block` makes a block
  reachable from a hash-unit boundary inside it, publishing a one-unit `BlockStored` (block_size =
  the hash unit, parent = the previous unit's hash). A block may hold several keys: the primary one
  (`key`, covering `key_tokens` tokens) and extra partial keys (`extra`). Eviction removes and
  announces them all; promoting a partial block to a full one first announces `BlockRemoved` for
  the partial key(s), then stores the full key.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvpipe.gpu.hashing import block_extra_keys, external_hash, to_event_extra_keys
from kvpipe.schemas.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "key", "key_tokens", "extra", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: bytes | None = None  # prefix-cache key while cached
        self.key_tokens = 0  # prefix length the primary key stands for (inside the block if partial)
        self.extra: list[bytes] | None = None  # further partial keys pointing at this block
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.key is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with two sentinels; O(1) remove from the middle."""

    __slots__ = ("head", "tail", "num_free")

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self.head = KVBlock(-1)
        self.tail = KVBlock(-2)
        self.num_free = 0
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.append_n(blocks)

    def popleft_n(self, n: int) -> list[KVBlock]:
        out: list[KVBlock] = []
        blk = self.head.next_free
        for _ in range(n):
            assert blk is not None and blk is not self.tail, "free queue exhausted"
            out.append(blk)
            nxt = blk.next_free
            blk.prev_free = blk.next_free = None
            blk = nxt
        self.head.next_free = blk
        blk.prev_free = self.head  # type: ignore[union-attr]
        self.num_free -= n
        return out

    def remove(self, blk: KVBlock) -> None:
        prev, nxt = blk.prev_free, blk.next_free
        prev.next_free = nxt  # type: ignore[union-attr]
        nxt.prev_free = prev  # type: ignore[union-attr]
        blk.prev_free = blk.next_free = None
        self.num_free -= 1

    def append_n(self, blocks: Iterable[KVBlock]) -> None:
        last = self.tail.prev_free
        n = 0
        for blk in blocks:
            last.next_free = blk  # type: ignore[union-attr]
            blk.prev_free = last
            last = blk
            n += 1
        last.next_free = self.tail  # type: ignore[union-attr]
        self.tail.prev_free = last
        self.num_free += n

    def prepend_n(self, blocks: Sequence[KVBlock]) -> None:
        if not blocks:
            return
        first = self.head.next_free
        prev = self.head
        for blk in blocks:
            prev.next_free = blk
            blk.prev_free = prev
            prev = blk
        prev.next_free = first
        first.prev_free = prev  # type: ignore[union-attr]
        self.num_free += len(blocks)

    def block_ids(self) -> list[int]:
        out = []
        blk = self.head.next_free
        while blk is not self.tail:
            out.append(blk.block_id)  # type: ignore[union-attr]
            blk = blk.next_free  # type: ignore[union-attr]
        return out


class BlockPool:
    """All blocks of one medium, shared by every group of a node (see module docstring)."""

    def __init__(self, num_blocks: int, hash_block_size: int, enable_caching: bool = True,
                 enable_events: bool = False, int_hashes: bool = True, medium: str = MEDIUM_GPU) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.hash_block_size = hash_block_size
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.int_hashes = int_hashes
        self.medium = medium
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Any] = {}  # key -> KVBlock | dict[block_id, KVBlock]
        self.null_block = self.free_queue.popleft_n(1)[0]
        self.null_block.is_null = True
        self.events: list[Any] = []

    def _emit_stored(self, request: Any, hashes: list, parent: Any, start: int, end: int, block_size: int,
                     extra: list[Any] | None, group_idx: int) -> None:
        """One `BlockStored` for blocks of `request` covering its tokens [start, end)."""
        self.events.append(BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=request.all_token_ids[start:end],
            block_size=block_size, lora_id=request.lora_id, medium=self.medium, lora_name=request.lora_name,
            extra_keys=extra, group_idx=group_idx, session_id=request.session_id))

    # --- lookups ------------------------------------------------------------------------------

    def get_one_block(self, key: bytes) -> KVBlock | None:
        v = self.cached.get(key)
        if v is None or type(v) is KVBlock:
            return v
        return next(iter(v.values()))

    def get_cached_block(self, block_hash: bytes, group_ids: Sequence[int]) -> list[KVBlock] | None:
        """One cached block per group, or None if any group misses."""
        out = []
        for g in group_ids:
            blk = self.get_one_block(block_hash + g.to_bytes(4, "big"))
            if blk is None:
                return None
            out.append(blk)
        return out

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    # --- allocation ---------------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot get {n} free blocks, {self.free_queue.num_free} free")
        out = self.free_queue.popleft_n(n)
        for blk in out:
            if blk.key is not None:
                self._evict(blk)
            blk.ref_cnt += 1
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        for blk in blocks:
            if blk.is_null:
                continue
            if blk.ref_cnt == 0:
                self.free_queue.remove(blk)
            blk.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Release one reference of each block, most-evictable first."""
        first: list[KVBlock] = []
        last: list[KVBlock] = []
        for blk in ordered:
            if blk.is_null:
                continue
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                (first if blk.key is None or not self.enable_caching else last).append(blk)
        self.free_queue.prepend_n(first)
        self.free_queue.append_n(last)

    # --- caching and eviction -----------------------------------------------------------------

    def cache_full_blocks(self, request: Any, blocks: Sequence[KVBlock], num_cached: int, num_full: int,
                          block_size: int, group_idx: int, mask: Sequence[bool] | None = None) -> None:
        """Give blocks `[num_cached, num_full)` of a request their hashes; at most one BlockStored.

        Null and masked-out blocks are skipped but their tokens stay in the event's range, and the
        parent is the hash of block `num_cached - 1` even if that block was never stored.
        """
        if num_cached >= num_full:
            return
        k = block_size // self.hash_block_size
        fine = request.block_hashes
        # Coarse hashes of blocks num_cached .. num_full-1 (last fine hash of each block).
        new_hashes = fine[(num_cached + 1) * k - 1: num_full * k: k]
        suffix = group_idx.to_bytes(4, "big")
        cached = self.cached
        published: list[int] | None = [] if self.enable_events else None
        for i in range(num_full - num_cached):
            blk = blocks[num_cached + i]
            if blk.is_null or (mask is not None and not mask[i]):
                continue
            h = new_hashes[i]
            key = h + suffix
            if blk.key is not None:
                # The one way a newly full block already has a key: it was a partial entry, and
                # is promoted now. Its partial key(s) go first, announced.
                self._drop_keys(blk)
            blk.key = key
            blk.key_tokens = (num_cached + i + 1) * block_size
            prior = cached.get(key)
            if prior is None:
                cached[key] = blk
            elif type(prior) is KVBlock:
                cached[key] = {prior.block_id: prior, blk.block_id: blk}
            else:
                prior[blk.block_id] = blk
            if published is not None:
                published.append(i)
        if published is None:
            return
        int_hashes = self.int_hashes
        parent = None if num_cached == 0 else external_hash(fine[num_cached * k - 1], int_hashes)
        keys = request.keys
        if keys is None or keys.empty:
            extra: list[Any] | None = [None] * len(published) if published else None
        else:
            extra = to_event_extra_keys([
                block_extra_keys(keys, (num_cached + i) * block_size, (num_cached + i + 1) * block_size)
                for i in published])
        self._emit_stored(request, [external_hash(new_hashes[i], int_hashes) for i in published], parent,
                          num_cached * block_size, num_full * block_size, block_size, extra, group_idx)

    def cache_partial_block(self, request: Any, blk: KVBlock, num_tokens: int, group_idx: int,
                            block_size: int, replace: bool = False) -> bytes | None:
        """Make `blk` reachable from the hash-unit boundary `num_tokens` inside it (a partial
        entry); one `BlockStored` of that single unit unless the key is already there. A block
        whose primary key covers fewer tokens is re-keyed (its old keys announced removed);
        `replace` drops every existing key first (the block's contents were replaced)."""
        if blk.is_null:
            return None
        unit = self.hash_block_size
        if num_tokens <= 0 or num_tokens % unit or block_size % unit:
            raise ValueError(f"a partial entry needs a positive multiple of the hash unit {unit}, got "
                             f"{num_tokens} tokens in a block of {block_size}")
        n_units = num_tokens // unit
        fine = request.block_hashes
        if n_units > len(fine):
            raise ValueError(f"partial entry at {num_tokens} tokens: only {len(fine)} hash units computed")
        key = fine[n_units - 1] + group_idx.to_bytes(4, "big")
        already = blk.key == key or (blk.extra is not None and key in blk.extra)
        if replace:
            self._drop_keys(blk)
            already = False
        elif not already and blk.key is not None and blk.key_tokens < num_tokens:
            self._drop_keys(blk)
        if not already:
            if blk.key is None:
                blk.key, blk.key_tokens = key, num_tokens
            else:
                blk.extra = (blk.extra or []) + [key]
            prior = self.cached.get(key)
            if prior is None:
                self.cached[key] = blk
            elif type(prior) is KVBlock:
                self.cached[key] = {prior.block_id: prior, blk.block_id: blk}
            else:
                prior[blk.block_id] = blk
            if self.enable_events:
                start = num_tokens - unit
                keys = request.keys
                extra = [None] if keys is None or keys.empty else to_event_extra_keys(
                    [block_extra_keys(keys, start, num_tokens)])
                parent = external_hash(fine[n_units - 2], self.int_hashes) if n_units > 1 else None
                self._emit_stored(request, [external_hash(fine[n_units - 1], self.int_hashes)], parent, start,
                                  num_tokens, unit, extra, group_idx)
        return key

    def _drop_keys(self, blk: KVBlock) -> None:
        """Remove every key of `blk` from the map, one `BlockRemoved` per key it still held."""
        keys = [blk.key] if blk.key is not None else []
        if blk.extra:
            keys += blk.extra
        blk.key, blk.key_tokens, blk.extra = None, 0, None
        for key in keys:
            v = self.cached.get(key)
            if v is blk:
                del self.cached[key]
            elif type(v) is dict and blk.block_id in v:
                del v[blk.block_id]
                if len(v) == 1:
                    self.cached[key] = next(iter(v.values()))
            else:
                continue
            if self.enable_events:
                self.events.append(BlockRemoved(block_hashes=[external_hash(key[:-4], self.int_hashes)],
                                                medium=self.medium,
                                                group_idx=int.from_bytes(key[-4:], "big")))

    def _evict(self, blk: KVBlock) -> None:
        assert blk.key is not None
        self._drop_keys(blk)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop blocks from the prefix cache now (e.g. reported corrupt), even if in use."""
        for bid in block_ids:
            if not 0 <= bid < self.num_blocks:
                raise ValueError(f"block id {bid} out of range 0..{self.num_blocks - 1}")
            blk = self.blocks[bid]
            if blk.key is not None:
                self._evict(blk)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash if no block is in use; one AllBlocksCleared, no removals."""
        if self.num_blocks - self.free_queue.num_free != 1:  # the null block is always "used"
            return False
        self.cached = {}
        for blk in self.blocks:
            blk.key, blk.key_tokens, blk.extra = None, 0, None
        if self.enable_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[Any]:
        events, self.events = self.events, []
        return events

    def usage(self) -> float:
        return 1.0 - self.free_queue.num_free / (self.num_blocks - 1)
