"""Line charts drawn on the server as inline SVG (the capacity page; no JavaScript, no
external library): ``line_chart`` turns series of (seconds before now, value) points into
the numbers an SVG template draws — paths, an optional filled area, axis ticks and labels.
A series breaks where its points are further apart than ``gap`` seconds (no worker was
sampling), rather than drawing a line across the silence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# Colours of the series, in order (Django admin blue, orange, green, purple, grey).
PALETTE = ["#417690", "#d9822b", "#2e7d32", "#7b4bb7", "#6b7780"]


def nice_step(raw: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at least ``raw``."""
    if raw <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if factor * power >= raw:
            return float(factor * power)
    return float(10 * power)


def _label(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:g}"


def line_chart(
    series: Sequence[dict[str, Any]],
    *,
    span: float = 3600.0,
    gap: float = 60.0,
    limit: float | None = None,
    limit_label: str = "limit",
    width: int = 560,
    height: int = 180,
) -> dict[str, Any]:
    """Geometry of a chart of ``series`` (each ``{"name", "points": [(seconds before now
    (≤ 0), value), ...], "fill"?: bool, "color"?: str}``) over the last ``span`` seconds,
    with a dashed line at ``limit`` when given. Returns ``width``, ``height``, ``plot``
    (``x``, ``y``, ``w``, ``h``, ``bottom``, ``right``), ``x_ticks`` and ``y_ticks`` (lists of
    ``{"at", "label"}``), ``lines`` (``{"name", "color", "d", "area", "last", "peak"}``), the
    ``limit`` line (``{"y", "label"}``) and ``empty`` (no point in range)."""
    left, right, top, bottom = 34, 10, 10, 22
    plot_w, plot_h = width - left - right, height - top - bottom
    visible = [
        [(float(t), float(v)) for t, v in s.get("points", ()) if -span <= float(t) <= 0]
        for s in series
    ]
    highest = max([v for points in visible for _, v in points] + [limit or 0, 1.0])
    step = nice_step(highest / 4)
    y_max = step * math.ceil(highest / step)

    def x_of(t: float) -> float:
        return round(left + (t + span) / span * plot_w, 1)

    def y_of(v: float) -> float:
        return round(top + plot_h - v / y_max * plot_h, 1)

    lines = []
    for index, (spec, points) in enumerate(zip(series, visible, strict=True)):
        segments: list[list[tuple[float, float]]] = []
        previous = None
        for t, v in sorted(points):
            if previous is None or t - previous > gap:
                segments.append([])
            segments[-1].append((x_of(t), y_of(v)))
            previous = t
        d, area = [], []
        for seg in segments:
            d.append("M" + " L".join(f"{x},{y}" for x, y in seg))
            if len(seg) == 1:  # a lone sample: a dot (round line caps)
                d[-1] += " l0.1,0"
            if spec.get("fill"):
                base = round(top + plot_h, 1)
                area.append(
                    f"M{seg[0][0]},{base} L"
                    + " L".join(f"{x},{y}" for x, y in seg)
                    + f" L{seg[-1][0]},{base} Z"
                )
        lines.append(
            {
                "name": spec["name"],
                "color": spec.get("color") or PALETTE[index % len(PALETTE)],
                "d": " ".join(d),
                "area": " ".join(area),
                "last": _label(points[-1][1]) if points else "—",
                "peak": _label(max(v for _, v in points)) if points else "—",
            }
        )
    y_ticks = [
        {"at": y_of(step * i), "label": _label(step * i)} for i in range(round(y_max / step) + 1)
    ]
    minutes = span / 60
    x_step = 15 if minutes >= 45 else 5 if minutes >= 10 else 1
    x_ticks = [
        {"at": x_of(-m * 60), "label": "now" if m == 0 else f"-{m:g} min"}
        for m in range(int(minutes), -1, -1)
        if m % x_step == 0
    ]
    return {
        "width": width,
        "height": height,
        "plot": {
            "x": left,
            "y": top,
            "w": plot_w,
            "h": plot_h,
            "bottom": top + plot_h,
            "right": left + plot_w,
            "label_x": left - 5,
            "axis_y": top + plot_h + 15,
            "center_x": left + plot_w / 2,
            "center_y": top + plot_h / 2,
        },
        "x_ticks": x_ticks,
        "y_ticks": y_ticks,
        "lines": lines,
        "limit": {"y": y_of(limit), "label": f"{limit_label} {_label(limit)}"}
        if limit is not None
        else None,
        "empty": not any(visible),
    }
