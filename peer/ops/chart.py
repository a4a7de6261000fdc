"""A grid of line charts as data, and its PNG drawn with Pillow.

`murmur report` must answer in well under a second, and importing matplotlib alone takes about one
second on a small machine (it builds every artist's signature at import). A report needs only lines,
dashes, points and steps on linear axes, so the chart is plain data (`Chart` of `Panel`s of
`Series`, which tests read) and `Chart.save` draws it with Pillow's ImageDraw: about 0.1 s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Style = Literal["line", "dashed", "points", "steps"]

# matplotlib's tab10, so the report's colours match the benchmarks' figures
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
GRAY, GRID, INK = "#808080", "#e6e6e6", "#000000"


@dataclass
class Series:
    """One series: points (xs[i], ys[i]) drawn as a line, a dashed line, markers or a step after each point."""

    xs: list[float]
    ys: list[float]
    color: str = PALETTE[0]
    style: Style = "line"
    label: str = ""  # named in the panel's legend when the panel asks for series labels


@dataclass
class Panel:
    title: str
    xlabel: str = ""
    ylabel: str = ""
    series: list[Series] = field(default_factory=list)
    legend: list[tuple[str, str, Style]] = field(default_factory=list)  # (label, colour, style) entries
    ymin: float | None = None  # a fixed lower end of the y axis (else the data's)
    integer_y: bool = False  # ticks only at whole numbers

    def add(self, xs: list[float], ys: list[float], **style) -> None:
        if xs:
            self.series.append(Series(list(xs), list(ys), **style))


@dataclass
class Chart:
    panels: list[Panel]
    columns: int = 2
    title: str = ""
    size: tuple[int, int] = (1200, 800)  # pixels

    def save(self, path: Path) -> None:
        from PIL import Image, ImageDraw, ImageFont

        image = Image.new("RGB", self.size, "white")
        draw = ImageDraw.Draw(image)
        fonts = {n: ImageFont.load_default(size=n) for n in (11, 13, 15)}
        width, height = self.size
        draw.text((width / 2, 8), self.title, fill=INK, font=fonts[15], anchor="mt")
        rows = math.ceil(len(self.panels) / self.columns)
        cell_w, cell_h = width / self.columns, (height - 30) / rows
        for i, panel in enumerate(self.panels):
            left, top = (i % self.columns) * cell_w, 30 + (i // self.columns) * cell_h
            _draw_panel(draw, fonts, panel, (left + 70, top + 24, left + cell_w - 20, top + cell_h - 48))
        image.save(path, format="PNG", compress_level=3)


def nice_ticks(low: float, high: float, most: int = 6) -> list[float]:
    """Round tick values (steps of 1, 2 or 5 times a power of ten) covering [low, high], at most `most`+1."""
    if not high > low:
        return [low]
    raw = (high - low) / most
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    return [round(first + k * step, 12) for k in range(int((high - first) / step + 1e-9) + 1)]


def _draw_panel(draw, fonts, panel: Panel, box: tuple[float, float, float, float]) -> None:
    x0, y0, x1, y1 = box
    xs = [x for s in panel.series for x in s.xs]
    ys = [y for s in panel.series for y in s.ys]
    xlow, xhigh = _span(xs, None)
    ylow, yhigh = _span(ys, panel.ymin)
    if panel.integer_y:
        yhigh = max(yhigh, ylow + 1)

    def to_px(x: float, y: float) -> tuple[float, float]:
        return x0 + (x - xlow) / (xhigh - xlow) * (x1 - x0), y1 - (y - ylow) / (yhigh - ylow) * (y1 - y0)

    for x in nice_ticks(xlow, xhigh):
        px = to_px(x, ylow)[0]
        draw.line([(px, y0), (px, y1)], fill=GRID)
        draw.text((px, y1 + 4), _label(x), fill=INK, font=fonts[11], anchor="mt")
    yticks = [y for y in nice_ticks(ylow, yhigh) if not panel.integer_y or y == int(y)]
    for y in yticks:
        py = to_px(xlow, y)[1]
        draw.line([(x0, py), (x1, py)], fill=GRID)
        draw.text((x0 - 5, py), _label(y), fill=INK, font=fonts[11], anchor="rm")
    for s in panel.series:
        _draw_series(draw, [to_px(x, y) for x, y in zip(s.xs, s.ys, strict=True)], s.color, s.style)
    draw.rectangle(box, outline=INK)
    draw.text(((x0 + x1) / 2, y0 - 6), panel.title, fill=INK, font=fonts[13], anchor="mb")
    draw.text(((x0 + x1) / 2, y1 + 20), panel.xlabel, fill=INK, font=fonts[11], anchor="mt")
    draw.text((x0 - 62, (y0 + y1) / 2), panel.ylabel, fill=INK, font=fonts[11], anchor="lm")
    for k, (label, color, style) in enumerate(panel.legend):
        ly = y0 + 12 + 16 * k
        segment = [(x1 - 175, ly), (x1 - 150, ly)]
        _draw_series(draw, segment if style != "points" else segment[1:], color, style)
        draw.text((x1 - 143, ly), label, fill=INK, font=fonts[11], anchor="lm")


def _draw_series(draw, points: list[tuple[float, float]], color: str, style: Style) -> None:
    if style == "points":
        for x, y in points:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=color)
        return
    if style == "steps":  # hold each value until the next point's time
        points = [p for a, b in zip(points, points[1:], strict=False) for p in (a, (b[0], a[1]))] + points[-1:]
    if style == "dashed":
        for a, b in zip(points, points[1:], strict=False):
            _dash(draw, a, b, color)
    elif len(points) > 1:
        draw.line(points, fill=color, width=2, joint="curve")


def _dash(draw, a: tuple[float, float], b: tuple[float, float], color: str, on: float = 6.0, off: float = 4.0) -> None:
    length = math.dist(a, b)
    done = 0.0
    while done < length:
        end = min(done + on, length)
        draw.line([_along(a, b, done / length), _along(a, b, end / length)], fill=color, width=2)
        done = end + off


def _along(a: tuple[float, float], b: tuple[float, float], f: float) -> tuple[float, float]:
    return a[0] + f * (b[0] - a[0]), a[1] + f * (b[1] - a[1])


def _span(values: list[float], floor: float | None) -> tuple[float, float]:
    """The axis range: the data's, widened by 5% (a flat or empty series gets a unit range)."""
    low = min(values, default=0.0) if floor is None else floor
    high = max(values, default=low + 1.0)
    if high <= low:
        return low - 0.5, low + 0.5
    pad = 0.05 * (high - low)
    return (low if floor is not None else low - pad), high + pad


def _label(value: float) -> str:
    return f"{value:.6g}" if abs(value) < 1e5 else f"{value:.2g}"
