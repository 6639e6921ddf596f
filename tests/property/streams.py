"""Hypothesis strategies for vLLM event streams the property tests share."""
from __future__ import annotations

from hypothesis import strategies as st

from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored


def events(hashes: st.SearchStrategy, media: list, kinds: int) -> st.SearchStrategy:
    """One event: a clear (1 in `kinds` + 1), a store of up to 6 of `hashes` (5 in `kinds` + 1),
    else a removal; groups 0..2 or none, a medium from `media`."""

    @st.composite
    def event(draw):
        group = draw(st.sampled_from([None, 0, 1, 2]))
        medium = draw(st.sampled_from(media))
        kind = draw(st.integers(0, kinds))
        block_hashes = draw(st.lists(hashes, max_size=6))
        if kind == 0:
            return AllBlocksCleared()
        if kind <= 5:
            return BlockStored(block_hashes=block_hashes, parent_block_hash=None, token_ids=[], block_size=16,
                               lora_id=None, medium=medium, lora_name=None, group_idx=group)
        return BlockRemoved(block_hashes=block_hashes, medium=medium, group_idx=group)

    return event()
