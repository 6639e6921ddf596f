"""`kvpipe bench offload` at a toy size: the bytes verify and the op counts it reports are per call,
not per layer."""
from __future__ import annotations

import torch

from kvpipe.bench.offload import run


def _bench(layers: int) -> dict:
    threads = torch.get_num_threads()
    try:
        out = run(["--layers", str(layers), "--blocks", "32", "--moved", "8", "--head-size", "8", "--reps", "1",
                   "--call-reps", "1", "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)  # the bench pins one thread; leave the suite as it was
    assert isinstance(out, dict), out
    return out


def test_the_bench_reports_op_counts_that_do_not_grow_with_the_layers():
    few, many = _bench(2), _bench(12)
    assert few["verified_bytes"] and many["verified_bytes"]
    assert many["canonical_tensors"] == 24
    keys = ("ops_per_store", "ops_per_load", "ops_per_store_scattered", "ops_per_load_scattered")
    assert [few[k] for k in keys] == [many[k] for k in keys]
    assert all(many[k] > 0 for k in keys)  # the counter saw the call's ops
    assert set(many["call_us"]) == {"store", "load", "small_store", "small_load"}
