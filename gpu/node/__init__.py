"""The simulated serving node behind `kvpipe node`.

workload (what clients send) -> scheduler (budget, chunked prefill, decode, admission,
preemption over `kvpipe.gpu.kv_cache_manager`) -> kv_compute (deterministic bytes in real KV tensors)
and offload_driver (CPU tier stores/loads, verified) -> node (events to the publisher, restarts,
summary) -> cli (`kvpipe node` flags).
"""
