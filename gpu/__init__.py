"""GPU side of kvpipe: the hybrid KV cache manager of a serving node.

Owns: block hashing (`hashing`), group specs (`specs`), the spec kinds (`kinds`: one table, kind →
spec class, manager, hit rule, retention, offload rule, external store), the per-type hit rules
(`finders`) and the pure hybrid hit computation shared with the router (`hit`, `retention`), the block pool with its LRU free queue and prefix-cache map
(`block_pool`), per-attention-type managers (`single_type_managers`), the coordinator
(`coordinator`), the manager facade that a scheduler talks to (`kv_cache_manager`), the
external-pool coordinator (`external_coordinator`), the KV tensors and canonical views
(`kv_tensors`, `canonical`), the offload kernels and checks (`offload`, `offload_checks`), the CPU
tier (`cpu_tier`, `cpu_policies`, `offload_lookup`) and the simulated serving node (`node`).

Semantics follow vLLM 0.33's v1 KV cache manager (HMA), as docs/vllm-behaviour.md states them.
Everything here except the tensor, offload and node modules is pure Python with no I/O; those need
torch (the `kvpipe[gpu]` extra), the rest imports without it (the router uses it).

May import: `schemas` (event structs, kind names), `torch`, and `producer`'s publish interface only.
Must not import `processors` or `infra`. The router (`processors`) may import `kvpipe.gpu.hit`,
`kvpipe.gpu.finders`, `kvpipe.gpu.kinds`, `kvpipe.gpu.retention`, `kvpipe.gpu.specs`, `kvpipe.gpu.layout` and
`kvpipe.gpu.hashing`, which import nothing of ours beyond `schemas` (pyproject.toml's import contracts).
"""

if not __name__.startswith("kvpipe."):  # one module object per file (kvpipe/__init__.py)
    raise ImportError(f"import kvpipe.{__name__}, not {__name__}: the repository's top-level folders are "
                      "subpackages of kvpipe (kvpipe/__init__.py)")
