"""A line chart as an SVG file, written with the standard library.

The demo's one picture (KV blocks in use over time against a contiguous preallocation) needs
axes, a few lines and a legend. Drawing it here instead of with matplotlib keeps ~80 MB of
plotting packages (matplotlib, fontTools, Pillow, ...) out of the demo's install, and any
browser shows the file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#7f7f7f", "#ff7f0e", "#9467bd")


@dataclass(slots=True)
class Series:
    """One line: `xs[i]` against `ys[i]`."""

    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: str | None = None
    dashed: bool = False


@dataclass(slots=True)
class Marker:
    """A labelled straight line across the plot: horizontal at y=`at`, or vertical at x=`at`."""

    label: str
    at: float
    vertical: bool = False
    color: str = "#7f7f7f"


@dataclass(slots=True)
class Chart:
    title: str
    x_label: str
    y_label: str
    series: list[Series] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    width: int = 900
    height: int = 450


def nice_ticks(lo: float, hi: float, max_ticks: int = 6) -> list[float]:
    """Round tick values covering [lo, hi]: steps of 1, 2 or 5 times a power of ten."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(1, max_ticks - 1)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    t = first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 10))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(t, 10))
    return ticks


def _fmt(v: float) -> str:
    return f"{v:g}" if abs(v) < 1e6 else f"{v:.2e}"


def _dash(pattern: str) -> str:
    return f' stroke-dasharray="{pattern}"' if pattern else ""


def render(chart: Chart) -> str:
    """The chart as an SVG document."""
    left, right, top, bottom = 70, 20, 40, 50
    w, h = chart.width - left - right, chart.height - top - bottom
    xs = [x for s in chart.series for x in s.xs] + [m.at for m in chart.markers if m.vertical]
    ys = [y for s in chart.series for y in s.ys] + [m.at for m in chart.markers if not m.vertical] + [0.0]
    x_ticks = nice_ticks(min(xs, default=0.0), max(xs, default=1.0))
    y_ticks = nice_ticks(min(ys), max(ys))
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * w

    def py(y: float) -> float:
        return top + h - (y - y0) / (y1 - y0) * h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{chart.width}" height="{chart.height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{chart.width}" height="{chart.height}" fill="white"/>',
           f'<text x="{chart.width / 2}" y="22" text-anchor="middle" font-size="15">{escape(chart.title)}</text>']
    for t in y_ticks:
        out.append(f'<line x1="{left}" x2="{left + w}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for t in x_ticks:
        out.append(f'<text x="{px(t):.1f}" y="{top + h + 18}" text-anchor="middle">{_fmt(t)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="black"/>')
    out.append(f'<text x="{left + w / 2}" y="{chart.height - 10}" text-anchor="middle">{escape(chart.x_label)}</text>')
    out.append(f'<text transform="translate(16 {top + h / 2}) rotate(-90)" text-anchor="middle">'
               f'{escape(chart.y_label)}</text>')
    legend: list[tuple[str, str, str]] = []   # label, color, dash pattern ("" = solid)
    for i, s in enumerate(chart.series):
        color = s.color or PALETTE[i % len(PALETTE)]
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(s.xs, s.ys, strict=True))
        dash = "6 4" if s.dashed else ""
        out.append(f'<polyline class="series" points="{points}" fill="none" stroke="{color}" '
                   f'stroke-width="1.5"{_dash(dash)}><title>{escape(s.label)}</title></polyline>')
        legend.append((s.label, color, dash))
    for m in chart.markers:
        if m.vertical:
            a, b = (px(m.at), top), (px(m.at), top + h)
        else:
            a, b = (left, py(m.at)), (left + w, py(m.at))
        out.append(f'<line class="marker" x1="{a[0]:.1f}" y1="{a[1]:.1f}" x2="{b[0]:.1f}" y2="{b[1]:.1f}" '
                   f'stroke="{m.color}"{_dash("2 3")}/>')
        legend.append((m.label, m.color, "2 3"))
    if legend:   # top left, on a white box so that no line runs through the labels
        width = 50 + 7 * max(len(label) for label, _, _ in legend)
        out.append(f'<rect x="{left + 4}" y="{top + 4}" width="{width}" height="{16 * len(legend) + 8}" '
                   f'fill="white" fill-opacity="0.9" stroke="#cccccc"/>')
    for i, (label, color, dash) in enumerate(legend):
        y = top + 20 + 16 * i
        out.append(f'<line x1="{left + 10}" x2="{left + 34}" y1="{y - 4}" y2="{y - 4}" stroke="{color}" '
                   f'stroke-width="2"{_dash(dash)}/>')
        out.append(f'<text x="{left + 40}" y="{y}">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write(chart: Chart, path: Path) -> Path:
    """Render `chart` to `path` (written whole: a half-written file is never left behind)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(chart))
    tmp.replace(path)
    return path


__all__ = ["Chart", "Marker", "Series", "nice_ticks", "render", "write"]
