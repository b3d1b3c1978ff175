"""Plots as inline SVG text, for reports that must open without network access or a plotting
library: a scatter plot (optionally log-scaled, with a highlighted Pareto front) and a horizontal
bar chart. Every mark carries a <title>, which browsers show on hover.

Only geometry and escaping live here; which numbers to plot is the caller's business.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"]


@dataclass
class Point:
    x: float
    y: float
    label: str
    group: str = ""


def pareto_front(points: list[Point]) -> list[int]:
    """Indices of the points no other point beats on both axes (smaller x and smaller y are better),
    ordered by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i].x, points[i].y))
    front, best_y = [], math.inf
    for i in order:
        if points[i].y < best_y:
            front.append(i)
            best_y = points[i].y
    return front


def _ticks(lo: float, hi: float, log: bool, n: int = 5) -> list[float]:
    if log:
        # Decades, then 1-2-5 within them, then every digit: whichever first puts 3 ticks in range
        # (a range inside one decade would otherwise show no tick at all).
        decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
        for mantissas in ((1,), (1, 2, 5), tuple(range(1, 10))):
            ticks = [m * 10.0 ** e for e in decades for m in mantissas]
            if sum(lo <= t <= hi for t in ticks) >= 3:
                return ticks
        return _ticks(lo, hi, False, n)  # a narrow range: evenly spaced values, placed on the log axis
    if hi == lo:
        return [lo]
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step = next(m * step for m in (1, 2, 5, 10) if m * step >= raw)
    start = math.floor(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step) + 2)]


def _fmt_tick(v: float, log: bool) -> str:
    if log:
        e = math.floor(math.log10(v) + 1e-9)
        m = v / 10.0 ** e
        return f"1e{e}" if abs(m - 1) < 1e-9 else f"{m:.3g}e{e}"
    if abs(v) >= 1e6:
        return f"{v / 1e6:g} M"
    if abs(v) >= 1e3:
        return f"{v / 1e3:g} k"
    return f"{v:g}"


