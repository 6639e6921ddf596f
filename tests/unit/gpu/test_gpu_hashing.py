"""Block hashing reproduces vLLM 0.33 byte for byte (vectors in docs/vllm-behaviour.md §3.6)."""
from __future__ import annotations

import pytest

from kvpipe.gpu.hashing import (
    DEFAULT_NONE_HASH_SEED,
    BlockHasher,
    LoRA,
    MMFeature,
    RequestKeys,
    block_extra_keys,
    coarse_hashes,
    external_hash,
    group_key,
    hash_request_blocks,
    sha256,
    to_event_extra_keys,
)

NO_SEED_ENV: dict[str, str] = {}

VECTORS = {
    # algorithm: (NONE_HASH hex, h0 hex, h0 int, h1 hex, h1 int)
    "sha256": ("066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
               "9da1c53089c000ad1a79a77c143b68dda00e2a85315bc1f690bbd03ba4a195dd", 10429158316690216413,
               "1c9b6c0620e875631f1c5395ed56f2243aa113f88fc842f04fbb0654074b8d43", 5745192707610611011),
    "sha256_cbor": ("9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
                    "c49ab11fb576db6f376aef58c24f728a0ba1807e8cac5f940f1a5c4c20741898", 1088283741995145368,
                    "9d0a7c928c548f9aeea31ae98471cf515045a206851732ac14cb3083c18d40f9", 1498344643476930809),
}


@pytest.mark.parametrize("algorithm", sorted(VECTORS))
def test_two_block_chain_matches_the_pinned_vectors(algorithm: str) -> None:
    none_hex, h0_hex, h0_int, h1_hex, h1_int = VECTORS[algorithm]
    hasher = BlockHasher(algorithm, env=NO_SEED_ENV)
    assert hasher.none_hash.hex() == none_hex
    h0, h1 = hash_request_blocks(hasher, list(range(8)), 4)
    assert (h0.hex(), h1.hex()) == (h0_hex, h1_hex)
    assert (external_hash(h0), external_hash(h1)) == (h0_int, h1_int)
    assert external_hash(h0, int_hashes=False) == h0


@pytest.mark.parametrize("extra, prefix, suffix", [
    ((("cache_salt", "salt"),), "7c117832", "1c5cff"),
    ((("lora", "adapter", "/path/to/lora"),), "6a0f9047", "1a34a3"),
    ((("mm", "hash1", 2),), "8f385bc0", "6c8ed3"),
])
def test_first_block_with_one_extra_key_matches_the_pinned_vectors(extra, prefix, suffix) -> None:
    h = BlockHasher("sha256", env=NO_SEED_ENV).hash_block(None, (0, 1, 2, 3), extra).hex()
    assert h.startswith(prefix) and h.endswith(suffix)


def test_none_hash_seed_comes_from_pythonhashseed_when_set() -> None:
    hasher = BlockHasher("sha256", env={"PYTHONHASHSEED": "123"})
    assert hasher.none_hash == sha256("123")
    assert hasher.seed_rule == "pythonhashseed"
    assert BlockHasher("sha256", env=NO_SEED_ENV).seed == DEFAULT_NONE_HASH_SEED


def test_parent_of_block_zero_is_the_none_hash() -> None:
    hasher = BlockHasher("sha256", env=NO_SEED_ENV)
    assert hasher.hash_block(None, [1, 2]) == sha256((hasher.none_hash, (1, 2), None))


def test_only_full_units_are_hashed_and_hashing_is_incremental() -> None:
    hasher = BlockHasher("sha256", env=NO_SEED_ENV)
    tokens = list(range(11))
    first = hash_request_blocks(hasher, tokens[:7], 4)
    assert len(first) == 1  # 7 tokens: one full unit of 4
    more = hash_request_blocks(hasher, tokens, 4, prior=first)
    assert first + more == hash_request_blocks(hasher, tokens, 4)
    assert len(more) == 1


def test_lora_key_is_on_every_block_and_salt_only_on_the_first() -> None:
    keys = RequestKeys(lora=LoRA("ad", "/p", 7), cache_salt="s")
    assert block_extra_keys(keys, 0, 4) == (("lora", "ad", "/p"), ("cache_salt", "s"))
    assert block_extra_keys(keys, 4, 8) == (("lora", "ad", "/p"),)
    assert block_extra_keys(None, 0, 4) is None


