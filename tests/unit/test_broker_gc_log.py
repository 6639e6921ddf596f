"""The broker's GC log as `infra/kafka/gclog.py` reads it: lines in the JVM's own format (copied from a
broker's log), pauses in a window, pauses overlapping an event's way."""
from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

import pytest

from kvpipe.infra.kafka.gclog import Pause, overlap_ms, parse_pauses, read_pauses, window_summary
from kvpipe.infra.kafka.local import gc_log_flags

LOG = """\
[2026-11-29T21:26:04.749+0000][0.005s][gc] Using G1
[2026-11-29T21:26:05.128+0000][0.384s][gc,start    ] GC(0) Pause Young (Normal) (G1 Evacuation Pause)
[2026-11-29T21:26:05.134+0000][0.390s][gc          ] GC(0) Pause Young (Normal) (G1 Evacuation Pause) 18M->5M(380M) 6.667ms
[2026-11-29T21:26:05.134+0000][0.390s][gc,cpu      ] GC(0) User=0.01s Sys=0.00s Real=0.01s
[2026-11-29T21:29:50.612+0000][225.9s][gc          ] GC(61) Concurrent Mark Cycle 41.215ms
[2026-11-29T21:29:50.598+0000][225.8s][gc          ] GC(61) Pause Remark 85M->85M(205M) 25.643ms
[2026-11-29T21:29:50.599+0000][225.8s][gc          ] GC(61) Pause Cleanup 85M->85M(205M) 0.073ms
[2026-11-29T21:29:57.770+0000][232.9s][gc          ] GC(70) Pause Young (Concurrent Start) (Metadata GC Threshold) 34M->10M(768M) 133.606ms
not a GC line at all
"""


def _unix(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


def test_only_stop_the_world_pauses_are_read_with_their_kind_and_end() -> None:
    pauses = parse_pauses(LOG.splitlines())
    assert [(p.kind, p.ms) for p in pauses] == [("Pause Young (Normal)", 6.667), ("Pause Remark", 25.643),
                                               ("Pause Cleanup", 0.073),
                                               ("Pause Young (Concurrent Start)", 133.606)]
    assert pauses[0].end_unix_s == pytest.approx(_unix("2026-11-29T21:26:05.134+0000"))
    assert pauses[-1].start_unix_s == pytest.approx(pauses[-1].end_unix_s - 0.133606)


def test_the_flags_write_the_format_that_is_read(tmp_path: Path) -> None:
    flag, = gc_log_flags(tmp_path / "gc.log")
    assert flag.startswith("-Xlog:gc*:file=") and ":time," in flag  # the wall-clock decoration comes first


def test_rotated_files_are_read_too_and_old_pauses_left_out(tmp_path: Path) -> None:
    lines = LOG.splitlines()
    (tmp_path / "gc.log.0").write_text("\n".join(lines[:4]) + "\n")
    (tmp_path / "gc.log").write_text("\n".join(lines[4:]) + "\n")
    assert len(read_pauses(tmp_path / "gc.log")) == 4
    since = _unix("2026-11-29T21:29:00.000+0000")
    assert [p.kind for p in read_pauses(tmp_path / "gc.log", since)] == ["Pause Remark", "Pause Cleanup",
                                                                       "Pause Young (Concurrent Start)"]
    assert read_pauses(tmp_path / "absent.log") == []
    # a rotated file last written before the window is not read at all (its lines would count: 6, not 3)
    (tmp_path / "gc.log.1").write_text("\n".join(lines[4:]) + "\n")
    os.utime(tmp_path / "gc.log.1", (since - 600, since - 600))
    assert len(read_pauses(tmp_path / "gc.log", since - 60)) == 3


def test_a_window_counts_what_ended_in_it_and_an_event_what_overlapped_its_way() -> None:
    pauses = [Pause(100.0, 20.0, "Pause Young (Normal)"), Pause(100.5, 100.0, "Pause Remark"),
              Pause(200.0, 5.0, "Pause Young (Normal)")]
    assert window_summary(pauses, 99.0, 101.0) == {"pauses": 2, "max_ms": 100.0, "total_ms": 120.0}
    assert window_summary(pauses, 0.0, 1.0) == {"pauses": 0, "max_ms": 0.0, "total_ms": 0.0}
    # an event on its way from 99.99 to 100.45: 10 ms of the first pause, 50 ms of the second (100.4-100.5)
    assert overlap_ms(pauses, 99.99, 100.45) == pytest.approx(10.0 + 50.0)
    assert overlap_ms(pauses, 150.0, 160.0) == 0.0
