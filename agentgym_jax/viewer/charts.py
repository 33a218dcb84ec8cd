"""Training curves as inline SVG line charts (no plotting library; the page opens from disk).

`curves(records)` turns the lines of metrics.jsonl into one chart per entry of `CURVES` that
has data: each chart plots metric value against step, one polyline per metric.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

# (chart title, metrics drawn in it); a metric absent from the run is left out.
CURVES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Success rate", ("episodes/success_rate", "eval/success_rate")),
    ("Reward", ("episodes/reward_mean",)),
    ("Turns per episode", ("episodes/turns_mean",)),
    ("Turn limit (schedule)", ("schedule/max_turns",)),
    # To the reference policy (in the loss or the reward) and to the sampling policy.
    ("KL", ("actor/kl", "reward/kl_mean", "actor/approx_kl")),
    ("Entropy", ("actor/entropy",)),
)
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
# Pixels: plot area, its left margin (room for a y label as long as -0.000351) and top margin,
# the x-axis labels' band, a legend line. Three charts fit side by side in the page's 1200 px.
PLOT_W, PLOT_H, LEFT, TOP, AXIS, LEGEND = 300, 130, 56, 28, 20, 13


def _fmt(x: float) -> str:
  return f"{x:.3g}"


def line_chart(title: str, series: Sequence[tuple[str, Sequence[float], Sequence[float]]]
               ) -> str:
  """An SVG chart of `series`, each (label, steps, values) of equal lengths (>= 1 point),
  with its legend below the x axis."""
  xs = [x for _, sx, _ in series for x in sx]
  ys = [y for _, _, sy in series for y in sy]
  x0, x1 = min(xs), max(xs)
  y0, y1 = min(ys), max(ys)
  if x1 == x0:
    x0, x1 = x0 - 1, x1 + 1
  if y1 == y0:  # a flat line sits mid-chart
    y0, y1 = y0 - (abs(y0) or 1) / 2, y1 + (abs(y1) or 1) / 2
  width, height = LEFT + PLOT_W + 16, TOP + PLOT_H + AXIS + LEGEND * len(series) + 4
  bottom, right = TOP + PLOT_H, LEFT + PLOT_W

  def point(x: float, y: float) -> tuple[float, float]:
    return LEFT + (x - x0) / (x1 - x0) * PLOT_W, bottom - (y - y0) / (y1 - y0) * PLOT_H

  parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{height}" viewBox="0 0 {width} {height}">',
           f'<text x="{width / 2}" y="16" text-anchor="middle" class="title">'
           f'{html.escape(title)}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{PLOT_W}" height="{PLOT_H}" class="frame"/>',
           f'<text x="{LEFT - 4}" y="{TOP + 8}" text-anchor="end">{_fmt(y1)}</text>',
           f'<text x="{LEFT - 4}" y="{bottom}" text-anchor="end">{_fmt(y0)}</text>',
           f'<text x="{LEFT}" y="{bottom + 14}">{_fmt(x0)}</text>',
           f'<text x="{right}" y="{bottom + 14}" text-anchor="end">{_fmt(x1)}</text>',
           f'<text x="{LEFT + PLOT_W / 2}" y="{bottom + 14}" text-anchor="middle">step</text>']
  for i, (label, sx, sy) in enumerate(series):
    colour = COLOURS[i % len(COLOURS)]
    points = [point(x, y) for x, y in zip(sx, sy)]
    parts.append(f'<polyline class="series" data-metric="{html.escape(label)}" points="'
                 + " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
                 + f'" stroke="{colour}"/>')
    if len(points) <= 40:  # markers, where a line alone would hide single points
      parts += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2.5" fill="{colour}"/>'
                for px, py in points]
    parts.append(f'<text x="{LEFT}" y="{bottom + AXIS + LEGEND * (i + 1) - 2}" '
                 f'fill="{colour}">&#9473; {html.escape(label)}</text>')
  parts.append("</svg>")
  return "\n".join(parts)


def curves(records: Sequence[dict[str, Any]]) -> list[str]:
  """One SVG chart per entry of CURVES with data in `records` (metrics.jsonl lines)."""
  charts = []
  for title, names in CURVES:
    series = []
    for name in names:
      points = [(r["step"], r[name]) for r in records if name in r]
      if points:
        series.append((name, [p[0] for p in points], [p[1] for p in points]))
    if series:
      charts.append(line_chart(title, series))
  return charts
