"""The native core's one door: `kvpipe_native` (the Rust crate in native/, built by infra/scripts/native.sh) is
imported here and nowhere else, and this module says which engine runs.

The engine, decided once at import:

  "native"  the extension imports and exports the surface this checkout's Python was written against: its
            `API_VERSION` equals ours (native/src/lib.rs states it; bump both, and native/kvpipe_native.pyi, with
            any change to a class, method, argument or answer the Python side uses).
  "python"  otherwise, with the reason (`reason()`): not installed (built with KVPIPE_NATIVE=0, no Rust toolchain,
            a wheel that is not there), or installed from other sources (an older build lacking names, another
            `API_VERSION`). A partial or stale build runs as "python": the native parts (the block store, the batch
            reader, the ingest run, snapshot records, the hit engine, the cohort call, the route decision and
            server, the token hash chain, the analytics rows' Native encoder, the capacity tracker and the analytics
            run) are one surface, versioned together, so one answer covers them all and no caller probes for a single
            feature.

The Python engine is the reference, not a degraded copy: every native part has a Python twin holding the same
rules (`slots.PyStore`, `kvpipe.schemas.codec.decode_vllm_batch`, `Ingest._handle_batch_each`, the snapshot
walk, `kvpipe.gpu.hit` through `router.hma`, the per-node route path, `kvpipe.gpu.hashing`, the analytics app's
`cputier.CapacityTracker`, `derive.message_rows` and clickhouse-connect's encoding), and a property test per part
holds the two equal (tests/property/test_native_*.py). Settings may choose the Python engine where the native one
runs (`index_store`, `route_search_engine`, `analytics_rows_engine`); nothing may choose the native one where it
does not.

Callers ask `engine()` (or `status()` for the reason too) and use the typed calls below; each raises
`NativeUnavailable` with the reason when the Python engine runs, so a native path taken by mistake says why
instead of failing on a missing attribute. `python_engine()` runs the reference with the extension loaded
(tests and benchmarks comparing the two).

The apps report the answer at start-up (one log line when the Python engine runs, and
`kvpipe_processor_engine_info` / `kvpipe_analytics_engine_info` in `/metrics`), and with `require_native`
(KVPIPE_REQUIRE_NATIVE=1) refuse to start on the Python engine (`check_start`: the commands exit 2 before any
worker starts, and an app module imported by Faust's own worker raises).

Types: native/kvpipe_native.pyi describes the extension; maturin ships it in the wheel with `py.typed`, so mypy
checks the calls here, and tests/unit/test_native_facade.py holds it equal to the built module with mypy's
stubtest.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal, NamedTuple, TypeVar

if TYPE_CHECKING:
    from kvpipe_native import Batch, CapacityCore, HitEngine, IndexStore, MemberTable, NativeRouter, NativeRows, \
        RouteServer
    from typing_extensions import Buffer

    from kvpipe.processors.core.outcomes import KafkaRecord

try:
    import kvpipe_native
except ImportError as exc:
    _import_error: ImportError | None = exc
else:
    _import_error = None

Engine = Literal["native", "python"]
API_VERSION = 3  # the extension's surface this module is written against (native/src/lib.rs: API_VERSION)
# Every name the extension exports (the stub's `__all__`; tests/unit/test_native_facade.py holds the two equal).
SURFACE = frozenset({"API_VERSION", "Batch", "CapacityCore", "GPU_MEDIUM", "HitEngine", "IndexStore", "MEDIA_BITS",
                     "MemberTable", "NativeRouter", "NativeRows", "RouteServer", "UNKNOWN_MEDIUM", "analytics_run",
                     "ingest_run", "parse_batch", "read_slot_head", "serve_static", "sha256_token_chain"})
# digests of held prompt units the native route decision remembers (native/src/hashmemo.rs), ~200 bytes each
MEMO_ENTRIES = 65_536
_BUILD = "infra/scripts/native.sh builds it (infra/scripts/venv.sh runs that)"


class Status(NamedTuple):
    engine: Engine
    reason: str  # why the Python engine runs ("" on the native engine)


class NativeUnavailable(RuntimeError):
    """A native path was asked for while the Python engine runs (the message says why it does)."""


def decide(module: object, import_error: ImportError | None) -> Status:
    """The engine for an extension module as imported (`module`), or for the error its import raised."""
    if import_error is not None:
        return Status("python", f"the native core is not installed ({import_error}); {_BUILD}")
    missing = sorted(SURFACE - set(dir(module)))
    if missing:
        return Status("python", f"the installed native core was built from older sources (it lacks "
                                f"{', '.join(missing)}); {_BUILD}")
    version = getattr(module, "API_VERSION")
    if version != API_VERSION:
        return Status("python", f"the installed native core has API version {version}, this kvpipe expects "
                                f"{API_VERSION}; {_BUILD}")
    return Status("native", "")


_status = decide(None if _import_error is not None else kvpipe_native, _import_error)


def status() -> Status:
    return _status


def engine() -> Engine:
    return _status.engine


def reason() -> str:
    """Why the Python engine runs ("" on the native engine)."""
    return _status.reason


def require(what: str) -> None:
    """Raise `NativeUnavailable` unless the native engine runs; `what` names what needs it."""
    if _status.engine != "native":
        raise NativeUnavailable(f"{what} needs the native core, and the Python engine runs: {_status.reason}")


def check_start(app: str, required: bool) -> str | None:
    """What an app says about its engine at start-up: None on the native engine, else the one line to log. With
    `required` (the `require_native` setting) the Python engine is refused: `NativeUnavailable` says why."""
    if _status.engine == "native":
        return None
    if required:
        raise NativeUnavailable(f"{app}: require_native is set (KVPIPE_REQUIRE_NATIVE) and the native core is not in "
                                f"use: {_status.reason}")
    return f"{app}: running on the Python engine, not the native core: {_status.reason}"


@contextmanager
def python_engine(why: str = "the Python engine was asked for") -> Iterator[None]:
    """Run the reference inside the block although the extension is loaded (tests and benchmarks comparing the
    two). Code that made native objects before keeps them; this decides only what is made or asked inside."""
    global _status
    saved = _status
    _status = Status("python", why)
    try:
        yield
    finally:
        _status = saved


# -- the extension's parts, behind the one answer ----------------------------------------------------------------

def index_store() -> IndexStore:
    require("the native index store")
    return kvpipe_native.IndexStore()


def hit_engine() -> HitEngine:
    require("the native hit engine")
    return kvpipe_native.HitEngine()


def hit_rules() -> dict[str, int]:
    """The native hit engine's code per hit rule name (native/src/hit_rules.toml, their one definition); empty on
    the Python engine."""
    if _status.engine != "native":
        return {}
    return dict(kvpipe_native.HitEngine.RULES)


def native_rows(table: str) -> NativeRows:
    """An analytics table's rows as native columns (`kvpipe_native.NativeRows`), encoded for `raw_insert` as
    ClickHouse's Native format; ValueError for a table it does not know."""
    require("the native analytics rows")
    return kvpipe_native.NativeRows(table)


