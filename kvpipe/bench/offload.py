"""`kvpipe bench offload`: GB/s of batched block copies vs one contiguous copy of the same bytes.

The batched copy moves `--moved` scattered blocks (random ids out of `--blocks`) of every layer of
one group between the canonical device views and host chunks, through `BlockMover`. The baseline,
timed in the same run and interleaved with it, is a single `copy_` of one contiguous buffer of the
same size between the same kinds of memory (device -> host, pinned on CUDA). Median of `--reps`.

It also reports what a call costs the host, the bottleneck of small transfers on a GPU:
`ops_per_store` / `ops_per_load` (and the `_scattered` pair) count the torch operations one call
dispatches (views, allocations, index ops, copies; counted by a dispatch mode after warm-up, see
`kvpipe.gpu.offload_checks.count_dispatched_ops`), and `call_us` the median host time until a call
returns, at the bench's size and for a small transfer of `--call-moved` blocks (where dispatch, not
bytes, dominates; on CPU a call is synchronous, so it includes the copy).

Threads default to 1: an offload worker shares the host with the scheduler loop, and on a busy
host every multi-threaded op (one per canonical tensor here) waits at its barrier for the slowest
thread — measured on a loaded 2-core box, 64 two-thread gathers ran ~5x slower than one thread,
while the single big baseline copy barely noticed. `--threads 0` restores torch's default.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import click
import torch

from kvpipe.gpu.canonical import canonicalize
from kvpipe.gpu.kv_tensors import AttentionGeometry, KVLayout, allocate_kv_caches, default_device
from kvpipe.gpu.offload import BlockMover, GroupTransfer, allocate_host_buffers
from kvpipe.gpu.offload_checks import count_dispatched_ops, device_block_checksums, host_block_checksums
from kvpipe.schemas.cliopts import Command, run as run_command


@click.command("offload", cls=Command, help=__doc__)
@click.option("--layers", type=int, default=32, show_default=True, help="attention layers of the group")
@click.option("--blocks", type=int, default=1024, show_default=True, help="device blocks per layer (4096 needs 4 GiB)")
@click.option("--moved", type=int, default=256, show_default=True, help="blocks moved per transfer")
@click.option("--block-size", type=int, default=16, show_default=True, help="tokens per block")
@click.option("--kv-heads", type=int, default=8, show_default=True, help="KV heads per layer")
@click.option("--head-size", type=int, default=64, help="page = 2*block*heads*head*2 B (32 KiB default)")
@click.option("--layout", type=click.Choice([x.value for x in KVLayout]), default=KVLayout.FLASH_ATTN.value,
              show_default=True, help="KV cache tensor layout")
@click.option("--blocks-per-chunk", type=int, default=1, show_default=True, help="blocks per host chunk")
@click.option("--reps", type=int, default=5, show_default=True, help="timed repetitions (median reported)")
@click.option("--call-moved", type=int, default=1, show_default=True,
              help="blocks per transfer for the small-call host time")
@click.option("--call-reps", type=int, default=51, show_default=True, help="repetitions of the small call")
@click.option("--threads", type=int, default=1,
              help="torch intra-op threads for both sides (0 = torch default; default 1); see above")
@click.option("--device", default=None, help="cuda or cpu (default: cuda if available)")
def offload_bench(**params: Any) -> dict:
    return _bench(SimpleNamespace(**params))


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    def run(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        handle = fn()
        if hasattr(handle, "wait"):
            handle.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start
    return run


def _bench(args: SimpleNamespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device) if args.device else default_device()
    geometry = AttentionGeometry(args.layers, args.block_size, args.kv_heads, args.head_size,
                                 KVLayout(args.layout))
    caches = allocate_kv_caches([geometry], args.blocks, dtype=torch.float16, device=device)
    for layer in caches.group(0):
        layer.raw.random_(0, 256)
    canonical = canonicalize(caches)
    bpc = args.blocks_per_chunk
    num_chunks = -(-args.moved // bpc)
    host = allocate_host_buffers(canonical, num_chunks, bpc)
    mover = BlockMover(canonical, host)

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randperm(args.blocks, generator=gen)[:args.moved].tolist()
    fresh = GroupTransfer(0, blocks, list(range(num_chunks)))  # a cold tier hands out 0, 1, 2, ...
    scattered = GroupTransfer(0, blocks, torch.randperm(num_chunks, generator=gen).tolist())

    nbytes = canonical.group_bytes_per_block(0) * args.moved
    pin = device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    back = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).random_(0, 256)

    timed: dict[str, Callable[[], object]] = {
        "store": lambda: mover.store([fresh]),
        "load": lambda: mover.load([fresh]),
        "store_scattered": lambda: mover.store([scattered]),
        "load_scattered": lambda: mover.load([scattered]),
        "contiguous_store": lambda: dst.copy_(src, non_blocking=pin),
        "contiguous_load": lambda: src.copy_(back, non_blocking=pin),
    }
    t = _timer(device)
    for fn in timed.values():  # warm-up: first-touch page faults, allocator caches
        t(fn)
    samples: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(args.reps):  # interleaved so drift from neighbours hits every variant alike
        for name, fn in timed.items():
            samples[name].append(t(fn))
    gbps = {name: nbytes / statistics.median(s) / 1e9 for name, s in samples.items()}

    ops = {f"ops_per_{name}": count_dispatched_ops(timed[name])[0]
           for name in ("store", "load", "store_scattered", "load_scattered")}
    small = GroupTransfer(0, blocks[:args.call_moved], list(range(-(-args.call_moved // bpc))))
    calls = {"store": _call_us(lambda: mover.store([fresh]), args.reps),
             "load": _call_us(lambda: mover.load([fresh]), args.reps),
             "small_store": _call_us(lambda: mover.store([small]), args.call_reps),
             "small_load": _call_us(lambda: mover.load([small]), args.call_reps)}
    overlap = _overlap(mover, fresh, device, args.reps) if device.type == "cuda" else None
    mover.store([fresh]).wait()
    verified = bool(torch.equal(device_block_checksums(canonical, 0, blocks),
                                host_block_checksums(canonical, host, fresh)))
    ratio = gbps["store"] / gbps["contiguous_store"]
    return {
        "bench": "offload", "value": round(gbps["store"], 3), "unit": "GB/s",
        "baseline": round(gbps["contiguous_store"], 3), "ratio": round(ratio, 3),
        "device": str(device), "cuda_available": torch.cuda.is_available(),
        "load_gbps": round(gbps["load"], 3),
        "load_ratio": round(gbps["load"] / gbps["contiguous_load"], 3),
        "contiguous_load_gbps": round(gbps["contiguous_load"], 3),
        "store_scattered_chunks_gbps": round(gbps["store_scattered"], 3),
        "load_scattered_chunks_gbps": round(gbps["load_scattered"], 3),
        "bytes_per_transfer": nbytes, "layers": args.layers, "canonical_tensors": len(canonical.tensors),
        "page_bytes": geometry.page_size_bytes(torch.float16), "blocks_moved": args.moved,
        "device_blocks": args.blocks, "blocks_per_chunk": bpc, "layout": args.layout,
        "reps": args.reps, "threads": torch.get_num_threads(), "verified_bytes": verified,
        "overlap": overlap, **ops, "call_us": calls, "call_moved": args.call_moved,
    }


def _call_us(call: Callable[[], object], reps: int) -> float:
    """Median host time (µs) until `call()` returns; each call is waited for before the next."""
    samples = []
    for _ in range(max(1, reps)):
        start = time.perf_counter()
        handle = call()
        samples.append(time.perf_counter() - start)
        handle.wait()  # type: ignore[attr-defined]
    return round(statistics.median(samples) * 1e6, 1)


def _overlap(mover: BlockMover, transfer: GroupTransfer, device: torch.device, reps: int) -> dict:
    """How much of a store hides behind compute (CUDA only): a store issued on its side stream,
    then a burst of half-precision matrix products queued on the compute stream right behind it,
    and the wall time of both against each alone. The store waits only for compute queued *before*
    it (the bytes it copies), so the products after it run concurrently. `hidden` = 1.0 when the
    store costs nothing extra, 0.0 when the two ran one after the other."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.float16)
    products = [8]

    def compute() -> None:
        for _ in range(products[0]):
            a @ a

    def timed(fn: Callable[[], object]) -> float:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def store_only() -> None:
        mover.store([transfer]).wait()

    def both() -> None:
        handle = mover.store([transfer])
        compute()
        handle.wait()

    runs: dict[str, list[float]] = {"compute": [], "store": [], "both": [], "issue": []}
    for fn in (compute, store_only, both):
        timed(fn)  # warm-up
    # a compute burst about as long as the store, so that either could hide the other entirely
    products[0] = max(1, round(products[0] * timed(store_only) / timed(compute)))
    for _ in range(max(3, reps)):
        runs["compute"].append(timed(compute))
        runs["store"].append(timed(store_only))
        runs["both"].append(timed(both))
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        handle = mover.store([transfer])  # host time until the call returns: what the step loop pays
        runs["issue"].append(time.perf_counter() - start)
        handle.wait()
    c, st, b, issue = (statistics.median(runs[k]) for k in ("compute", "store", "both", "issue"))
    return {"compute_ms": round(c * 1e3, 3), "store_ms": round(st * 1e3, 3), "both_ms": round(b * 1e3, 3),
            "store_call_ms": round(issue * 1e3, 3), "products": products[0],
            "hidden": round(max(0.0, min(1.0, (c + st - b) / min(c, st))), 3) if min(c, st) > 0 else None}


def run(argv: list[str]) -> dict | int:
    """`kvpipe bench offload`: the result, or an exit code after help or a usage error."""
    return run_command(offload_bench, argv, "kvpipe bench offload")
