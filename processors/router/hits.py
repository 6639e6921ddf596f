"""The router's hit search for every candidate node of a request in one call, on one of two engines
with one set of rules (`kvpipe.gpu.hit`, the readable reference):

  "native"  the native core's `HitEngine` (`kvpipe.processors.core.native`): each node layout's
            spec model is registered once and kept by id, held positions go in as the sets
            `hma.held_positions` builds, every node is searched in one call.
  "python"  `hma.hybrid_hit` per node.

"native" is the default when the native core runs; tests/property/test_native_hit.py holds the two
equal. A spec group goes to the native engine as its hit rule's code (`kvpipe.gpu.finders.HitRule.name`
looked up in `HitEngine.RULES`, which the crate builds from native/src/hit_rules.toml) and the rule's
one parameter. A layout the native engine does not model (a rule it lacks, or one `kvpipe.gpu.hit`
refuses: chunked local attention off its block or with EAGLE, Mamba outside align mode, no
prefix-cacheable group) is searched by the reference, so its error reaches the node's row unchanged.
"""
from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Literal, NamedTuple

from kvpipe.gpu.finders import is_fine_grained, refusal, supports_fine_grained
from kvpipe.gpu.hit import split_spec_groups
from kvpipe.gpu.specs import KVSpec
from kvpipe.processors.core import native as native_core
from kvpipe.processors.router.hma import NodeModel, hybrid_hit

Engine = Literal["native", "python"]
ENGINES: tuple[Engine, ...] = ("native", "python")
_LAYOUT_CACHE_MAX = 65_536  # (model object, searched groups) pairs kept: about one per node


class Job(NamedTuple):
    """One search: a node's model, the groups searched (in its order), their lists, the held
    position set per group, and the cap in tokens."""

    model: NodeModel
    groups: tuple[int, ...]
    lens: tuple[int, ...]
    sets: Sequence[Set[int]]
    cap: int


class Hit(NamedTuple):
    length: int
    # per searched group, its found list as `(start, end)`: `end` slots, real blocks at `start..end`
    # (`kvpipe.gpu.hit.HybridHit.masks` is always null slots then real ones: `[False] * start + [True] * ...`)
    spans: tuple[tuple[int, int], ...]


def native_available() -> bool:
    return native_core.engine() == "native"


def default_engine() -> Engine:
    return "native" if native_available() else "python"


class _NativeLayout(NamedTuple):
    id: int
    units: tuple[int, ...]  # tokens per list entry, per searched group (for num_hashed)


