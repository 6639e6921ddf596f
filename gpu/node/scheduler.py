"""The step loop's scheduler: token budget, chunked prefill, decode, admission, preemption.

Per step, in vLLM's order:
1. Running requests, oldest first: a prefill chunk (chunked to the remaining budget, clipped to
   Mamba block ends by `mamba_aligned_chunk`) or one decode token. If the pool cannot hold the
   new tokens, the *newest* running request is preempted (freed, back to the head of the queue,
   recomputed later — its cached blocks may still hit) until it fits or the request itself was
   the newest.
2. Waiting requests, FCFS, while budget and seats last: GPU prefix hit (`get_computed_blocks`,
   capped at `num_tokens - 1`); if the CPU tier reaches further, a load-only admission (blocks
   allocated for the loaded tokens, bytes copied in and verified; computing starts next step);
   else the first chunk. The first request that does not fit stops admission (no overtaking,
   so a large request cannot starve); one that could never fit, even in an empty pool, is rejected.
3. Compute: every full block the step completed gets its deterministic bytes (`KVCompute`).
4. A request whose last scheduled token was its last token samples one output token; at
   `max_tokens` it finishes. Offload stores run for every scheduled request, then finished
   requests are freed (their blocks join the LRU free queue: evicted on reuse -> BlockRemoved).

Invariant: the sum of computed tokens scheduled in a step never exceeds `token_budget`; loaded
tokens are copies, not compute, and do not count.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvpipe.gpu.kv_cache_manager import KVCacheManager
from kvpipe.gpu.node.kv_compute import KVCompute
from kvpipe.gpu.node.offload_driver import OffloadDriver
from kvpipe.gpu.node.workload import RequestSpec
from kvpipe.gpu.request import Request


@dataclass(slots=True, eq=False)
class ReqState:
    spec: RequestSpec
    req: Request
    num_output: int = 0
    order: int = 0  # admission order, for "newest running" = lowest priority
    preemptions: int = 0


@dataclass(slots=True, eq=False)
class Chunk:
    """Tokens `[start, start + num_tokens)` of a request computed this step; `loaded` blocks (per
    group) were filled from the CPU tier instead."""

    state: ReqState
    start: int
    num_tokens: int
    loaded: dict[int, set[int]] = field(default_factory=dict)


@dataclass(slots=True)
class SchedulerStats:
    arrived: int = 0
    admitted: int = 0
    finished: int = 0
    preempted: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    max_step_tokens: int = 0


@dataclass(slots=True)
class StepResult:
    step: int
    chunks: list[Chunk]
    finished: list[ReqState]
    num_computed_tokens: int


class Scheduler:
    def __init__(self, manager: KVCacheManager, kv: KVCompute, offload: OffloadDriver | None = None, *,
                 token_budget: int = 256, max_running: int = 16) -> None:
        if token_budget <= 0 or max_running <= 0:
            raise ValueError(f"token_budget={token_budget} and max_running={max_running} must be positive")
        self.manager = manager
        self.kv = kv
        self.offload = offload
        self.token_budget = token_budget
        self.max_running = max_running
        self.waiting: deque[ReqState] = deque()
        self.running: list[ReqState] = []
        self.stats = SchedulerStats()
        self._order = 0
        self._k = [s.block_size // manager.hash_block_size for s in manager.specs]

    def add(self, spec: RequestSpec) -> ReqState:
        st = ReqState(spec, self.manager.make_request(spec.request_id, spec.prompt_token_ids))
        self.waiting.append(st)
        self.stats.arrived += 1
        self.stats.prompt_tokens += len(spec.prompt_token_ids)
        return st

    def drop_all(self) -> list[ReqState]:
        """Forget every request without freeing (the cache is being wiped); returns them."""
        gone = list(self.running) + list(self.waiting)
        self.running.clear()
        self.waiting.clear()
        return gone

    # -- one step --------------------------------------------------------------------------------

    def step(self, step: int) -> StepResult:
        chunks: list[Chunk] = []
        rejected: list[ReqState] = []
        budget = self.token_budget
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            st = self.running[i]
            req = st.req
            n = self.manager.mamba_aligned_chunk(req, min(req.num_tokens - req.num_computed_tokens, budget))
            while self.manager.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is st:
                    n = 0
                    break
            if n == 0:
                continue  # st was the newest and is gone; the loop ends
            chunks.append(Chunk(st, req.num_computed_tokens, n))
            budget -= n
            i += 1
        if not preempted and len(chunks) == len(self.running):  # no one skipped or pushed out
            budget = self._admit(chunks, budget, rejected)
        self._compute(chunks)
        finished = self._advance(chunks)
        self.stats.max_step_tokens = max(self.stats.max_step_tokens, self.token_budget - budget)
        return StepResult(step, chunks, finished + rejected, self.token_budget - budget)

    def _admit(self, chunks: list[Chunk], budget: int, rejected: list[ReqState]) -> int:
        m = self.manager
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            st = self.waiting[0]
            req = st.req
            blocks, hit = m.get_computed_blocks(req)
            ext = self.offload.lookup(req, hit) if self.offload is not None else 0
            if ext > 0:
                n = ext  # load-only admission: copies now, compute from hit + ext next step
            else:
                n = m.mamba_aligned_chunk(req, min(req.num_tokens - hit, budget), hit)
            if m.allocate_slots(req, n, hit, blocks) is None:
                if not self.running:  # an empty pool cannot hold it: it never will
                    self.waiting.popleft()
                    self.stats.rejected += 1
                    rejected.append(st)
                    continue
                break
            self.waiting.popleft()
            self._order += 1
            st.order = self._order
            self.running.append(st)
            self.stats.admitted += 1
            self.stats.gpu_hit_tokens += hit
            req.num_computed_tokens = hit
            if ext > 0:
                self.stats.cpu_hit_tokens += ext
                assert self.offload is not None
                loaded = self.offload.load(req, hit, hit + ext)
                chunks.append(Chunk(st, hit, ext, loaded))
            else:
                chunks.append(Chunk(st, hit, n))
                budget -= n
        return budget

    def _preempt(self, st: ReqState) -> None:
        self.manager.free(st.req)
        st.req.num_computed_tokens = 0
        st.preemptions += 1
        self.stats.preempted += 1
        self.waiting.appendleft(st)

    # -- compute and bookkeeping -------------------------------------------------------------------

    def _compute(self, chunks: list[Chunk]) -> None:
        """Write every full, real, not-loaded block the step completed, batched per group."""
        co = self.manager.coordinator
        ids: list[list[int]] = [[] for _ in self._k]
        digests: list[list[bytes]] = [[] for _ in self._k]
        for ch in chunks:
            req = ch.state.req
            table = co.block_table(req.request_id)
            end = ch.start + ch.num_tokens
            for g, k in enumerate(self._k):
                bs = self.manager.specs[g].block_size
                blocks = table[g]
                loaded = ch.loaded.get(g, ())
                last = min(end // bs, len(req.block_hashes) // k, len(blocks))
                for b in range(ch.start // bs, last):
                    blk = blocks[b]
                    if blk.is_null or blk.block_id in loaded:
                        continue
                    ids[g].append(blk.block_id)
                    digests[g].append(req.block_hashes[(b + 1) * k - 1])
        for g in range(len(self._k)):
            self.kv.write(g, ids[g], digests[g])

    def _advance(self, chunks: list[Chunk]) -> list[ReqState]:
        finished: list[ReqState] = []
        for ch in chunks:
            st, req = ch.state, ch.state.req
            req.num_computed_tokens = ch.start + ch.num_tokens
            if not ch.loaded:
                self.stats.computed_tokens += ch.num_tokens
            if not ch.loaded and req.num_computed_tokens == req.num_tokens:
                req.append_tokens([st.spec.output_token_ids[st.num_output]])
                st.num_output += 1
                self.stats.generated_tokens += 1
                if st.num_output >= st.spec.max_tokens:
                    finished.append(st)
        if self.offload is not None:
            done = {id(st) for st in finished}
            for ch in chunks:
                self.offload.store(ch.state.req, finished=id(ch.state) in done)
        for st in finished:
            self.running.remove(st)
            self.manager.free(st.req)
            if self.offload is not None:
                self.offload.finished(st.req)
            self.stats.finished += 1
        return finished
