"""Capacity-planning report: one self-contained HTML page of plots and the tables behind them.

`build_report(target, out)` runs the saved queries (through `saved.run_query`, read-only), draws each plot
with matplotlib (Agg backend, SVG output embedded inline: the page references nothing outside itself,
so it opens offline and a browser issues no request), and writes `out` (a file path; a directory gets
`report.html` inside). `target` may be a live analytics app's sink, a clickhouse-connect client, or a
`saved.QueryFn` (`kvpipe report` reads embedded chDB through the running analytics app's /sql).
"""
from __future__ import annotations

import io
import math
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable

from kvpipe.processors.analytics.report_page import render_page
from kvpipe.processors.analytics.restores import CAPACITY_METHOD
from kvpipe.processors.analytics.saved import list_queries, run_query, run_sql
from kvpipe.processors.analytics.tables import BY_NAME, store_summary_sql

MAX_TABLE_ROWS = 40


def _records(result: dict) -> list[dict]:
    return [dict(zip(result["columns"], row)) for row in result["rows"]]


def _figure(rows: int = 1):
    """pyplot, a figure and its axes (a list of `rows` axes sharing x when rows > 1)."""
    import matplotlib

    matplotlib.use("Agg")  # no display; set before pyplot loads
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(rows, 1, figsize=(9, 3.6 * rows), dpi=100, sharex=True, squeeze=False)
    axes = [a[0] for a in ax]
    for a in axes:
        a.grid(True, alpha=0.3)
    return plt, fig, axes[0] if rows == 1 else axes


def _svg(plt, fig) -> str:
    buf = io.StringIO()
    fig.tight_layout()
    # no RDF metadata block (namespace addresses, creator, date): the page stays the same for the same data
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and DOCTYPE (a DTD address)


# A line with this many points or fewer gets a marker on each, so one or two points still show.
MARKERS_UP_TO = 40
# Bucket sizes a time axis may use (seconds), and how many buckets the span should fill at most.
NICE_BUCKETS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
MAX_BUCKETS = 120