def member_table(owners: Sequence[int], models: Sequence[int]) -> MemberTable:
    require("a native cohort member table")
    return kvpipe_native.MemberTable(owners, models)


def native_router(store: IndexStore, memo_entries: int = MEMO_ENTRIES) -> NativeRouter:
    require("the native route decision")
    return kvpipe_native.NativeRouter(store, memo_entries)


def capacity_core(max_keys: int, stored_cls: type, removed_cls: type) -> CapacityCore:
    """The analytics app's capacity tracker state (processors/analytics/nativetrack.py wraps it); `stored_cls`,
    `removed_cls`: the BlockStored and BlockRemoved classes its calls take events of."""
    require("the native capacity tracker")
    return kvpipe_native.CapacityCore(max_keys, stored_cls, removed_cls)


def media_bits() -> tuple[int, int, int]:
    """The native answers' media mask: (the GPU bit, the unknown-medium bit, how many medium ids have a bit)."""
    require("the native media mask")
    return kvpipe_native.GPU_MEDIUM, kvpipe_native.UNKNOWN_MEDIUM, kvpipe_native.MEDIA_BITS


def parse_batch(payload: bytes) -> Batch | None:
    """vLLM's event batch read natively, or None when the reference decoder reads it: on the Python engine, and
    for any batch outside the strict subset the native reader accepts (native/src/batch.rs)."""
    if _status.engine != "native":
        return None
    return kvpipe_native.parse_batch(payload)


def read_slot_head(record: Buffer) -> tuple[int, str, int]:
    """A snapshot slot record checked whole: (group, medium, entries); ValueError says where it is broken."""
    require("the native snapshot reader")
    return kvpipe_native.read_slot_head(record)


