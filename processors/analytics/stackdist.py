"""LRU stack (reuse) distance of one access stream: O(1) per first access, O(sqrt n) in C per repeat.

The stack distance of an access to key k is the number of *distinct other* keys accessed since
k's previous access. An LRU cache of C entries holds k at that moment exactly when the distance is
below C (Mattson et al.'s inclusion property), so one pass gives the hit count of every cache size.

Method: each access gets the next integer time t; a bytearray holds a 1 at the latest access time
of every live key, and a count per bucket of 2^11 times. The distance of an access at t to a key last
seen at p is the number of ones in (p, t): the keys whose latest access falls between — two partial
buckets counted by `bytearray.count` and the full buckets between summed by `sum`, both loops in C.
Then p's mark moves to t. A first access only sets a byte and bumps a bucket: that is what most
stores are, and why this beats a Fenwick tree (log n Python steps on every access) here.

Bounds. Times live in `size` slots; when t reaches the end, the live marks are compacted to
0..n-1 in time order (O(n), amortised O(1) per access). At most `max_keys` keys are remembered:
past it, compaction forgets the least recently accessed ones, and a later access to a forgotten key
is a first access (`None`) — i.e. distances of `max_keys` or more are not reported.
"""
from __future__ import annotations

from typing import Hashable

_SHIFT = 11  # bucket = 2048 times: partial counts stay short, the bucket sum stays short up to millions


class StackDistance:
    __slots__ = ("max_keys", "_size", "_marks", "_buckets", "_last", "_t", "forgotten")

    def __init__(self, max_keys: int = 1 << 20, initial_size: int = 1 << 12) -> None:
        self.max_keys = max(1, max_keys)
        self._size = max(16, initial_size)
        self._marks = bytearray(self._size)
        self._buckets = [0] * ((self._size >> _SHIFT) + 1)
        self._last: dict[Hashable, int] = {}  # key → time (0-based) of its latest access
        self._t = 0
        self.forgotten = 0  # keys dropped by the max_keys bound

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._last

    def access(self, key: Hashable) -> int | None:
        """Record an access; its stack distance, or None on the key's first (remembered) access."""
        if self._t >= self._size:
            self._compact()
        t = self._t
        marks, buckets = self._marks, self._buckets
        p = self._last.get(key)
        distance = None
        if p is not None:
            lo, hi = p + 1, t  # ones in [lo, hi)
            bl, bh = lo >> _SHIFT, hi >> _SHIFT
            if bl == bh:
                distance = marks.count(1, lo, hi)
            else:
                distance = (marks.count(1, lo, (bl + 1) << _SHIFT) + sum(buckets[bl + 1:bh])
                            + marks.count(1, bh << _SHIFT, hi))
            marks[p] = 0
            buckets[p >> _SHIFT] -= 1
        marks[t] = 1
        buckets[t >> _SHIFT] += 1
        self._last[key] = t
        self._t = t + 1
        return distance

    def forget(self, key: Hashable) -> None:
        p = self._last.pop(key, None)
        if p is not None:
            self._marks[p] = 0
            self._buckets[p >> _SHIFT] -= 1

    def room(self) -> int:
        """Accesses before the next compaction: with `order()`, what a copy needs to forget what this one would,
        when it would (processors/analytics/nativetrack.py installs stacks so)."""
        return self._size - self._t

    def order(self) -> list[Hashable]:
        """The remembered keys, least recently accessed first: all the state distances depend on."""
        return [k for k, _ in sorted(self._last.items(), key=lambda kv: kv[1])]

    @classmethod
    def from_order(cls, keys: list[Hashable], max_keys: int = 1 << 20) -> "StackDistance":
        """A stack whose keys (distinct) were last accessed in this order, oldest first: what a stack fed the
        whole history would hold (past `max_keys`, the most recent ones), e.g. rebuilt after a restart."""
        stack = cls(max_keys)
        if len(keys) > stack.max_keys:
            stack.forgotten = len(keys) - stack.max_keys
            keys = keys[-stack.max_keys:]
        stack._install(keys)
        return stack

    def _compact(self) -> None:
        order = self.order()
        if len(order) > self.max_keys:
            drop = len(order) - self.max_keys
            self.forgotten += drop
            order = order[drop:]
        self._install(order)

    def _install(self, order: list[Hashable]) -> None:
        """Times 0..n-1 for these keys in this order (oldest first)."""
        n = len(order)
        # room for as many new accesses as there are live keys (at least doubling the live span)
        self._size = max(16, 2 * n)
        self._last = {k: i for i, k in enumerate(order)}
        self._marks = bytearray(b"\x01" * n) + bytearray(self._size - n)
        full, rest = divmod(n, 1 << _SHIFT)
        self._buckets = [1 << _SHIFT] * full + [rest] + [0] * ((self._size >> _SHIFT) + 1 - full)
        self._t = n
