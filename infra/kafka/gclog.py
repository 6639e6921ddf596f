"""The local broker's GC pauses, read from the log its JVM writes (`local.gc_log_flags`).

A broker on the same host as the apps stops for each collection: a produce is not acknowledged and a
fetch not answered until the pause ends. Benchmarks that time events end to end read the pauses that
fell in their window from here, to tell the broker's stops from the app's.
"""
from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

# `[2026-11-29T21:26:04.749+0000][12.345s][gc] GC(7) Pause Young (Normal) (G1 Evacuation Pause) 162M->80M(205M) 21.454ms`
# (decorations `time,uptime,tags`); the line is written when the pause ends
_PAUSE = re.compile(r"^\[([^\]]+)\](?:\[[^\]]*\])*\[gc\s*\]\s*GC\(\d+\) (Pause [A-Za-z]+(?: \([^)]*\))?).*? "
                    r"(\d+(?:\.\d+)?)ms\s*$")


class Pause(NamedTuple):
    end_unix_s: float
    ms: float
    kind: str  # "Pause Young (Normal)", "Pause Remark", ...

    @property
    def start_unix_s(self) -> float:
        return self.end_unix_s - self.ms / 1000


def parse_pauses(lines) -> list[Pause]:
    """Every stop-the-world pause in `lines` (other lines, and lines of other decorations, are skipped)."""
    out = []
    for line in lines:
        m = _PAUSE.match(line.strip())
        if not m:
            continue
        try:
            end = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()
        except ValueError:
            continue
        out.append(Pause(end, float(m.group(3)), m.group(2)))
    return out


def read_pauses(path: Path, since_unix_s: float = 0.0) -> list[Pause]:
    """The pauses of the log at `path` (and its rotated files `path.0`, `path.1`, ...) that ended after
    `since_unix_s`, oldest first; none where no log is there (a broker not started here)."""
    files = [p for p in [*sorted(path.parent.glob(path.name + ".*")), path] if p.is_file()]
    pauses: list[Pause] = []
    for f in files:
        if f.stat().st_mtime < since_unix_s:
            continue  # last written before the window: a rotated file of up to 20 MB not parsed for nothing
        with open(f, encoding="utf-8", errors="replace") as fh:
            pauses.extend(p for p in parse_pauses(fh) if p.end_unix_s > since_unix_s)
    return sorted(pauses)


def overlap_ms(pauses: list[Pause], start_unix_s: float, end_unix_s: float) -> float:
    """Milliseconds of `pauses` inside [start, end]."""
    return sum(max(0.0, min(end_unix_s, p.end_unix_s) - max(start_unix_s, p.start_unix_s)) for p in pauses) * 1000


def window_summary(pauses: list[Pause], start_unix_s: float, end_unix_s: float) -> dict[str, float | int]:
    """Count, longest and total ms of the pauses that ended inside [start, end]."""
    inside = [p.ms for p in pauses if start_unix_s <= p.end_unix_s <= end_unix_s]
    return {"pauses": len(inside), "max_ms": round(max(inside, default=0.0), 1), "total_ms": round(sum(inside), 1)}
