"""The CUDA paths of the offload kernels: pinned host memory, per-direction side streams ordered
after the compute stream, completion events, and the deferred host scatter.

These need a CUDA device; the CPU paths of the same calls are covered by test_offload_kernels.py.
Each ordering test makes one stream deliberately slow (`torch.cuda._sleep`) so that a missing
wait between streams shows up as wrong bytes instead of passing by luck.
"""
from __future__ import annotations

import pytest
import torch

from kvpipe.gpu.canonical import canonicalize
from kvpipe.gpu.kv_tensors import AttentionGeometry, KVLayout, MambaGeometry, allocate_kv_caches
from kvpipe.gpu.offload import BlockMover, GroupTransfer, allocate_host_buffers
from kvpipe.gpu.offload_checks import device_block_checksums, host_block_checksums

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (run this file on a GPU machine)")

NUM_BLOCKS = 64
GROUPS = [
    AttentionGeometry(num_layers=4, block_size=16, num_kv_heads=4, head_size=64),
    AttentionGeometry(num_layers=2, block_size=16, num_kv_heads=4, head_size=64, layout=KVLayout.BLOCK_OUTER),
    MambaGeometry(num_layers=2, conv_dim=64, conv_kernel=4, ssm_heads=4, ssm_head_dim=16, d_state=16,
                  page_size_padded=16384),
]
SLOW_CYCLES = 200_000_000  # ~0.1 s on a current GPU: far longer than any copy below


def _mover(blocks_per_chunk: int = 2, num_chunks: int = 32):
    kv = allocate_kv_caches(GROUPS, NUM_BLOCKS, dtype=torch.bfloat16, device="cuda")
    for layer in kv.layers.values():
        layer.raw.random_(0, 256)
    canon = canonicalize(kv)
    host = allocate_host_buffers(canon, num_chunks, blocks_per_chunk)
    return kv, canon, host, BlockMover(canon, host)


def test_host_buffers_are_pinned_and_the_mover_uses_two_side_streams():
    _, _, host, mover = _mover()
    assert all(t.is_pinned() for t in host.tensors)
    streams = set(mover._streams.values())
    assert len(streams) == 2 and torch.cuda.current_stream() not in streams


def test_store_copies_what_the_compute_stream_wrote_last():
    kv, canon, host, mover = _mover()
    blocks = [5, 17, 18, 40]
    transfer = GroupTransfer(0, blocks, [0, 1])
    fresh = {name: torch.randint(0, 256, layer.raw.shape, dtype=torch.uint8).pin_memory()
             for name, layer in kv.layers.items()}
    torch.cuda._sleep(SLOW_CYCLES)  # the compute stream is busy; its writes land after this
    for name, layer in kv.layers.items():
        layer.raw.copy_(fresh[name], non_blocking=True)
    handle = mover.store([transfer])  # must wait for the writes above, not copy the old bytes
    handle.wait()
    assert torch.equal(host_block_checksums(canon, host, transfer), device_block_checksums(canon, 0, blocks))


def test_store_is_not_done_until_its_event_fires():
    _, canon, host, mover = _mover()
    transfer = GroupTransfer(0, [1, 2, 3], [4, 5])
    with torch.cuda.stream(mover._streams["store"]):
        torch.cuda._sleep(SLOW_CYCLES)
    handle = mover.store([transfer])
    assert not handle.done()  # the side stream is still sleeping: the host bytes are not final
    handle.wait()
    assert handle.done()
    assert torch.equal(host_block_checksums(canon, host, transfer), device_block_checksums(canon, 0, [1, 2, 3]))


def test_loaded_blocks_are_visible_to_the_compute_stream_after_stream_wait():
    kv, canon, host, mover = _mover()
    blocks = [9, 10, 11, 30, 31]
    transfer = GroupTransfer(1, blocks, [2, 3, 4], skip=1)
    mover.store([transfer]).wait()
    expected = host_block_checksums(canon, host, transfer)
    for layer in kv.layers.values():
        layer.raw.zero_()
    with torch.cuda.stream(mover._streams["load"]):
        torch.cuda._sleep(SLOW_CYCLES)  # the load lands late
    handle = mover.load([transfer])
    handle.stream_wait()  # the compute stream waits on the event; the host does not block
    assert torch.equal(device_block_checksums(canon, 1, blocks), expected)
    handle.wait()


@pytest.mark.parametrize("chunks", [
    list(reversed(range(0, 48, 2))),  # no two chunk ids adjacent: pinned staging + deferred host scatter
    list(reversed(range(24))),  # a permutation of adjacent ids: sorted, one direct copy per stack
], ids=["fragmented", "permuted"])
def test_scattered_chunks_round_trip_byte_exact(chunks):
    _, canon, host, mover = _mover(blocks_per_chunk=1, num_chunks=48)
    blocks = list(range(0, 48, 2))
    transfers = [GroupTransfer(g, blocks, chunks) for g in range(len(GROUPS))]
    before = [device_block_checksums(canon, g, blocks) for g in range(len(GROUPS))]
    handle = mover.store(transfers)
    handle.wait()
    for g, t in enumerate(transfers):
        assert torch.equal(host_block_checksums(canon, host, t), before[g])
    for t in canon.tensors:
        t.tensor.zero_()
    mover.load(transfers).wait()
    for g in range(len(GROUPS)):
        assert torch.equal(device_block_checksums(canon, g, blocks), before[g])


def test_simulated_node_offloads_and_verifies_loads_on_cuda():
    from kvpipe.gpu.node.cli import parse_groups
    from kvpipe.gpu.node.node import CountingSink, Node, NodeConfig
    from kvpipe.gpu.node.workload import SyntheticConfig, SyntheticWorkload

    config = NodeConfig(node_id="cuda-node", specs=parse_groups("full:16,sliding_window:16:64"),
                        gpu_blocks=96, cpu_chunks=512, device="cuda")
    node = Node(config, SyntheticWorkload(SyntheticConfig(seed=3, num_system_prompts=4, arrivals_per_step=0.5)),
                CountingSink())
    node.run(steps=400)
    summary = node.summary(1.0)
    assert summary["cache"]["device"].startswith("cuda")
    off = summary["offload"]
    assert off["stored_chunks"] > 0 and off["loaded_chunks"] > 0 and summary["tokens"]["cpu_hit_tokens"] > 0
    assert off["verified_blocks"] > 0 and off["mismatched_blocks"] == 0  # every load checked byte for byte
