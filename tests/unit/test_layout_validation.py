"""Layouts vLLM itself refuses are refused (bridge) or flagged with the reason (processor, router)."""
from __future__ import annotations

import pytest

from kvpipe.gpu.layout import layout_problem, node_layout
from kvpipe.processors.core.index import Index
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec, HashConfig

FA = GroupSpec(group_idx=0, kind="full_attention", block_size=16)


def g(idx, kind, bs, **kw) -> GroupSpec:
    return GroupSpec(group_idx=idx, kind=kind, block_size=bs, **kw)


@pytest.mark.parametrize("specs, cfg, kw, words", [
    ([g(0, "cross_attention", 16)], None, {}, "no prefix-cacheable"),
    ([FA, g(1, "mamba", 64, mamba_cache_mode="all")], None, {}, "mamba_cache_mode 'align'"),
    ([FA, g(1, "sliding_window", 16, sliding_window=64)], None, {"context_parallel": 2}, "context parallelism"),
    ([FA, g(1, "cross_attention", 16)], None, {"store_connector": True}, "cross-attention"),
    ([FA, g(1, "chunked_local_attention", 16, attention_chunk_size=64, eagle=True)], None, {}, "EAGLE"),
    ([g(0, "full_attention", 32), g(1, "chunked_local_attention", 16, attention_chunk_size=64)], None, {},
     "chunked local"),
    ([FA], HashConfig(hash_block_size=8), {}, "not the unit vLLM uses"),
    ([FA, g(1, "full_attention", 64)], HashConfig(hash_block_size=16, prefix_match_unit=8), {}, "must agree"),
    ([FA, g(1, "mamba", 64, mamba_cache_mode="align")], HashConfig(hash_block_size=32), {}, "not a multiple"),
    ([g(0, "full_attention", 64), g(1, "mamba", 128)], HashConfig(hash_block_size=16), {},
     "gcd"),
])
def test_refused_layouts_say_why(specs, cfg, kw, words) -> None:
    problem = layout_problem(specs, cfg, **kw)
    assert problem is not None and words in problem, problem


def test_accepted_layouts() -> None:
    assert layout_problem([FA, g(1, "sliding_window", 16, sliding_window=64)], HashConfig(hash_block_size=16)) is None
    # an explicit unit below the gcd is accepted and turns partial hits on with Mamba
    lay = node_layout([g(0, "mla_attention", 64), g(1, "mamba", 768, mamba_cache_mode="align")],
                      HashConfig(hash_block_size=16, prefix_match_unit=16))
    assert (lay.hash_block_size, lay.alignment, lay.partial_hits) == (16, 16, True)
    assert lay.searched_at_unit(0) and lay.searched_at_unit(1)
    # a cross-attention group next to a cacheable one is fine without a store connector
    assert layout_problem([FA, g(1, "cross_attention", 16)], None) is None


def test_processor_marks_a_node_with_a_refused_layout() -> None:
    index = Index()
    env = Envelope(v=SCHEMA_MAJOR, node_id="n", epoch=1, seq=0, ts=1.0,
                   group_specs=[FA, g(1, "mamba", 64, mamba_cache_mode="none")], hash_config=HashConfig(hash_block_size=16))
    index.apply(env, [], 0, 0)
    node = index.nodes["n"]
    assert node.suspect and "layout vLLM refuses" in node.reason and "align" in node.reason
    ok = Index()
    ok.apply(Envelope(v=SCHEMA_MAJOR, node_id="n", epoch=1, seq=0, ts=1.0, group_specs=[FA],
                      hash_config=HashConfig(hash_block_size=16)), [], 0, 0)
    assert not ok.nodes["n"].suspect
