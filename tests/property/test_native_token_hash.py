"""The native chain of vLLM's default block hash (`native.sha256_token_chain`, native/src/tokenhash.rs)
equals the reference (`kvpipe.gpu.hashing`: SHA-256 over pickle protocol 5) on random prompts: hash units of
1 to 40 tokens (the 1-, 2- and 3-tuple forms and the marked one), token ids across pickle's int forms,
both external forms, and the none-hash of other seeds. Token ids outside what it writes give None, and the
router then hashes in Python, so its answer is the reference's either way."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.gpu.hashing import BlockHasher, external_hash, hash_request_blocks
from kvpipe.processors.core import native
from kvpipe.processors.router import hashing
from kvpipe.schemas.envelope import HashConfig
from tests.nativecheck import require_native_core

require_native_core()

TOKENS = st.one_of(st.integers(0, 255), st.integers(256, 65_535), st.integers(65_536, 2**31 - 1),
                   st.integers(-(2**31), -1), st.integers(0, 151_935))


@settings(max_examples=400, deadline=None)
@given(st.lists(TOKENS, max_size=300), st.integers(1, 40), st.booleans(), st.sampled_from(["vllm-none-hash", "42", ""]))
def test_the_native_chain_equals_the_reference(tokens, unit, ints, seed):
    hasher = BlockHasher("sha256", seed=seed)
    want = [external_hash(d, ints) for d in hash_request_blocks(hasher, tokens, unit)]
    assert native.sha256_token_chain(hasher.none_hash, tokens, unit, ints) == want


@settings(max_examples=100, deadline=None)
@given(st.lists(TOKENS, min_size=1, max_size=40), st.sampled_from([2**31, 2**40, -(2**31) - 1, 2**63]))
def test_tokens_past_the_four_byte_form_are_left_to_the_reference(tokens, big):
    hasher = BlockHasher("sha256")
    tokens = tokens + [big]
    assert native.sha256_token_chain(hasher.none_hash, tokens, len(tokens), True) is None
    # the router's hashes are the reference's all the same
    config = HashConfig(algorithm="sha256", hash_block_size=len(tokens))
    got = hashing.ConfigHashes(config, tokens, None).views.at(len(tokens))
    assert got == [external_hash(d, True) for d in hash_request_blocks(hasher, tokens, len(tokens))]


def test_a_long_unit_past_pickles_frame_target_is_left_to_the_reference():
    hasher = BlockHasher("sha256")
    tokens = [2**30] * 20_000  # 5 bytes a token: past 64 KiB in one unit
    assert native.sha256_token_chain(hasher.none_hash, tokens, len(tokens), True) is None
