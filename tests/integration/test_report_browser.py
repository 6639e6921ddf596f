"""The capacity report as an analyst sees it: rendered by a real headless browser (Debian's chromium).

The browser is installed by the session fixture when missing (apt-get, as root), so the test passes from a
clean clone; where it cannot be installed the test fails and says how to install it. Every request the page
could make is routed to a recording proxy on loopback (`--proxy-bypass-list=<-loopback>` sends loopback
through it too): the test asserts none arrives. A screenshot is kept under test-artifacts/.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from kvpipe.processors.analytics.report import MARKERS_UP_TO, PLOTS, bucket_for, build_report
from kvpipe.processors.analytics.sink import AnalyticsSink
from kvpipe.bench.workload import fill_store, serving_steps
from kvpipe.bench.procrun import REPO

pytestmark = pytest.mark.integration
ARTIFACTS = Path(os.environ.get("KVPIPE_TEST_ARTIFACTS", REPO / "test-artifacts"))
# The browser's own service traffic (network time, component updates, account check), not the page's: these hosts
# serve no page content. Anything else reaching the proxy is a request the page made (the control test below
# shows a page's request does arrive).
BROWSER_SERVICES = {"clients2.google.com", "update.googleapis.com", "accounts.google.com"}
QUIET = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions",
         "--disable-default-apps", "--metrics-recording-only", "--no-default-browser-check", "--mute-audio"]


@pytest.fixture(scope="session")
def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    how = "apt-get update && apt-get install -y chromium"
    if os.geteuid() != 0:
        pytest.fail(f"the report test needs Debian's chromium and cannot install it without root: run `{how}` as root")
    done = subprocess.run(["sh", "-c", how], env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
                          capture_output=True, text=True, timeout=900)
    found = shutil.which("chromium")
    if done.returncode != 0 or not found:
        pytest.fail(f"installing chromium failed (`{how}` exited {done.returncode}): {done.stderr[-2000:]}")
    return found


class RecordingProxy:
    """Accepts every connection a browser opens through it, records its first line, answers 502."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[str] = []
        self.unused = 0  # connections closed before any byte was sent
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    data = conn.recv(4096)
                    if not data:
                        # closed without sending a byte: a connection the browser opened ahead of need (it
                        # pre-connects to its proxy) and dropped unused; no request was made on it
                        self.unused += 1
                        continue
                    self.requests.append(data.split(b"\r\n", 1)[0].decode(errors="replace"))
                    conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
                except OSError:
                    self.requests.append("(connection without a request line)")

    def close(self) -> None:
        self.sock.close()

    def page_requests(self) -> list[str]:
        return [r for r in self.requests if _host(r) not in BROWSER_SERVICES]


def _host(request_line: str) -> str:
    parts = request_line.split()
    target = parts[1] if len(parts) > 1 else ""
    return re.sub(r"^\w+://", "", target).split("/")[0].split(":")[0]


def _report_of(tmp: Path, steps: int, step_s: float) -> Path:
    """The report of a store filled with `steps` node steps `step_s` apart (kvpipe.bench.workload)."""
    sink = AnalyticsSink(f"chdb://{tmp / 'store'}")
    sink.start()
    try:
        fill_store(sink, serving_steps(steps, step_s=step_s))
        return build_report(sink, tmp / "report.html")
    finally:
        sink.close()


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    return _report_of(tmp_path_factory.mktemp("report"), 2000, 0.5)


def run_browser(chromium: str, proxy: RecordingProxy, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([chromium, *QUIET, f"--proxy-server=http://127.0.0.1:{proxy.port}",
                           "--proxy-bypass-list=<-loopback>", *args], capture_output=True, text=True, timeout=180)


def test_the_report_renders_every_plot_with_data_and_requests_nothing(chromium, report):
    proxy = RecordingProxy()
    try:
        dom = run_browser(chromium, proxy, "--virtual-time-budget=3000", "--dump-dom", report.as_uri())
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "capacity_report.png"
        shot.unlink(missing_ok=True)
        run_browser(chromium, proxy, "--window-size=1100,3000", f"--screenshot={shot}", report.as_uri())
    finally:
        proxy.close()
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert proxy.page_requests() == [], f"the report page made requests: {proxy.page_requests()}"
    figures = dict(re.findall(r"<figure class=\"plot\" data-query=\"(\w+)\"[^>]*>(.*?)</figure>", dom.stdout, re.DOTALL))
    assert set(figures) == set(PLOTS), sorted(figures)
    for name, svg in figures.items():
        assert svg.lstrip().startswith("<svg"), name
        # data are drawn as paths (lines) or filled rectangles (bars) inside the axes, clipped to them
        marks = re.findall(r'<path d="([^"]+)"[^>]*clip-path', svg)
        points = sum(len(re.findall(r"[ML] ", d)) for d in marks)
        assert points >= 4, f"plot {name} has no data drawn ({points} points)"
    assert not re.search(r"""(src|href)=["'](?!#|data:)""", dom.stdout), "the page references something outside itself"
    assert shot.is_file() and shot.stat().st_size > 10_000, "no screenshot written"


def test_control_a_page_that_loads_something_is_caught_by_the_proxy(chromium, tmp_path):
    page = tmp_path / "leaky.html"
    page.write_text("<html><body><img src='http://example.invalid/pixel.png'></body></html>")
    proxy = RecordingProxy()
    try:
        run_browser(chromium, proxy, "--virtual-time-budget=3000", "--dump-dom", page.as_uri())
    finally:
        proxy.close()
    assert any("example.invalid" in r for r in proxy.page_requests()), proxy.requests


@pytest.fixture(scope="module")
def short_report(tmp_path_factory) -> Path:
    """The report after a run as short as `make demo`'s: half a minute of node steps (32 s of events)."""
    return _report_of(tmp_path_factory.mktemp("short-report"), 800, 0.04)


def test_a_short_run_is_plotted_over_its_own_span_with_markers(chromium, short_report):
    """Time plots use a bucket the data's span calls for and an axis fitted to the data (one bucket of
    margin), not a one-minute bucket on a years-wide axis; few points are drawn with markers."""
    proxy = RecordingProxy()
    try:
        dom = run_browser(chromium, proxy, "--virtual-time-budget=3000", "--dump-dom", short_report.as_uri())
    finally:
        proxy.close()
    assert dom.returncode == 0, dom.stderr[-2000:]
    timed = re.findall(r"<figure class=\"plot\" data-query=\"(\w+)\" data-bucket-s=\"(\d+)\" "
                       r"data-span=\"([\d.]+) ([\d.]+)\">(.*?)</figure>", dom.stdout, re.DOTALL)
    assert {name for name, *_ in timed} == {"evictions_per_group", "node_occupancy"}, [n for n, *_ in timed]
    for name, bucket, first, last, svg in timed:
        first_s, last_s, bucket_s = float(first), float(last), int(bucket)
        assert 25 <= last_s - first_s <= 40 and bucket_s == bucket_for(last_s - first_s) == 1, (name, bucket)
        axes = [(int(a), int(b)) for a, b in re.findall(r'id="time-axis_(\d+)_(\d+)"', svg)]
        assert axes, f"{name}: no time axis drawn"
        for start, end in axes:  # the axis covers the data and at most ~2 buckets more on each side
            assert first_s - 3 * bucket_s <= start <= last_s and first_s <= end <= last_s + 3 * bucket_s, \
                (name, start, end, first_s, last_s)
        points = (last_s - first_s) / bucket_s
        assert points <= MARKERS_UP_TO and "<use " in svg, f"{name}: {points:.0f} points drawn without markers"