def sha256_token_chain(parent: bytes, tokens: Sequence[int], unit: int,
                       int_hashes: bool) -> list[int] | list[bytes] | None:
    """vLLM's default block hashes of every full `unit` of `tokens`, chained from `parent`, in the published form;
    None where Python hashes (the Python engine, or a shape the native chain leaves to the reference)."""
    if _status.engine != "native":
        return None
    return kvpipe_native.sha256_token_chain(parent, tokens, unit, int_hashes)


# Answers of `IndexStore.apply_events` / `apply_batch`: (stopped at, stored, removed, unknown, [(slot, refused
# stores)], then the entries that ended as columns: keys, store times, event indexes, slots)
Applied = tuple[int, int, int, int, list[tuple[int, int]], list[int], list[float], list[int], list[int]]
# Answers of `IndexStore.route_cohort`: per member holding any requested block (member index, gpu tokens, any
# tokens, per group (gpu blocks, blocks used, media mask, longest held prefixes or None)); a group's prefixes are
# ([(medium id, or -1 for GPU, blocks)], blocks on any medium)
Prefixes = tuple[list[tuple[int, int]], int]
CohortRow = tuple[int, int, int, list[tuple[int, int, int, Prefixes | None]]]

_Node = TypeVar("_Node")
_Record = TypeVar("_Record", bound="KafkaRecord")
# Per node a run met: (its state object, seq, last seen, last offset, (envelopes, heartbeats, events, stored,
# removed, unknown), dp rank, load, spec mismatches, [(slot, refused stores)])
RunNode = tuple[_Node, int, float, int, tuple[int, int, int, int, int, int], int | None,
                tuple[int | None, int | None, float | None] | None, int, list[tuple[int, int]]]
# (stop, now at stop, applied offset, stream ts, ingest ts, published, (messages, skipped, offset holes, ended),
# per node changed, error): native/src/ingestrun.rs says each
RunOut = tuple[int, float | None, int | None, float, float | None, list[float], tuple[int, int, int, int],
               list[RunNode[_Node]], str | None]


def ingest_run(store: IndexStore, records: list[_Record], start: int, partition: int, last_offset: int | None,
               stream_ts: float, nodes: Mapping[str, _Node], tracks: Callable[[str], bool] | None,
               clock: Callable[[], float], max_bytes: int, max_skew_s: float, ttl_s: float | None, cap: int | None,
               headers: Sequence[tuple[str, bytes]]) -> RunOut[_Node]:
    """One native ingest run (see `kvpipe.processors.core.ingestrun`)."""
    require("the native ingest run")
    return kvpipe_native.ingest_run(store, records, start, partition, last_offset, stream_ts, nodes, tracks, clock,
                                    max_bytes, max_skew_s, ttl_s, cap, headers)


# One run's analytics rows (kv_events, kv_block_lifetimes, kv_restores, kv_node_load)
RunRows = tuple["NativeRows", "NativeRows", "NativeRows", "NativeRows"]


def analytics_run(store: IndexStore, records: list[_Record], start: int, partition: int, last_offset: int | None,
                  stream_ts: float, nodes: Mapping[str, _Node], clock: Callable[[], float], max_bytes: int,
                  max_skew_s: float, ttl_s: float | None, cap: int | None, headers: Sequence[tuple[str, bytes]],
                  tracker: CapacityCore | None) -> tuple[RunOut[_Node], RunRows]:
    """One native ingest run with the analytics app's rows of every record it applies (native/src/anarows.rs)."""
    require("the native analytics run")
    return kvpipe_native.analytics_run(store, records, start, partition, last_offset, stream_ts, nodes, clock,
                                       max_bytes, max_skew_s, ttl_s, cap, headers, tracker)


def serve_static(host: str, port: int, threads: int, token: str | None, max_body: int, read_timeout_s: float,
                 upstream_port: int | None, answer_json: bytes, forward_if_contains: bytes, *,
                 panic_if_contains: bytes | None = None, reuse_port: bool = False) -> RouteServer:
    """A native route server with a fixed answer, for tests and load checks of the server itself."""
    require("the native route server")
    return kvpipe_native.serve_static(host, port, threads, token, max_body, read_timeout_s, upstream_port,
                                      answer_json, forward_if_contains, panic_if_contains=panic_if_contains,
                                      reuse_port=reuse_port)