def test_mm_keys_carry_the_offset_relative_to_the_block_even_when_negative() -> None:
    keys = RequestKeys(mm_features=[MMFeature("img", 2, 5), MMFeature("aud", 9, 2)])
    assert block_extra_keys(keys, 0, 4) == (("mm", "img", 2),)
    assert block_extra_keys(keys, 4, 8) == (("mm", "img", -2),)
    assert block_extra_keys(keys, 8, 12) == (("mm", "aud", 1),)
    assert block_extra_keys(keys, 12, 16) is None


def test_prompt_embeds_digest_enters_the_key() -> None:
    torch = pytest.importorskip("torch")
    embeds = torch.arange(16, dtype=torch.float32).reshape(8, 2)
    import hashlib
    digest = hashlib.sha256(embeds[0:4].contiguous().view(torch.uint8).numpy().tobytes()).digest()
    assert block_extra_keys(RequestKeys(prompt_embeds=embeds), 0, 4) == (("prompt_embeds", digest),)


def test_changing_the_lora_path_changes_every_hash_but_events_do_not_show_it() -> None:
    hasher = BlockHasher("sha256", env=NO_SEED_ENV)
    a = hash_request_blocks(hasher, list(range(8)), 4, RequestKeys(lora=LoRA("ad", "/v1")))
    b = hash_request_blocks(hasher, list(range(8)), 4, RequestKeys(lora=LoRA("ad", "/v2")))
    assert all(x != y for x, y in zip(a, b))
    assert to_event_extra_keys([(("lora", "ad", "/v1"),)]) == to_event_extra_keys([(("lora", "ad", "/v2"),)])


def test_event_extra_keys_are_untagged() -> None:
    tagged = [(("lora", "ad", "/p"), ("mm", "img", -2), ("cache_salt", "s"), ("prompt_embeds", b"d")), None]
    assert to_event_extra_keys(tagged) == [("ad", ("img", -2), "s", b"d"), None]
    assert to_event_extra_keys([]) is None
    assert to_event_extra_keys([None, None]) == [None, None]


def test_salted_and_unsalted_prompts_do_not_collide() -> None:
    hasher = BlockHasher("sha256", env=NO_SEED_ENV)
    plain = hash_request_blocks(hasher, list(range(8)), 4)
    salted = hash_request_blocks(hasher, list(range(8)), 4, RequestKeys(cache_salt="s"))
    assert plain[0] != salted[0] and plain[1] != salted[1]  # the salt propagates through the chain


def test_coarse_group_block_uses_the_last_fine_hash() -> None:
    fine = [b"a", b"b", b"c", b"d", b"e"]
    assert coarse_hashes(fine, 2) == [b"b", b"d"]
    assert coarse_hashes(fine, 1) == fine


def test_group_key_layout_is_hash_then_u32_big_endian() -> None:
    assert group_key(b"\x01\x02", 3) == b"\x01\x02\x00\x00\x00\x03"


def test_unknown_algorithm_is_rejected_with_the_available_ones() -> None:
    with pytest.raises(ValueError, match="sha256"):
        BlockHasher("md5")


def test_a_published_hash_config_rebuilds_the_nodes_hasher_and_a_random_seed_cannot() -> None:
    from kvpipe.gpu.hashing import hasher_from_config
    from kvpipe.schemas.envelope import HashConfig

    node = BlockHasher("sha256_cbor", seed="1234")
    rebuilt = hasher_from_config(node.hash_config(16))
    assert rebuilt.none_hash == node.none_hash and rebuilt.algorithm == "sha256_cbor"
    assert hasher_from_config(HashConfig()).none_hash == sha256(DEFAULT_NONE_HASH_SEED)
    with pytest.raises(ValueError, match="random per-process"):
        hasher_from_config(HashConfig(algorithm="sha256", none_hash_seed_rule="random"))
    with pytest.raises(ValueError, match="without the seed"):
        hasher_from_config(HashConfig(none_hash_seed_rule="pythonhashseed"))
    with pytest.raises(ValueError, match="unknown block-hash algorithm"):
        hasher_from_config(HashConfig(algorithm="md5"))
