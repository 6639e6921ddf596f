"""kvpipe's one retry policy, on tenacity: exponential back-off with jitter, bounded on both sides.

The wait before retry n (n = 1, 2, ...) is uniform in [d/2, d], d = min(max_s, first_s · 2^(n-1)) ("equal
jitter"). The random half keeps workers that one outage refused together (the store of several analytics
workers, a broker's clients after it restarts) from coming back in step, on every retry of the outage; the fixed
half keeps a retry from coming almost at once, which a full jitter in [0, d] allows at any n, so an outage never
turns into a busy loop. `max_s` bounds every wait: a fixed store is written to within `max_s` of its return.

The bounds belong to each caller, from its settings or constants (the analytics sink's `analytics_retry_max_s`);
what to retry, when to stop and what to count on each failure too. Those are tenacity's own arguments (`retry`,
`stop`, `before_sleep`, `sleep`), passed through as they are.
"""
from __future__ import annotations

from typing import Any

from tenacity import AsyncRetrying, Retrying, wait_exponential, wait_random_exponential
from tenacity.wait import wait_base


def backoff(first_s: float, max_s: float) -> wait_base:
    """The waits of the policy (module doc): a fixed exponential half plus a random one, each capped at max_s/2."""
    half_first, half_max = first_s / 2, max_s / 2
    return wait_exponential(multiplier=half_first, max=half_max) + \
        wait_random_exponential(multiplier=half_first, max=half_max)


def retrying(*, first_s: float, max_s: float, **tenacity_args: Any) -> Retrying:
    """A blocking `tenacity.Retrying` with the policy's waits: by default it retries on any Exception, for ever
    (tenacity's defaults); `tenacity_args` add what the caller needs."""
    return Retrying(wait=backoff(first_s, max_s), **tenacity_args)


def async_retrying(*, first_s: float, max_s: float, **tenacity_args: Any) -> AsyncRetrying:
    """`retrying` for coroutines: the waits are `asyncio.sleep`s, so the event loop runs on meanwhile."""
    return AsyncRetrying(wait=backoff(first_s, max_s), **tenacity_args)