def bucket_for(span_s: float) -> int:
    """The smallest nice bucket that cuts `span_s` into at most MAX_BUCKETS: a 30 s demo gets 1 s
    buckets (30 points), a day 15 min, a week 2 h."""
    for b in NICE_BUCKETS_S:
        if span_s <= b * MAX_BUCKETS:
            return b
    return 86400 * (int(span_s // (86400 * MAX_BUCKETS)) + 1)


def _bucket_words(bucket_s: int) -> str:
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if bucket_s % size == 0:
            n = bucket_s // size
            return unit if n == 1 else f"{n} {unit}s"
    return "second" if bucket_s == 1 else f"{bucket_s} seconds"


def data_span(target: Any) -> tuple[float, float] | None:
    """(first, last) event time in epoch seconds, or None for an empty store."""
    rows = run_sql(target, "SELECT count(), toUnixTimestamp64Milli(min(ts)), toUnixTimestamp64Milli(max(ts)) "
                           "FROM kv_events_final")["rows"]
    if not rows or not rows[0][0]:
        return None
    return rows[0][1] / 1000.0, rows[0][2] / 1000.0


def _time_axis(ax: Any, xs: list, bucket_s: int) -> None:
    """Dates readable at any span, and the axis fitted to the data (one bucket of margin), never the
    default years-wide window matplotlib picks around a single point."""
    import matplotlib.dates as mdates

    locator = mdates.AutoDateLocator(minticks=3, maxticks=8)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    if xs:
        lo, hi = min(xs), max(xs)
        pad = timedelta(seconds=bucket_s)
        ax.set_xlim(lo - pad, hi + pad)
        # the range drawn, as the SVG group's id: what a reader (the browser test) checks against the data
        start, end = (mdates.num2date(v).timestamp() for v in ax.get_xlim())
        ax.set_gid(f"time-axis_{start:.0f}_{end:.0f}")


def _lines(series: dict[str, list[tuple[Any, float]]], ylabel: str, xlabel: str = "time (UTC)", step: bool = False,
           logx: bool = False, bucket_s: int | None = None) -> str:
    plt, fig, ax = _figure()
    shown = sorted(series.items())[:12]
    few = all(len(points) <= MARKERS_UP_TO for _, points in shown)
    xs_all: list = []
    for label, points in shown:
        xs, ys = zip(*sorted(points))
        xs_all += xs
        style = {"marker": "o", "markersize": 3} if few else {}
        (ax.step if step else ax.plot)(xs, ys, label=label, **({"where": "post"} if step else {}), **style)
    if logx:
        ax.set_xscale("symlog")
    if bucket_s is not None:
        _time_axis(ax, xs_all, bucket_s)
    ax.set_ylabel(ylabel)
    ax.set_xlabel(xlabel)
    if series:
        ax.legend(fontsize=7, loc="best")
    return _svg(plt, fig)


def _bars(labels: list[str], groups: dict[str, list[float]], ylabel: str) -> str:
    plt, fig, ax = _figure()
    width = 0.8 / max(1, len(groups))
    for i, (name, values) in enumerate(groups.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + width * (len(groups) - 1) / 2 for x in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    return _svg(plt, fig)


def _evictions(rows: list[dict], bucket_s: int) -> str:
    sums: dict[str, dict] = {}  # groups of one kind summed per bucket
    for r in rows:
        per = sums.setdefault(f"{r['group_kind'] or 'g' + str(r['group_idx'])} {r['medium']}", {})
        per[r["bucket"]] = per.get(r["bucket"], 0.0) + float(r["evicted_blocks"])
    return _lines({k: list(v.items()) for k, v in sums.items()}, f"blocks evicted per {_bucket_words(bucket_s)}",
                  bucket_s=bucket_s)


def _occupancy(rows: list[dict], bucket_s: int) -> str:
    """Blocks held per series; under it, when nodes report load, each node's KV usage and running requests."""
    series: dict[str, list] = {}
    usage: dict[str, dict] = {}
    running: dict[str, dict] = {}
    for r in rows:
        series.setdefault(f"{r['node_id']} g{r['group_idx']} {r['medium']}", []).append(
            (r["bucket"], float(r["cached_blocks"])))
        if r.get("kv_usage") is not None:  # one value per node and bucket, repeated on its group rows
            usage.setdefault(r["node_id"], {})[r["bucket"]] = 100 * float(r["kv_usage"])
        if r.get("running") is not None:
            running.setdefault(r["node_id"], {})[r["bucket"]] = float(r["running"])
    if not usage and not running:
        return _lines(series, "blocks held", step=True, bucket_s=bucket_s)
    plt, fig, (top, low) = _figure(rows=2)
    shown = sorted(series.items())[:12]
    style = {"marker": "o", "markersize": 3} if all(len(p) <= MARKERS_UP_TO for _, p in shown) else {}
    xs_all: list = []
    for label, points in shown:
        xs, ys = zip(*sorted(points))
        xs_all += xs
        top.step(xs, ys, where="post", label=label, **style)
    _time_axis(low, xs_all, bucket_s)  # the axes share x
    top.set_ylabel("blocks held")
    top.legend(fontsize=7, loc="best")
    for node, by_bucket in sorted(usage.items())[:12]:
        xs, ys = zip(*sorted(by_bucket.items()))
        low.step(xs, ys, where="post", label=f"{node} KV usage %", **style)
    for node, by_bucket in sorted(running.items())[:12]:
        xs, ys = zip(*sorted(by_bucket.items()))
        low.step(xs, ys, where="post", linestyle=":", label=f"{node} running", **style)
    low.set_ylabel("reported load")
    low.set_xlabel("time (UTC)")
    low.legend(fontsize=7, loc="best", ncol=2)
    return _svg(plt, fig)


def _lifetimes(rows: list[dict], bucket_s: int) -> str:
    labels = [f"{r['group_kind'] or r['group_idx']} {r['medium']}" for r in rows]
    return _bars(labels, {q: [float(r[f"{q}_s"]) for r in rows] for q in ("p50", "p90", "p99")}, "lifetime (s)")


def _restore_delays(rows: list[dict], bucket_s: int) -> str:
    labels = [f"{r['group_kind'] or r['group_idx']} {r['medium']}" for r in rows]
    return _bars(labels, {"p50": [float(r["p50_s"] or 0) for r in rows], "p90": [float(r["p90_s"] or 0) for r in rows]},
                 "seconds from end of lifetime to re-store")


def _curve(rows: list[dict], bucket_s: int) -> str:
    series: dict[str, list] = {}
    for r in rows:  # fleet view: one line per group kind and medium, hits summed over nodes
        series.setdefault(f"{r['group_kind']} {r['medium']}", []).append((float(r["extra_fraction"]), r))
    out: dict[str, list] = {}
    for key, points in series.items():
        by_f: dict[float, list[int]] = {}
        for f, r in points:
            acc = by_f.setdefault(f, [0, 0])
            acc[0] += r["hits"]
            acc[1] += r["restores"]
        out[key] = [(100 * f, h / n if n else 0.0) for f, (h, n) in by_f.items()]
    return _lines(out, "re-stores turned into hits", xlabel="cache size change (% of observed capacity)")


# saved query → (plot function, the one sentence that says what the plot means)
# query name -> (draw(rows, bucket_s), what the plot means). Time series are drawn at the bucket the
# data's span calls for (`bucket_for`), passed to the saved query as its bucket_s.
PLOTS: dict[str, tuple[Callable[[list[dict], int], str], str]] = {
    "evictions_per_group": (_evictions, "Blocks evicted per time bucket by group kind and medium: sliding-window groups "
                                        "churn faster than full attention by design; a rising line means pressure."),
    "lifetime_quantiles": (_lifetimes, "How long an evicted block stayed cached, per group kind: short lifetimes in "
                                       "a group mean its pool is too small for its working set."),
    "node_occupancy": (_occupancy, "Blocks held per node, group and medium over time, and under them the load "
                                   "each node reported (KV usage, running requests): a flat line at the top is a "
                                   "full pool evicting to make room; load shows whether that came with traffic."),
    "reuse_distance": (_restore_delays, "How soon evicted blocks were stored again: a short delay is recompute "
                                        "a slightly bigger cache would have avoided."),
    "capacity_curve": (_curve, "Fraction of re-stores an LRU cache of the given size would have served as hits "
                               "(0 % = today's observed pool); the method and its assumptions are stated below."),
}


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.4g}"
    if isinstance(v, datetime):
        return v.strftime("%Y-%m-%d %H:%M")
    return str(v)


def _table(result: dict) -> dict[str, Any]:
    """A result as the page's table: cells as text, at most MAX_TABLE_ROWS rows and how many more."""
    rows = result["rows"]
    return {"columns": result["columns"], "rows": [[_cell(v) for v in row] for row in rows[:MAX_TABLE_ROWS]],
            "more": len(rows) - MAX_TABLE_ROWS}


def _store_summary(target: Any) -> dict[str, Any]:
    """What the store holds: one row per analytics table (`tables.TABLES`), counted exactly once."""
    result = run_sql(target, store_summary_sql())
    rows = [[name, BY_NAME[name].holds if name in BY_NAME else "", count] for name, count in result["rows"]]
    return _table({"columns": ["table", "holds", "rows"], "rows": rows})


def build_report(target: Any, out: str | Path) -> Path:
    """Write the HTML report; returns its path."""
    path = Path(out)
    if path.is_dir() or not path.suffix:
        path = path / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    queries = list_queries()
    order = [q for q in queries if q.name in PLOTS] + [q for q in queries if q.name not in PLOTS]
    span = data_span(target)
    bucket_s = bucket_for(span[1] - span[0]) if span else 60
    sections = []
    for query in order:
        bucketed = any(p.name == "bucket_s" for p in query.params)
        result = run_query(target, query.name, {"bucket_s": str(bucket_s)} if bucketed else None)
        draw, means = PLOTS.get(query.name, (None, ""))
        sections.append({
            "name": query.name, "title": query.title, "means": means,
            "plot": draw(_records(result), bucket_s) if draw else None,
            "bucket_s": bucket_s if bucketed and span else None,
            "span": f"{span[0]:.3f} {span[1]:.3f}" if span else "",
            "method": CAPACITY_METHOD if query.name == "capacity_curve" else "",
            "table": _table(result)})
    page = render_page(now, _store_summary(target), sections)
    path.write_text(page)
    return path
