"""Faust's own command line (`faust -A kvpipe.processors.routing.app worker`) imports only the app module; its
autodiscovery must register the same agents `kvpipe processor` / `kvpipe analytics` run.

`faust -A … agents` goes through the same app preparation as `worker` (finalize, discover) and
lists the registered agents without connecting to a broker."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAUST = Path(sys.executable).parent / "faust"


def _faust_agents(app_module: str, tmp_path: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVPIPE_STATE_DIR": str(tmp_path)}
    # Run outside the repository root, as a deployment would: only PYTHONPATH finds the code.
    out = subprocess.run([str(FAUST), "-A", app_module, "agents"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize("app_module, agent", [
    ("kvpipe.processors.routing.app", "@kvpipe-ingest"),
    ("kvpipe.processors.analytics.app", "@kvpipe-analytics-rows"),
])
def test_faust_command_line_discovers_the_agents(app_module, agent, tmp_path):
    assert agent in _faust_agents(app_module, tmp_path)


def test_discovery_registers_views_and_agents_in_process():
    code = ("from kvpipe.processors.routing.app import app; app.discover(); "
            "print(len(app.agents)); import sys; print('kvpipe.processors.routing.views' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines == ["1", "True"]  # the ingest agent, and the module that registers the pages