def scatter(points: list[Point], x_label: str, y_label: str, log_y: bool = False, log_x: bool = False,
            front: bool = True, width: int = 940, height: int = 420, title: str = "") -> str:
    """An SVG scatter plot; points with y <= 0 on a log axis are left out (and said so in the title)."""
    usable = [p for p in points if (p.y > 0 or not log_y) and (p.x > 0 or not log_x)
              and math.isfinite(p.x) and math.isfinite(p.y)]
    dropped = len(points) - len(usable)
    ml, mr, mt, mb = 78, 180, 30, 52  # the legend sits right of the frame, clear of the points
    pw, ph = width - ml - mr, height - mt - mb
    parts = [f'<svg class="plot scatter" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title or y_label)}">']
    if title:
        parts.append(f'<text x="{ml}" y="18" class="ptitle">{escape(title)}'
                     + (f" ({dropped} point(s) at 0 left out of the log axis)" if dropped else "") + "</text>")
    if not usable:
        parts.append(f'<text x="{ml}" y="{mt + ph / 2}">no data</text></svg>')
        return "".join(parts)
    tx = (lambda v: math.log10(v)) if log_x else (lambda v: v)
    ty = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    xs, ys = [tx(p.x) for p in usable], [ty(p.y) for p in usable]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    padx = (x1 - x0) * 0.06 or (abs(x0) * 0.1 or 1.0)
    pady = (y1 - y0) * 0.08 or (abs(y0) * 0.1 or 1.0)
    x0, x1, y0, y1 = x0 - padx, x1 + padx, y0 - pady, y1 + pady
    sx = lambda v: ml + (tx(v) - x0) / (x1 - x0) * pw  # noqa: E731
    sy = lambda v: mt + ph - (ty(v) - y0) / (y1 - y0) * ph  # noqa: E731
    parts.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" class="frame"/>')
    inv_x = (lambda v: 10 ** v) if log_x else (lambda v: v)
    inv_y = (lambda v: 10 ** v) if log_y else (lambda v: v)
    for t in _ticks(inv_x(x0), inv_x(x1), log_x):
        if inv_x(x0) <= t <= inv_x(x1):
            x = sx(t)
            parts.append(f'<line x1="{x:.1f}" y1="{mt}" x2="{x:.1f}" y2="{mt + ph}" class="grid"/>'
                         f'<text x="{x:.1f}" y="{mt + ph + 16}" class="tick" text-anchor="middle">{_fmt_tick(t, log_x)}</text>')
    for t in _ticks(inv_y(y0), inv_y(y1), log_y):
        if inv_y(y0) <= t <= inv_y(y1):
            y = sy(t)
            parts.append(f'<line x1="{ml}" y1="{y:.1f}" x2="{ml + pw}" y2="{y:.1f}" class="grid"/>'
                         f'<text x="{ml - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">{_fmt_tick(t, log_y)}</text>')
    parts.append(f'<text x="{ml + pw / 2}" y="{height - 10}" class="axis" text-anchor="middle">{escape(x_label)}</text>')
    parts.append(f'<text x="16" y="{mt + ph / 2}" class="axis" text-anchor="middle" '
                 f'transform="rotate(-90 16 {mt + ph / 2})">{escape(y_label)}</text>')
    groups = list(dict.fromkeys(p.group for p in usable))
    colour = {g: PALETTE[i % len(PALETTE)] for i, g in enumerate(groups)}
    on_front = set(pareto_front(usable)) if front else set()
    if front and len(on_front) > 1:
        path = " ".join(f"{sx(usable[i].x):.1f},{sy(usable[i].y):.1f}" for i in pareto_front(usable))
        parts.append(f'<polyline points="{path}" class="front"/>')
    for i in sorted(on_front):  # name the front's points: they are the ones worth choosing
        p = usable[i]
        right = sx(p.x) > ml + 0.7 * pw  # near the right edge the name goes to the left of the point
        parts.append(f'<text x="{sx(p.x) + (-8 if right else 8):.1f}" y="{sy(p.y) - 6:.1f}" class="plabel" '
                     f'text-anchor="{"end" if right else "start"}">{escape(p.label)}</text>')
    for i, p in enumerate(usable):
        cls = "point front-point" if i in on_front else "point"
        parts.append(f'<circle class="{cls}" cx="{sx(p.x):.1f}" cy="{sy(p.y):.1f}" r="{6 if i in on_front else 4.5}" '
                     f'fill="{colour[p.group]}"><title>{escape(p.label)}: {escape(x_label)} {p.x:,.6g}, '
                     f'{escape(y_label)} {p.y:.4g}{" (Pareto front)" if i in on_front else ""}</title></circle>')
    # Legend: one swatch per group, top right inside the frame.
    for k, g in enumerate(groups):
        if not g:
            continue
        ly = mt + 14 + 16 * k
        parts.append(f'<circle cx="{ml + pw + 18}" cy="{ly - 4}" r="4.5" fill="{colour[g]}"/>'
                     f'<text x="{ml + pw + 28}" y="{ly}" class="legend">{escape(g)}</text>')
    if front:
        ly = mt + 14 + 16 * len([g for g in groups if g])
        parts.append(f'<line x1="{ml + pw + 12}" y1="{ly - 4}" x2="{ml + pw + 24}" y2="{ly - 4}" class="front"/>'
                     f'<text x="{ml + pw + 28}" y="{ly}" class="legend">Pareto front</text>')
    parts.append("</svg>")
    return "".join(parts)


def bars(items: list[tuple[str, float]], value_label: str, width: int = 760, bar_height: int = 16,
         title: str = "") -> str:
    """Horizontal bars, one per (label, value), in the order given; values must be >= 0."""
    label_w, mr, mt = 260, 70, 30 if title else 10
    pw = width - label_w - mr
    height = mt + len(items) * (bar_height + 4) + 34
    top = max((v for _, v in items if math.isfinite(v)), default=0.0) or 1.0
    parts = [f'<svg class="plot bars" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title or value_label)}">']
    if title:
        parts.append(f'<text x="4" y="18" class="ptitle">{escape(title)}</text>')
    for k, (label, v) in enumerate(items):
        y = mt + k * (bar_height + 4)
        w = max(0.0, v) / top * pw if math.isfinite(v) else 0.0
        parts.append(f'<text x="{label_w - 6}" y="{y + bar_height - 4}" class="tick" text-anchor="end">{escape(label)}</text>'
                     f'<rect class="bar" x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_height}">'
                     f'<title>{escape(label)}: {escape(value_label)} {v:.4g}</title></rect>'
                     f'<text x="{label_w + w + 4:.1f}" y="{y + bar_height - 4}" class="tick">{v:.3g}</text>')
    base = mt + len(items) * (bar_height + 4)
    parts.append(f'<line x1="{label_w}" y1="{mt - 2}" x2="{label_w}" y2="{base}" class="axisline"/>'
                 f'<text x="{label_w + pw / 2}" y="{base + 24}" class="axis" text-anchor="middle">{escape(value_label)}</text></svg>')
    return "".join(parts)
