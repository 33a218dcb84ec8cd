"""Training curves as inline SVG line charts (no plotting library; the page opens from disk).

`curves(records)` turns the lines of metrics.jsonl into one chart per entry of `CURVES` that
has data: each chart plots metric value against step, one polyline per metric.
`sweep_curves(groups)` draws a sweep: one chart per metric of `CURVES`, one line per group of
runs (the seeds of one sweep point), its mean over the runs at each step with a band from
their lowest to their highest value.
"""

from __future__ import annotations

import html
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

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


@dataclasses.dataclass(frozen=True)
class Series:
  """One line of a chart: `values` at `steps` (equal lengths, >= 1 point) and, for a group of
  runs, the band from `low` to `high` around it (same lengths)."""
  label: str
  steps: Sequence[float]
  values: Sequence[float]
  low: Sequence[float] | None = None
  high: Sequence[float] | None = None


def line_chart(title: str, series: Sequence[Series]) -> str:
  """An SVG chart of `series`, bands under their lines, with its legend below the x axis."""
  xs = [x for s in series for x in s.steps]
  ys = [y for s in series for y in (*s.values, *(s.low or ()), *(s.high or ()))]
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
  for i, s in enumerate(series):
    colour, label = COLOURS[i % len(COLOURS)], s.label
    if s.low is not None:  # the band: along its top edge, then back along its bottom
      edge = ([point(x, y) for x, y in zip(s.steps, s.high)]
              + [point(x, y) for x, y in zip(reversed(s.steps), reversed(s.low))])
      parts.append(f'<polygon class="band" data-metric="{html.escape(label)}" points="'
                   + " ".join(f"{px:.1f},{py:.1f}" for px, py in edge)
                   + f'" fill="{colour}"/>')
    points = [point(x, y) for x, y in zip(s.steps, s.values)]
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
        series.append(Series(name, [p[0] for p in points], [p[1] for p in points]))
    if series:
      charts.append(line_chart(title, series))
  return charts


def mean_and_band(runs: Sequence[Sequence[dict[str, Any]]], name: str) -> Series | None:
  """Metric `name` over a group of runs (each its metrics.jsonl lines): at every step that all
  of them logged, the runs' mean (values), lowest (low) and highest (high). None when no step
  has it in every run."""
  logged = [{r["step"]: r[name] for r in records if name in r} for records in runs]
  steps = sorted(set.intersection(*(set(by_step) for by_step in logged))) if logged else []
  if not steps:
    return None
  values = np.array([[by_step[s] for s in steps] for by_step in logged], float)
  return Series(name, steps, values.mean(0).tolist(), values.min(0).tolist(),
                values.max(0).tolist())


def sweep_curves(groups: Mapping[str, Sequence[Sequence[dict[str, Any]]]]) -> list[str]:
  """One SVG chart per metric of CURVES that some group has: per group (label -> its runs'
  metrics.jsonl lines) the runs' mean at each step and the band of their range."""
  charts = []
  for title, names in CURVES:
    for name in names:
      series = []
      for label, runs in groups.items():
        group = mean_and_band(runs, name)
        if group is not None:
          series.append(dataclasses.replace(group, label=f"{label} ({len(runs)})"))
      if series:
        charts.append(line_chart(f"{title}: {name}" if len(names) > 1 else title, series))
  return charts
