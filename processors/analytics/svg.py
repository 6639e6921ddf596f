"""Just enough SVG for the analytics report: a line chart and a bar chart, as strings.

Self-contained on purpose (no plotting dependency in the processor's install). Axes are linear,
start at zero on y, and carry min/max tick labels only; the report's tables hold exact numbers.
"""
from __future__ import annotations

from html import escape
from typing import Callable

W, H = 640, 300
LEFT, RIGHT, TOP, BOTTOM = 60, 150, 30, 40  # plot margins; the legend sits in the right one
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _frame(title: str, y_max: float, x_min_label: str, x_max_label: str, y_label: str) -> list[str]:
    x1, y1 = W - RIGHT, H - BOTTOM
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
        f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="14">{escape(title)}</text>',
        f'<line x1="{LEFT}" y1="{y1}" x2="{x1}" y2="{y1}" stroke="black"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{y1}" stroke="black"/>',
        f'<text x="{LEFT - 4}" y="{y1}" text-anchor="end">0</text>',
        f'<text x="{LEFT - 4}" y="{TOP + 4}" text-anchor="end">{y_max:g}</text>',
        f'<text x="14" y="{(TOP + y1) / 2}" transform="rotate(-90 14 {(TOP + y1) / 2})" text-anchor="middle">'
        f'{escape(y_label)}</text>',
        f'<text x="{LEFT}" y="{y1 + 16}">{escape(x_min_label)}</text>',
        f'<text x="{x1}" y="{y1 + 16}" text-anchor="end">{escape(x_max_label)}</text>',
    ]


def _legend(names: list[str]) -> list[str]:
    x = W - RIGHT + 10
    return [f'<rect x="{x}" y="{TOP + 16 * i}" width="10" height="10" fill="{COLORS[i % len(COLORS)]}"/>'
            f'<text x="{x + 14}" y="{TOP + 16 * i + 9}">{escape(name)}</text>' for i, name in enumerate(names)]


def line_chart(series: dict[str, list[tuple[float, float]]], title: str, y_label: str,
               x_format: Callable[[float], str] = lambda x: f"{x:g}") -> str:
    """One polyline per series of (x, y) points (sorted by x here)."""
    points = [p for pts in series.values() for p in pts]
    if not points:
        return _empty(title)
    x_lo, x_hi = min(p[0] for p in points), max(p[0] for p in points)
    y_hi = max(max(p[1] for p in points), 1e-12)
    x_span = (x_hi - x_lo) or 1.0
    sx = lambda x: LEFT + (x - x_lo) / x_span * (W - LEFT - RIGHT)  # noqa: E731
    sy = lambda y: H - BOTTOM - y / y_hi * (H - TOP - BOTTOM)  # noqa: E731
    out = _frame(title, y_hi, x_format(x_lo), x_format(x_hi), y_label)
    for i, pts in enumerate(series.values()):
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(pts))
        out.append(f'<polyline fill="none" stroke="{COLORS[i % len(COLORS)]}" stroke-width="1.5" points="{coords}"/>')
    return "\n".join(out + _legend(list(series)) + ["</svg>"])


def bar_chart(bars: list[tuple[str, float]], title: str, y_label: str) -> str:
    """One bar per (label, value); labels go in the legend, colours tie them to the bars."""
    values = [v for _, v in bars if v == v]  # NaN (no data) draws no bar
    if not values:
        return _empty(title)
    y_hi = max(max(values), 1e-12)
    slot = (W - LEFT - RIGHT) / len(bars)
    out = _frame(title, y_hi, "", "", y_label)
    for i, (_, v) in enumerate(bars):
        if v != v:
            continue
        h = v / y_hi * (H - TOP - BOTTOM)
        out.append(f'<rect x="{LEFT + i * slot + slot * 0.1:.1f}" y="{H - BOTTOM - h:.1f}" width="{slot * 0.8:.1f}" '
                   f'height="{h:.1f}" fill="{COLORS[i % len(COLORS)]}"/>')
    return "\n".join(out + _legend([label for label, _ in bars]) + ["</svg>"])


def _empty(title: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="60" font-family="sans-serif">'
            f'<text x="10" y="30">{escape(title)}: no data</text></svg>')
