"""Snapshot export and import of one partition of an index, timed per path (`kvpipe bench route
--snapshots` runs it on the bench fleet): on the native store, slot records written and read by the
extension (native/src/snapshot.rs) and the Python walk of `kvpipe.processors.core.snapshot` (the
reference) side by side; on the dict store, the Python walk alone. Every path restores into a
fresh index of the same store, which must end with the source's entries, and the two writers must
produce the same bytes.
"""
from __future__ import annotations

import gc
import time
from typing import Any

from kvpipe.processors.core import native as native_core
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.snapshot import decode_chunk, export_partition, import_chunks


def times(index: Index, partition: int = 0) -> dict[str, Any]:
    """Per path: export (index → chunk bytes), decode (bytes → chunk records) and load (records →
    a fresh index) in seconds, with the chunks' count and size."""
    kind = index.store.kind
    paths = ["native", "python"] if kind == "native" and native_core.engine() == "native" else ["python"]
    out: dict[str, Any] = {"entries": index.store.entries()}
    written: dict[str, list[bytes]] = {}
    for path in paths:
        native = path == "native"
        gc.collect()
        t0 = time.perf_counter()
        chunks, _, blocks = export_partition(index, partition, 1, native=native)
        t1 = time.perf_counter()
        read = [decode_chunk(c, native=native) for c in chunks]
        t2 = time.perf_counter()
        restored = Index(store=kind)
        loaded = import_chunks(restored, partition, read)
        t3 = time.perf_counter()
        if loaded != blocks or restored.store.entries() != index.store.entries():
            raise RuntimeError(f"the {path} snapshot path restored {restored.store.entries()} entries of "
                               f"{index.store.entries()}")
        out[path] = {"export_s": round(t1 - t0, 4), "decode_s": round(t2 - t1, 4), "load_s": round(t3 - t2, 4),
                     "import_s": round(t3 - t1, 4), "chunks": len(chunks), "bytes": sum(map(len, chunks))}
        written[path] = chunks
        del read, restored
    if len(paths) == 2:
        out["same_bytes"] = written["native"] == written["python"]
        for step in ("export_s", "import_s"):
            out[f"{step[:-2]}_python_over_native"] = round(out["python"][step] / max(out["native"][step], 1e-6), 1)
    return out
