"""Spec kinds: the one table of what kvpipe does for each kind of KV cache group.

vLLM keeps one spec → manager map (`KVCacheSpecRegistry`); kvpipe splits a kind's behaviour over
modules with different users (the pure hit rules serve the router too, the managers need the block
pool, the offload lookup the CPU tier), so this table names each part in one row per kind:

  wire       the `GroupSpec.kind` the kind publishes (`kvpipe.schemas.envelope.KIND_*`), and `reads`:
             the other wire kinds read as it (their hit is this kind's; vLLM publishes them, kvpipe's
             GPU side has no spec of its own for them)
  spec       the `KVSpec` class (its fields and its `GroupSpec` form: `to_group_spec`/`from_group_spec`)
  manager    the single-type manager keeping a request's blocks (`single_type_managers`)
  hit        the hit rule (`kvpipe.gpu.finders.HitRule`: finder, the facts the hybrid search needs, and by
             its name the native engine's code, native/src/hit_rules.toml); None: never prefix-cached
  retention  which newly full blocks get cached (`retention`); None: every one
  offload    the CPU tier's rule for it (`offload_lookup.OffloadGroup.kind`); None: not offloaded
  external   whether its blocks are stored to an external KV pool (`external_coordinator`)

Adding a kind is a spec class and a row here (plus, for a rule no kind had before, its finder in
`finders.py` and `native/src/hit.rs`, and its code in native/src/hit_rules.toml).

References are "module:attribute" strings imported on first use, as `kvpipe/cli.py`'s `COMMANDS`:
the router reads this table without loading the block pool or the CPU tier, and the modules that own
the behaviours import this one without an import cycle. Behaviours are looked up by the spec's
`kind` (a class attribute), so a lookup costs a dict access.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, cast

from kvpipe.schemas.envelope import (
    KIND_CHUNKED_LOCAL,
    KIND_CROSS,
    KIND_FULL,
    KIND_MAMBA,
    KIND_MLA,
    KIND_SINK_FULL,
    KIND_SLIDING,
    KIND_SLIDING_MLA,
)

if TYPE_CHECKING:
    from kvpipe.gpu.finders import HitRule
    from kvpipe.gpu.retention import Mask
    from kvpipe.gpu.single_type_managers import SingleTypeManager
    from kvpipe.gpu.specs import KVSpec

# The hit rules by name: the key of each rule's native code (native/src/hit_rules.toml) and the
# offload lookup's group kinds (`kvpipe.gpu.offload_lookup`), whose rules follow the same families.
RULE_FULL = "full"
RULE_SLIDING = "sliding_window"
RULE_MAMBA = "mamba"
RULE_CHUNKED_LOCAL = "chunked_local"

_UNRESOLVED = object()


class Kind:
    """One row of the table; see the module docstring for the columns."""

    __slots__ = ("wire", "reads", "offload", "external", "_refs", "_got")

    def __init__(self, wire: str, *, spec: str, manager: str, hit: str | None, retention: str | None = None,
                 offload: str | None = None, external: bool = True, reads: tuple[str, ...] = ()) -> None:
        self.wire = wire
        self.reads = reads
        self.offload = offload
        self.external = external
        self._refs = {"spec": spec, "manager": manager, "hit": hit, "retention": retention}
        self._got: dict[str, Any] = {}

    def _get(self, name: str) -> Any:
        got = self._got.get(name, _UNRESOLVED)
        if got is _UNRESOLVED:
            ref = self._refs[name]
            if ref is None:
                got = None
            else:
                module, _, attr = ref.partition(":")
                got = getattr(importlib.import_module(module), attr)
            self._got[name] = got
        return got

    @property
    def spec_class(self) -> type[KVSpec]:
        return cast("type[KVSpec]", self._get("spec"))

    @property
    def manager(self) -> type[SingleTypeManager]:
        return cast("type[SingleTypeManager]", self._get("manager"))

    @property
    def hit(self) -> HitRule | None:
        return cast("HitRule | None", self._get("hit"))

    @property
    def retention(self) -> Mask | None:
        return cast("Mask | None", self._get("retention"))

    def __repr__(self) -> str:
        return f"Kind({self.wire!r}, {self._refs['spec']})"


_SPECS = "kvpipe.gpu.specs"
_MANAGERS = "kvpipe.gpu.single_type_managers"
_FINDERS = "kvpipe.gpu.finders"
_RETENTION = "kvpipe.gpu.retention"

KINDS: tuple[Kind, ...] = (
    Kind(KIND_FULL, spec=f"{_SPECS}:FullAttention", manager=f"{_MANAGERS}:FullAttentionManager",
         hit=f"{_FINDERS}:FULL", offload=RULE_FULL, reads=(KIND_MLA,)),
    Kind(KIND_SINK_FULL, spec=f"{_SPECS}:SinkFullAttention", manager=f"{_MANAGERS}:FullAttentionManager",
         hit=f"{_FINDERS}:FULL", offload=RULE_FULL),
    Kind(KIND_SLIDING, spec=f"{_SPECS}:SlidingWindow", manager=f"{_MANAGERS}:SlidingWindowManager",
         hit=f"{_FINDERS}:SLIDING", retention=f"{_RETENTION}:sliding_mask", offload=RULE_SLIDING,
         reads=(KIND_SLIDING_MLA,)),
    # Prefix caching needs align mode (one state per block end); the spec says so otherwise (`problem`).
    # An external pool does not take Mamba states through the block path.
    Kind(KIND_MAMBA, spec=f"{_SPECS}:Mamba", manager=f"{_MANAGERS}:MambaAlignManager",
         hit=f"{_FINDERS}:MAMBA", retention=f"{_RETENTION}:mamba_mask", offload=RULE_MAMBA, external=False),
    Kind(KIND_CHUNKED_LOCAL, spec=f"{_SPECS}:ChunkedLocal", manager=f"{_MANAGERS}:ChunkedLocalManager",
         hit=f"{_FINDERS}:CHUNKED_LOCAL", offload=RULE_CHUNKED_LOCAL),
    Kind(KIND_CROSS, spec=f"{_SPECS}:CrossAttention", manager=f"{_MANAGERS}:CrossAttentionManager",
         hit=None, external=False),
)

_BY_KIND = {k.wire: k for k in KINDS}
_BY_WIRE = {**{alias: k for k in KINDS for alias in k.reads}, **_BY_KIND}


def kind_of(spec: KVSpec) -> Kind:
    """The row of `spec`'s kind; ValueError for a spec class no row names."""
    row = _BY_KIND.get(spec.kind)
    if row is None:
        raise ValueError(f"no spec kind {spec.kind!r} ({type(spec).__name__}) in kvpipe.gpu.kinds.KINDS")
    return row


# hit_rule's answers by spec class: the hybrid search asks several times per spec group and search
_HIT_BY_CLASS: dict[type, HitRule | None] = {}


def hit_rule(spec: KVSpec) -> HitRule | None:
    """`spec`'s hit rule; None when its kind never takes part in prefix caching."""
    try:
        return _HIT_BY_CLASS[spec.__class__]
    except KeyError:
        rule = _HIT_BY_CLASS[spec.__class__] = kind_of(spec).hit
        return rule


def read_as(wire_kind: str) -> Kind | None:
    """The row a published `GroupSpec.kind` is read as (its own, or the one that `reads` it)."""
    return _BY_WIRE.get(wire_kind)
