"""The CUDA branch of `BlockMover` run on the CPU, with stand-ins for streams, events and pinning.

test_offload_cuda.py checks the real thing but needs a GPU; this file checks, on any machine, the
part of the CUDA branch that is plain bookkeeping: the one index upload per call sliced per
segment, the direct copies of host-row runs, the pinned staging of fragmented or narrowed rows, and
the host scatter deferred to the handle's completion — byte for byte against the reference copy.
Asynchrony and stream ordering are not simulated (every copy lands at once); only the deferral is.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from kvpipe.gpu.offload import BlockMover
from tests.unit.gpu.offload_fixtures import (
    LAYOUTS, PATTERNS, assert_same, reference_load, reference_store, transfers, twins,
)


class _Stream:
    def wait_stream(self, other: object) -> None:
        pass


class _Event:
    """Fires on the second `query()`: the first `done()` of a handle sees the copy in flight."""

    def __init__(self) -> None:
        self.queries = 0

    def record(self, stream: object) -> None:
        pass

    def query(self) -> bool:
        self.queries += 1
        return self.queries > 1

    def synchronize(self) -> None:
        self.queries = 1


@pytest.fixture
def cuda_standins(monkeypatch):
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):  # pinned memory needs a driver; plain memory will do
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)


def _cuda_mover(canon, host) -> BlockMover:
    mover = BlockMover(canon, host)
    mover._cuda = True
    mover._streams = {"store": _Stream(), "load": _Stream()}
    return mover


@pytest.mark.parametrize("bpc", [1, 4])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cuda_branch_matches_the_reference(cuda_standins, name, pattern, bpc):
    kv, twin, canon, ref_canon, host, ref_host = twins(name, bpc, 11, pin=False)
    rng = np.random.default_rng(11)
    mover = _cuda_mover(canon, host)
    stored = transfers(name, pattern, bpc, rng)
    handle = mover.store(stored)
    deferred = bool(handle._finish)
    assert not handle.done()  # the event has not fired: nothing deferred may have run yet
    assert bool(handle._finish) == deferred
    handle.wait()
    assert handle.done() and not handle._finish and not handle._keepalive
    reference_store(ref_canon, ref_host, stored, bpc)
    assert_same(kv, twin, host, ref_host)
    loaded = [type(tr)(tr.group_idx, [int(b) for b in rng.permutation(tr.gpu_block_ids)], tr.cpu_chunk_ids,
                       tr.skip) for tr in stored]
    mover.load(loaded).wait()
    reference_load(ref_canon, ref_host, loaded, bpc)
    assert_same(kv, twin, host, ref_host)


def test_fragmented_chunks_are_scattered_only_when_the_handle_completes(cuda_standins):
    kv, twin, canon, ref_canon, host, ref_host = twins("flash_attn", 1, 4, pin=False)
    mover = _cuda_mover(canon, host)
    stored = transfers("flash_attn", "fragmented_both", 1, np.random.default_rng(4))
    before = [p.clone() for p in host.pools]
    handle = mover.store(stored)
    assert handle._finish and not handle.done()
    assert all(torch.equal(p, b) for p, b in zip(host.pools, before))  # host bytes untouched so far
    assert handle.done()
    reference_store(ref_canon, ref_host, stored, 1)
    assert_same(kv, twin, host, ref_host)
