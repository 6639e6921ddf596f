"""The node's scheduler: token budget, chunked prefill, decode, admission, preemption, rejection."""
from __future__ import annotations

from kvpipe.gpu.node.kv_compute import ModelShape
from kvpipe.gpu.node.node import CaptureSink, Node, NodeConfig
from kvpipe.gpu.node.workload import RequestSpec, SyntheticConfig, SyntheticWorkload, TraceWorkload
from kvpipe.gpu.specs import FullAttention, Mamba, SlidingWindow

SMALL = ModelShape(layers_per_group=1, num_kv_heads=1, head_size=8)
HYBRID = (FullAttention(16), SlidingWindow(16, 64), Mamba(16))


def node_for(specs, requests, **cfg) -> Node:
    cfg.setdefault("cpu_chunks", 0)
    return Node(NodeConfig(specs=tuple(specs), shape=SMALL, **cfg), TraceWorkload(requests), CaptureSink())


def prompt(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 31) % 32000 for i in range(n)]


def test_every_step_stays_within_the_token_budget_and_uses_it_when_busy() -> None:
    wl = SyntheticWorkload(SyntheticConfig(seed=5, arrivals_per_step=1.0))
    node = Node(NodeConfig(specs=HYBRID, gpu_blocks=256, cpu_chunks=0, token_budget=64, shape=SMALL), wl, CaptureSink())
    totals = []
    for _ in range(120):
        r = node.step()
        computed = sum(c.num_tokens for c in r.chunks if not c.loaded)
        assert computed == r.num_computed_tokens <= 64
        totals.append(computed)
    assert max(totals) == 64


def test_long_prompt_is_prefilled_in_budget_sized_chunks_then_decodes_one_token_per_step() -> None:
    spec = RequestSpec("long", prompt(300, 1), max_tokens=5)
    node = node_for([FullAttention(16)], [spec], gpu_blocks=64, token_budget=64)
    chunks = []
    for _ in range(12):
        chunks += [(c.start, c.num_tokens) for c in node.step().chunks]
    assert chunks[:5] == [(0, 64), (64, 64), (128, 64), (192, 64), (256, 44)]
    assert chunks[5:] == [(300, 1), (301, 1), (302, 1), (303, 1)]  # token 305 is sampled, never computed
    assert node.scheduler.stats.finished == 1
    assert node.scheduler.stats.generated_tokens == 5


def test_mamba_groups_get_prefill_chunks_ending_on_block_boundaries() -> None:
    spec = RequestSpec("m", prompt(150, 2), max_tokens=2)
    node = node_for(HYBRID, [spec], gpu_blocks=64, token_budget=40)
    chunks = []
    for _ in range(8):
        chunks += [(c.start, c.num_tokens) for c in node.step().chunks]
    prefill_ends = [s + n for s, n in chunks if s + n < 150]
    assert all(end % 16 == 0 for end in prefill_ends), chunks
    assert all(n <= 40 for _, n in chunks)


def test_decode_tokens_are_the_requests_deterministic_outputs() -> None:
    specs = [RequestSpec(f"r{i}", prompt(40, i), max_tokens=6) for i in range(4)]
    node = node_for(HYBRID, specs, gpu_blocks=128)
    states = {}
    for _ in range(10):
        for c in node.step().chunks:
            states[c.state.spec.request_id] = c.state
    for spec in specs:
        req = states[spec.request_id].req
        assert req.all_token_ids == spec.prompt_token_ids + spec.output_token_ids
    assert node.scheduler.stats.finished == 4


def test_pool_pressure_preempts_the_newest_request_and_everyone_still_finishes_correctly() -> None:
    specs = [RequestSpec(f"r{i}", prompt(60, i), max_tokens=40) for i in range(4)]
    node = node_for([FullAttention(16)], specs, gpu_blocks=20, token_budget=256)
    states = {}
    for _ in range(400):
        for c in node.step().chunks:
            states[c.state.spec.request_id] = c.state
        if node.scheduler.stats.finished == 4:
            break
    stats = node.scheduler.stats
    assert stats.preempted > 0
    assert stats.finished == 4
    for spec in specs:
        assert states[spec.request_id].req.all_token_ids == spec.prompt_token_ids + spec.output_token_ids


def test_a_request_that_cannot_fit_an_empty_pool_is_rejected_not_waited_for_forever() -> None:
    specs = [RequestSpec("huge", prompt(400, 1), max_tokens=2), RequestSpec("ok", prompt(30, 2), max_tokens=2)]
    node = node_for([FullAttention(16)], specs, gpu_blocks=12, token_budget=512)
    for _ in range(10):
        node.step()
    assert node.scheduler.stats.rejected == 1
    assert node.scheduler.stats.finished == 1


def test_two_runs_with_the_same_seed_publish_the_same_event_stream() -> None:
    def run() -> list:
        wl = SyntheticWorkload(SyntheticConfig(seed=9))
        sink = CaptureSink()
        node = Node(NodeConfig(specs=HYBRID, gpu_blocks=128, cpu_chunks=32, shape=SMALL), wl, sink)
        for _ in range(100):
            node.step()
        return sink.captured

    assert run() == run()
