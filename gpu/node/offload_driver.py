"""The node's offload connector: GPU blocks -> CPU tier every step, CPU -> GPU on a better hit.

Scheduler-side logic (which chunks, which keys, how many tokens a lookup gives) is
`kvpipe.gpu.offload_lookup`; bookkeeping and events are `kvpipe.gpu.cpu_tier`; bytes move through
`kvpipe.gpu.offload.BlockMover`. This module only wires them to a running request.

Decisions:
* Store like vLLM's offloading connector with `offload_prompt_only` (its default): after each
  step, every complete chunk of a scheduled request's *prompt* that is computed goes to the tier
  (a finished request also offers its output, up to `num_tokens - 1`, so the next turn of a
  conversation can hit it). Windowed groups only offer their window's tail. Copies are
  synchronous here (CPU tensors); vLLM submits them at the start of the next step — either way
  the CPU `BlockStored` follows the copy and lands after the step's GPU events.
* Load on admission: if the tier extends the GPU hit by whole chunks, the scheduler allocates
  blocks for those tokens as a load-only step; the chunks are copied in and every loaded block is
  verified against `KVCompute.expected_rows` (checksums) before the request computes on it.
* All groups must share one chunk size for loads (true for the default model); otherwise loads
  are off and stores still run.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpipe.gpu.cpu_tier import CpuTier, OffloadKey, ReqContext
from kvpipe.gpu.kv_cache_manager import KVCacheManager
from kvpipe.gpu.node.kv_compute import KVCompute
from kvpipe.gpu.offload import BlockMover, GroupTransfer, allocate_host_buffers
from kvpipe.gpu.offload_lookup import OffloadGroup, chunk_keys, load_plan, lookup_hit_tokens, store_chunk_indices
from kvpipe.gpu.request import Request
from kvpipe.gpu.specs import Mamba


@dataclass(slots=True)
class OffloadStats:
    stored_chunks: int = 0
    stored_bytes: int = 0
    store_rejected: int = 0  # offers the tier could not take (everything pinned)
    lookups: int = 0
    load_hits: int = 0
    loaded_chunks: int = 0
    loaded_bytes: int = 0
    verified_blocks: int = 0
    mismatched_blocks: int = 0


class _ReqState:
    __slots__ = ("ctx", "next_chunk", "keys", "num_hashes")

    def __init__(self, request_id: str, num_groups: int) -> None:
        self.ctx = ReqContext(request_id)
        self.next_chunk = [0] * num_groups
        self.keys: list[list[OffloadKey]] = [[] for _ in range(num_groups)]
        self.num_hashes = -1


class OffloadDriver:
    def __init__(self, manager: KVCacheManager, kv: KVCompute, num_chunks: int, blocks_per_chunk: int = 1,
                 policy: str = "lru") -> None:
        self.manager = manager
        self.kv = kv
        self.tier = CpuTier(num_chunks, policy)
        self.groups = [OffloadGroup.from_spec(g, s, blocks_per_chunk, manager.hash_block_size)
                       for g, s in enumerate(manager.specs)]
        self.host = allocate_host_buffers(kv.canonical, num_chunks, blocks_per_chunk)
        self.mover = BlockMover(kv.canonical, self.host)
        self.null_id = manager.pool.null_block.block_id
        tpcs = {g.tokens_per_chunk for g in self.groups}
        self.loads_enabled = len(tpcs) == 1
        self.windowed = any(g.window_chunks is not None for g in self.groups)
        mamba = [s.block_size for s in manager.specs if isinstance(s, Mamba)]
        self.align_tokens = max(tpcs) if mamba else None
        self.stats = OffloadStats()
        self._reqs: dict[str, _ReqState] = {}

    # -- per request -----------------------------------------------------------------------------

    def _state(self, req: Request) -> _ReqState:
        st = self._reqs.get(req.request_id)
        if st is None:
            st = self._reqs[req.request_id] = _ReqState(req.request_id, len(self.groups))
            self.tier.on_new_request(st.ctx)
        if st.num_hashes != len(req.block_hashes):  # tokens were appended: extend the chunk keys
            for g, group in enumerate(self.groups):
                st.keys[g] = chunk_keys(req.block_hashes, group)
                for c, key in enumerate(st.keys[g]):
                    st.ctx.set_position(key, (c + 1) * group.tokens_per_chunk)
            st.num_hashes = len(req.block_hashes)
        return st

    def finished(self, req: Request) -> None:
        st = self._reqs.pop(req.request_id, None)
        if st is not None:
            self.tier.on_request_finished(st.ctx)

    # -- load ------------------------------------------------------------------------------------

    def lookup(self, req: Request, gpu_hit: int) -> int:
        """Tokens the CPU tier adds beyond the GPU hit (whole chunks; 0 for none)."""
        if not self.loads_enabled:
            return 0
        st = self._state(req)
        self.stats.lookups += 1
        # The last token is always recomputed; with windowed groups lookup_hit_tokens drops it itself.
        cap = req.num_tokens if self.windowed else req.num_tokens - 1
        ext = lookup_hit_tokens(self.groups, st.keys, self.tier.lookup, gpu_hit, cap,
                                align_tokens=self.align_tokens)
        return ext or 0

    def load(self, req: Request, gpu_hit: int, hit_end: int) -> dict[int, set[int]]:
        """Copy `[gpu_hit, hit_end)` into the request's freshly allocated blocks and verify them.
        Returns the loaded block ids per group (the compute step must not write them)."""
        st = self._state(req)
        table = self.manager.coordinator.block_table(req.request_id)
        keys: list[OffloadKey] = []
        plans = []
        for g, group in enumerate(self.groups):
            plan = load_plan(group, gpu_hit, hit_end)
            if plan.end_block <= plan.first_block:
                continue
            plans.append(plan)
            keys += st.keys[g][plan.first_chunk:plan.end_chunk]
        chunk_ids = dict(zip(keys, self.tier.prepare_load(keys, st.ctx)))
        transfers = []
        loaded: dict[int, set[int]] = {}
        for plan in plans:
            g = plan.group_idx
            ids = [b.block_id for b in table[g][plan.first_block:plan.end_block]]
            if self.null_id in ids:
                raise RuntimeError(f"request {req.request_id}: group {g} has a null block in its load range "
                                   f"[{plan.first_block}, {plan.end_block}) — allocation and load plan disagree")
            transfers.append(GroupTransfer(g, ids, [chunk_ids[k] for k in st.keys[g][plan.first_chunk:plan.end_chunk]],
                                           plan.skip))
            loaded[g] = set(ids)
        handle = self.mover.load(transfers)
        handle.wait()
        self.tier.complete_load(keys, st.ctx)
        self.stats.load_hits += 1
        self.stats.loaded_chunks += len(keys)
        self.stats.loaded_bytes += handle.num_bytes
        self._verify(req, plans, table)
        return loaded

    def _verify(self, req: Request, plans: Sequence, table: Sequence) -> None:
        k_of = {g: s.block_size // self.manager.hash_block_size for g, s in enumerate(self.manager.specs)}
        for plan in plans:
            g, k = plan.group_idx, k_of[plan.group_idx]
            positions = range(plan.first_block, plan.end_block)
            ids = [table[g][p].block_id for p in positions]
            digests = [req.block_hashes[(p + 1) * k - 1] for p in positions]
            bad = self.kv.mismatched(g, ids, digests)
            self.stats.verified_blocks += len(ids) - len(bad)
            self.stats.mismatched_blocks += len(bad)

    # -- store -----------------------------------------------------------------------------------

    def store(self, req: Request, finished: bool = False) -> None:
        """Offer the request's newly complete, computed chunks (see module docstring)."""
        st = self._state(req)
        limit = req.num_prompt_tokens
        if finished:
            limit = max(limit, req.num_tokens - 1)
        offloadable = min(req.num_computed_tokens, limit)
        table = self.manager.coordinator.block_table(req.request_id)
        offer: list[OffloadKey] = []
        where: dict[OffloadKey, tuple[int, list[int]]] = {}
        for g, group in enumerate(self.groups):
            ids = [b.block_id for b in table[g]]
            bpc = group.blocks_per_chunk
            for c in store_chunk_indices(group, st.next_chunk[g], offloadable, ids, len(st.keys[g]), self.null_id):
                key = st.keys[g][c]
                offer.append(key)
                where[key] = (g, ids[c * bpc:(c + 1) * bpc])
            st.next_chunk[g] = max(st.next_chunk[g], min(offloadable // group.tokens_per_chunk,
                                                         len(ids) // bpc, len(st.keys[g])))
        if not offer:
            return
        out = self.tier.prepare_store(offer, st.ctx)
        if out is None:
            self.stats.store_rejected += 1
            return
        if not out.keys_to_store:
            return
        per_group: dict[int, tuple[list[int], list[int]]] = {}
        for key, chunk_id in zip(out.keys_to_store, out.chunk_ids):
            g, ids = where[key]
            blocks, chunks = per_group.setdefault(g, ([], []))
            blocks += ids
            chunks.append(chunk_id)
        handle = self.mover.store([GroupTransfer(g, b, c) for g, (b, c) in per_group.items()])
        handle.wait()
        self.tier.complete_store(out.keys_to_store, st.ctx)
        self.stats.stored_chunks += len(out.keys_to_store)
        self.stats.stored_bytes += handle.num_bytes

    # -- events and lifecycle ---------------------------------------------------------------------

    def take_events(self) -> list:
        return self.tier.take_events()

    def reset(self) -> None:
        """A restarted node: the tier forgets everything, without events."""
        self.tier.reset_cache()
        self._reqs.clear()
