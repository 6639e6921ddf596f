"""A request as the KV cache manager sees it: token ids, hash-unit hashes, and hashing extras."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvpipe.gpu.hashing import BlockHasher, RequestKeys, hash_request_blocks


class Request:
    """Token ids (prompt then output) and their chained hashes at `hash_block_size`.

    Invariant: `block_hashes` covers exactly the full hash units of `all_token_ids` — hashes are
    extended whenever tokens are appended, as vLLM's request block hasher does.
    `shared_prefix_boundary` is set by the manager after a lookup (a junction sparse groups keep).
    """

    __slots__ = ("request_id", "all_token_ids", "num_prompt_tokens", "keys", "block_hashes",
                 "num_computed_tokens", "shared_prefix_boundary", "session_id", "hasher",
                 "hash_block_size")

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], hasher: BlockHasher,
                 hash_block_size: int, keys: RequestKeys | None = None,
                 session_id: str | None = None) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.keys = keys
        self.session_id = session_id
        self.hasher = hasher
        self.hash_block_size = hash_block_size
        self.num_computed_tokens = 0
        self.shared_prefix_boundary = 0
        self.block_hashes: list[bytes] = hash_request_blocks(hasher, self.all_token_ids,
                                                             hash_block_size, keys)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def lora_id(self) -> int | None:
        return self.keys.lora.adapter_id if self.keys is not None and self.keys.lora else None

    @property
    def lora_name(self) -> str | None:
        return self.keys.lora.name if self.keys is not None and self.keys.lora else None

    def append_tokens(self, token_ids: Iterable[int]) -> None:
        self.all_token_ids.extend(token_ids)
        self.block_hashes.extend(hash_request_blocks(self.hasher, self.all_token_ids,
                                                     self.hash_block_size, self.keys,
                                                     self.block_hashes))
