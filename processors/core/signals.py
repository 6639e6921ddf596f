"""Faust/mode signal handlers, connected with their types kept.

`@app.on_rebalance_complete.connect` is how both apps hook rebalances and shutdown, but mode's
`SignalHandlerT` admits no callable under a type checker (its own documented handler signature
included), so each decorated handler would need an ignore comment. `connect(signal)` is the same
decorator with the signal taken as `Any`: the one place that bypasses mode's annotation, and the
handler keeps its own type.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def connect(signal: Any) -> Callable[[F], F]:
    """`@connect(app.on_partitions_revoked)` == `@app.on_partitions_revoked.connect`."""
    def register(handler: F) -> F:
        signal.connect(handler)
        return handler
    return register
