"""`kvpipe demo` end to end on the real broker: it exits 0, says what it promised, and leaves none of
its own processes or topics behind (the broker it found running keeps running)."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvpipe.infra.topics import list_topics

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _tagged_processes(tag: str) -> list[str]:
    """Processes whose environment carries `tag`: the demo and everything it started (children
    inherit the environment, also after they are orphaned), and nothing another run on this
    machine started."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if tag.encode() in (proc / "environ").read_bytes():
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def test_demo_runs_the_pipeline_and_cleans_up(kafka_bootstrap: str):
    tag = f"KVPIPE_TEST_RUN={uuid.uuid4().hex}"
    env = {**os.environ, tag.split("=")[0]: tag.split("=")[1]}
    # --bootstrap-server reaches the apps and nodes the demo starts (they inherit it)
    run = subprocess.run([sys.executable, "-m", "kvpipe", "demo", "--steps", "80", "--rate", "0",
                          "--bootstrap-server", kafka_bootstrap], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "=== kvpipe demo summary ===" in out
    assert "dead-letter queue: 2 messages" in out and "not_msgpack" in out  # the two injected ones
    assert "new epochs 1" in out  # node-b restarted half way
    assert "hma hit" in out and "-> chosen node-" in out and "score" in out  # token ids in, a chosen node out
    assert "Sliding-window vs full-attention evictions" in out
    assert "analytics app (kvpipe analytics, own consumer group)" in out and "0 rows pending" in out
    assert "via the analytics app's /sql" in out
    # stderr is a pipe here: progress as plain lines, no bar redrawn with control codes
    assert "apps catching up: 100.0%" in run.stderr and "\r" not in run.stderr and "\x1b" not in run.stderr
    # none of the demo's own processes left behind (processor, analytics app, nodes)
    assert _tagged_processes(tag) == []
    assert not [t for t in list_topics(kafka_bootstrap) if t.startswith("kvpipe-demo-")]
