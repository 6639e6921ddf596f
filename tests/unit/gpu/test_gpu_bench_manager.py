"""The manager benchmark runs end to end on a tiny workload and reports the bench contract."""
from __future__ import annotations

from kvpipe.bench.manager import run


def test_tiny_run_reports_steps_per_second_against_the_events_off_baseline() -> None:
    out = run(["--steps", "30", "--requests", "6", "--prompt-len", "64", "--repeats", "1"])
    assert out["bench"] == "manager" and out["unit"] == "steps/s"
    assert out["value"] > 0 and out["baseline"] > 0
    assert abs(out["ratio"] - out["value"] / out["baseline"]) < 0.01
    assert out["events_per_step"] > 0  # the workload caches blocks, so events flow
