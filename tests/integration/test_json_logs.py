"""`--log-format json` end to end: a real command started with the flag writes only JSON lines on stderr, its own
and librdkafka's, with the API token nowhere (the formatter itself: tests/unit/test_log_format.py). A process
that runs for seconds, so it sits with the integration tests, out of `make check`'s loop."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKEN = "tok-never-logged-7731"


def test_a_command_started_with_json_logs_writes_only_json_lines_on_stderr(tmp_path):
    """The bridge, pointed at a broker that does not exist: its own lines and librdkafka's, all JSON, no token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_")}
    env.update(PYTHONPATH=str(REPO), KVPIPE_API_TOKEN=TOKEN, KVPIPE_KAFKA_BOOTSTRAP="127.0.0.1:1",
               KVPIPE_STATE_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "kvpipe", "bridge", "--zmq", "tcp://127.0.0.1:1", "--node-id", "n1",
                             "--groups", "full_attention:16", "--log-format", "json", "--log-level", "debug"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3.0)  # starts, fails to reach the broker a few times
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    lines = err.splitlines()
    assert len(lines) >= 3, err
    records = [json.loads(line) for line in lines]  # every line one JSON object
    loggers = {r["logger"] for r in records}
    assert {"kvpipe.bridge", "kvpipe.librdkafka"} <= loggers, loggers
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    assert TOKEN not in out + err