class HitSearch:
    """Searches jobs on `engine` ("native" falls back to "python" when the extension is absent)."""

    def __init__(self, engine: Engine | None = None) -> None:
        engine = engine or default_engine()
        if engine not in ENGINES:
            raise ValueError(f"hit search engine must be one of {ENGINES}, got {engine!r}")
        self.engine: Engine = engine if engine == "python" or native_available() else "python"
        self._native = native_core.hit_engine() if self.engine == "native" else None
        # the native code of each hit rule, by the rule's name (native/src/hit_rules.toml, built in)
        self._codes: dict[str, int] = dict(self._native.RULES) if self._native is not None else {}
        self._layouts: dict[tuple, tuple[NodeModel, _NativeLayout | None]] = {}
        self._by_value: dict[tuple, _NativeLayout | None] = {}  # equal layouts share one native model

    def search(self, jobs: Sequence[Job]) -> list[Hit | str]:
        """Per job its hit, or why the node's groups have no hit rule (a ValueError's text)."""
        out: list[Hit | str | None] = [None] * len(jobs)
        native: list[tuple[int, _NativeLayout]] = []
        for i, job in enumerate(jobs):
            # a negative cap (no tokens) is left to the reference, whose slicing defines it
            layout = self._layout(job) if self._native is not None and job.cap >= 0 else None
            if layout is None:
                out[i] = _reference(job)
            else:
                native.append((i, layout))
        if native:
            lens: list[int] = []
            sets: list[Set[int]] = []
            caps, hashed = [], []
            for i, layout in native:
                job = jobs[i]
                lens.extend(job.lens)
                sets.extend(job.sets)
                caps.append(job.cap)
                hashed.append(max(n * u for n, u in zip(job.lens, layout.units)))
            assert self._native is not None
            answers = self._native.search([lay.id for _, lay in native], caps, hashed, lens, sets)
            for (i, _), (length, spans) in zip(native, answers):
                out[i] = Hit(length, tuple(spans))
        return out  # type: ignore[return-value]

    @property
    def native_engine(self):
        """The native engine holding the registered layouts (None on the Python engine)."""
        return self._native

    def native_layout(self, model: NodeModel, groups: tuple[int, ...]) -> _NativeLayout | None:
        """The native layout of `model` searched on `groups` (registered on first use), or None when
        the native engine does not model it or is not in use."""
        if self._native is None:
            return None
        return self._layout(Job(model, groups, (), (), 0))

    def _layout(self, job: Job) -> _NativeLayout | None:
        # By the model's identity (hma.node_model keeps one per publication; hashing the
        # frozen dataclass would cost more than the search), the model kept to pin its id.
        key = (id(job.model), job.groups)
        got = self._layouts.get(key)
        if got is not None and got[0] is job.model:
            return got[1]
        if len(self._layouts) >= _LAYOUT_CACHE_MAX:
            self._layouts.clear()  # node models come and go: drop the identities, keep the native models
            if len(self._by_value) >= _LAYOUT_CACHE_MAX // 16:  # many distinct layouts: start afresh
                self._by_value.clear()
                self._native = native_core.hit_engine()
        value = (job.model, job.groups)
        try:
            layout = self._by_value[value]
        except KeyError:
            layout = self._register(job.model, job.groups)
        self._by_value[value] = layout
        self._layouts[key] = (job.model, layout)
        return layout

    def _register(self, model: NodeModel, groups: tuple[int, ...]) -> _NativeLayout | None:
        specs = _specs(model, groups)
        try:
            spec_groups = split_spec_groups(specs, model.eagle_positions(groups))
        except ValueError:
            return None
        args: list[tuple[int, int, int, bool, list[int]]] = []
        for sg in spec_groups:
            s, rule = sg.spec, sg.rule
            code = self._codes.get(rule.name)
            if code is None or refusal(s, sg.eagle, model.alignment) is not None:
                return None  # a rule the native engine lacks, or one the reference refuses (with the reason)
            args.append((code, s.block_size, rule.param(s), sg.eagle, list(sg.group_ids)))
        assert self._native is not None
        lid = self._native.add_layout(len(groups), args, model.alignment)
        # kvpipe.gpu.hit.GroupViews.num_tokens: a fine-grained group's list is at the hash unit
        fine_unit = any(supports_fine_grained(s) and is_fine_grained(s.block_size, model.alignment) for s in specs)
        units = tuple(model.alignment if fine_unit and is_fine_grained(s.block_size, model.alignment)
                      and supports_fine_grained(s) else s.block_size for s in specs)
        return _NativeLayout(lid, units)


def _specs(model: NodeModel, groups: Sequence[int]) -> list[KVSpec]:
    """The specs of `groups`, which callers take from the node's own groups."""
    specs = [model.spec_of(g) for g in groups]
    missing = [g for g, s in zip(groups, specs) if s is None]
    if missing:
        raise ValueError(f"groups {missing} are not the node's (its groups: {list(model.groups)})")
    return [s for s in specs if s is not None]


def _reference(job: Job) -> Hit | str:
    lists = {g: range(n) for g, n in zip(job.groups, job.lens)}
    try:
        hh = hybrid_hit(job.model, job.groups, lists, job.sets, job.cap)
    except ValueError as exc:
        return str(exc)
    return Hit(hh.length, tuple(_span(m) for m in hh.masks))


def _span(mask: list[bool]) -> tuple[int, int]:
    start = next((i for i, real in enumerate(mask) if real), len(mask))
    if not all(mask[start:]):
        raise AssertionError(f"a found list with a null slot after a real one: {mask}")
    return start, len(mask)
