"""kvpipe's one retry policy (kvpipe.schemas.retrying): waits grow exponentially, are jittered, and stay
within [d/2, d] of the back-off d, never past the cap; callers keep their own attempts, stops and counters."""
from __future__ import annotations

import asyncio
import random

import pytest
from tenacity import RetryCallState, RetryError, stop_after_attempt

from kvpipe.schemas import retrying


def _waits(first_s: float, max_s: float, attempts: int) -> list[float]:
    wait = retrying.backoff(first_s, max_s)
    state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})
    out = []
    for n in range(1, attempts + 1):
        state.attempt_number = n
        out.append(wait(state))
    return out


def test_each_wait_lies_between_half_the_backoff_and_the_backoff_never_past_the_cap():
    random.seed(7)
    for _ in range(200):
        for n, w in enumerate(_waits(0.1, 2.0, 12), start=1):
            d = min(2.0, 0.1 * 2 ** (n - 1))
            assert d / 2 - 1e-9 <= w <= d + 1e-9, (n, w, d)


def test_waits_are_jittered_so_workers_refused_together_do_not_return_in_step():
    random.seed(11)
    runs = [_waits(0.5, 30.0, 8) for _ in range(50)]
    for n in range(8):
        at_n = {round(run[n], 9) for run in runs}
        assert len(at_n) > 40, f"retry {n + 1}: the same wait for every worker"
    # and they still grow: the fixed half doubles until the cap
    assert min(run[4] for run in runs) >= max(run[0] for run in runs)


def test_a_retrying_call_gives_up_where_its_caller_says_and_counts_each_failure():
    tries, refused, slept = [], [], []

    def insert() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise ConnectionError("store down")
        return "written"

    r = retrying.retrying(first_s=0.1, max_s=1.0, sleep=slept.append,
                          before_sleep=lambda state: refused.append(state.outcome.exception()))
    assert r(insert) == "written"
    assert len(tries) == 3 and [str(e) for e in refused] == ["store down"] * 2
    assert 0.05 <= slept[0] <= 0.1 and 0.1 <= slept[1] <= 0.2

    tries.clear()
    with pytest.raises(RetryError):
        retrying.retrying(first_s=0.1, max_s=1.0, sleep=slept.append, stop=stop_after_attempt(2))(insert)
    assert len(tries) == 2


def test_the_async_form_waits_on_the_event_loop():
    tries = []

    async def rebuild() -> None:
        tries.append(1)
        if len(tries) < 2:
            raise RuntimeError("store refuses")

    async def main() -> None:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        await retrying.async_retrying(first_s=0.05, max_s=0.05)(rebuild)
        task.cancel()
        assert ticks > 3  # the loop ran other work during the wait

    asyncio.run(main())
    assert len(tries) == 2
