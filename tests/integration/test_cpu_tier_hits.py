"""The saved query `cpu_tier_hits` on real chDB: a GPU store while the node's CPU tier holds the same
hash counts as a block loaded from CPU; one without a CPU copy (never offloaded, or offloaded and
evicted before) was recomputed. The answer is computed by hand from the events below, and is the same whether the
analytics app counted each GPU store's CPU copies as it wrote it (`from_cpu_blocks`, processors/analytics/cputier.py)
or the rows carry no count (written before migration 006) and the query counts them itself."""
from __future__ import annotations

import msgspec
import pytest

from kvpipe.processors.analytics.cputier import CpuTier
from kvpipe.processors.analytics.rows import event_rows
from kvpipe.processors.analytics.saved import run_query
from kvpipe.processors.analytics.sink import AnalyticsSink
from kvpipe.processors.analytics.tables import EVENTS
from kvpipe.schemas.codec import encode_vllm_batch
from kvpipe.schemas.envelope import Envelope, GroupSpec
from kvpipe.schemas.events import BlockRemoved, BlockStored

pytestmark = pytest.mark.integration

SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16)]


def stored(hashes: list[int], medium: str) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                       medium=medium, lora_name=None, group_idx=0)


def removed(hashes: list[int], medium: str) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0)


# (node, ts, events): n1 offloads 7 and 9 to CPU; 7 comes back to GPU while its CPU copy lives (a
# load), 8 is new (computed); the CPU tier evicts 7; 7 comes back again (computed this time); 9
# comes back from CPU. n2 never offloads: every GPU store is computed.
MESSAGES = [
    ("n1", 10.0, [stored([7, 9], "CPU")]),
    ("n1", 20.0, [stored([7], "GPU"), stored([8], "GPU")]),
    ("n1", 30.0, [removed([7], "CPU"), removed([7], "GPU")]),
    ("n1", 40.0, [stored([7], "GPU"), stored([9], "GPU")]),
    ("n2", 15.0, [stored([7, 8], "GPU")]),
]


@pytest.mark.parametrize("counted", [True, False], ids=["counted-by-the-app", "rows-without-counts"])
def test_gpu_stores_with_a_live_cpu_copy_count_as_cpu_tier_hits(tmp_path, counted):
    sink = AnalyticsSink(f"chdb://{tmp_path / 'analytics'}", flush_s=0.1)
    sink.start()
    tier = CpuTier()
    written: list[int | None] = []
    try:
        offsets: dict[str, int] = {}
        for node, ts, events in MESSAGES:
            seq = offsets.get(node, 0)
            offsets[node] = seq + 1
            env = Envelope(v=1, node_id=node, epoch=1, seq=seq, ts=ts, group_specs=SPECS if seq == 0 else None,
                           batch=msgspec.Raw(encode_vllm_batch(events, ts)))
            partition = 0 if node == "n1" else 1
            rows = event_rows(env, events, partition, seq, ingest_ts=ts, group_kinds={0: ("full_attention", 16)})
            if counted:
                for row, n in zip(rows, tier.observe(env, events, [r.block_hashes for r in rows], partition)):
                    row.from_cpu_blocks = n
            written += [r.from_cpu_blocks for r in rows]
            sink.submit({EVENTS: rows})
        assert sink.flush(30.0)
        # per event, in MESSAGES order: the GPU stores of 7 (live copy) and 9 (live copy) count, the rest not
        assert written == ([0, 1, 0, 0, 0, 0, 1, 0] if counted else [None] * 8)
        got = run_query(sink, "cpu_tier_hits")
        answer = [dict(zip(got["columns"], row)) for row in got["rows"]]
        assert answer == [
            dict(node_id="n1", group_idx=0, gpu_stores=4, from_cpu=2, cpu_share=0.5, tokens_from_cpu=32),
            dict(node_id="n2", group_idx=0, gpu_stores=2, from_cpu=0, cpu_share=0.0, tokens_from_cpu=0),
        ]
    finally:
        sink.close()
