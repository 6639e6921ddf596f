"""The index an app runs, built from its settings: the one place both apps (routing and analytics) get
their `Index` from, so they hold nodes under the same bounds, TTLs and engine choice.

Each app names itself (for the engine line and `require_native`'s refusal) and its lifetimes mode: the routing
app keeps none (lifetimes are the analytics app's), the analytics app keeps them as columns.
"""
from __future__ import annotations

import logging

from kvpipe.processors.core import native
from kvpipe.processors.core.index import Index, LifetimesMode
from kvpipe.schemas.settings import Settings

log = logging.getLogger(__name__)


def index_from_settings(settings: Settings, command: str, lifetimes: bool | LifetimesMode) -> Index:
    """`command`'s index. Says in one warning line when the Python engine runs and why; refuses to start
    (`native.check_start`) when `require_native` is set and the native core is missing."""
    engine_line = native.check_start(command, settings.require_native)
    if engine_line is not None:
        log.warning(engine_line)
    return Index(ttl_s=settings.node_ttl_s, retention_s=settings.node_retention_s, max_nodes=settings.max_nodes,
                 max_blocks_per_slot=settings.max_blocks_per_slot, max_slots_per_node=settings.max_slots_per_node,
                 store=settings.index_store if native.engine() == "native" else "python", lifetimes=lifetimes)
