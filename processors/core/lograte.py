"""At most one log line per interval for a repeating condition, with how many were held back.

Hostile input can make the same thing happen 100k times a second; a log line (or a traceback)
each time turns an attack on the index into one on the disk (RELIABILITY.md, probe 3).
"""
from __future__ import annotations

import logging
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def emit(self, key: str, level: int, msg: str, *args, exc_info: bool | BaseException = False,
             now: float | None = None) -> bool:
        """Log under `key` unless it was logged less than `interval_s` ago; True if logged."""
        now = time.monotonic() if now is None else now
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        held = self._held.pop(key, 0)
        self._last[key] = now
        suffix = f" (and {held} more like it in the last {self.interval_s:g} s)" if held else ""
        self.logger.log(level, msg + suffix, *args, exc_info=exc_info)
        return True
