r"""Curves of a sweep's groups of seeds, each as the seeds' mean and the band of their range.

  python -m experiments.smollm2.plot_sweep experiments/smollm2/runs/algos \
      --out=experiments/smollm2/babyai_algos.png
  python -m experiments.smollm2.plot_sweep experiments/smollm2/runs/textcraft \
      --x=update/trained_tokens_total --out=experiments/smollm2/horizons.png

Groups the runs as `agentgym_jax.report` does (report.find_groups: a run's name without its
`seed=` part; every argument a run or a directory of runs, kept records included) and draws,
per metric of --metrics, one panel with a line per group: at each step that every seed of the
group logged, the seeds' mean, and a band from the lowest to the highest (viewer/charts.py's
`mean_and_band`, the viewer's sweep page in PNG form). With --x set to a metric (the horizon
study's `update/trained_tokens_total`), a group's points sit at the seeds' mean of that metric
at the step. A run that did not evaluate its start gets the last held-out evaluation of the
run it started from (its BC run) at step 0 and 0 trained tokens. Prints, per group, its seeds
and their last step.
"""

from __future__ import annotations
import argparse
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position

from agentgym_jax import report  # pylint: disable=wrong-import-position
from agentgym_jax.train import metrics as metrics_lib  # pylint: disable=wrong-import-position
from agentgym_jax.viewer import charts  # pylint: disable=wrong-import-position

EVAL, TOKENS = "eval/success_rate", "update/trained_tokens_total"
METRICS = (EVAL, "episodes/success_rate", "schedule/max_turns",
           "episodes/turns_mean", "actor/kl")
STEP = "step"


def read_curves(workdir: str) -> list[dict]:
  """A run's metrics.jsonl lines, led by a step-0 line with its start's held-out success when
  it did not evaluate its start itself: the last `eval/success_rate` of the run it started
  from (`init_from`, as report reads it), at 0 trained tokens."""
  records = metrics_lib.read_metrics(workdir)
  if any(r["step"] == 0 and EVAL in r for r in records):
    return records
  start = report.start_run(workdir, report.run_config(workdir).get("init_from"))
  evaluated = [r for r in metrics_lib.read_metrics(start) if EVAL in r] if start else []
  if not evaluated:
    return records
  first = {k: v for k, v in evaluated[-1].items() if k.startswith("eval/")}
  return [{"step": 0, TOKENS: 0, **first}] + records


def read_groups(workdirs: Sequence[str]) -> dict[str, list[list[dict]]]:
  """Group label -> its runs' curves (`read_curves`), the groups as report.find_groups makes
  them (runs without evaluations are no run to it, so none to this)."""
  return {label: [read_curves(run) for run in runs]
          for label, runs in report.find_groups(workdirs).items()}


def draw(groups: dict[str, list[list[dict]]], names: Sequence[str], x: str, out: str) -> list[str]:
  """Writes the panels of `names` that some group logged to `out`; returns their names."""
  drawn = [n for n in names if any(charts.mean_and_band(runs, n) for runs in groups.values())]
  if not drawn:
    raise SystemExit(f"None of the metrics {list(names)} is logged at a step of every seed of "
                     "a group; pass --metrics from the runs' metrics.jsonl.")
  # Per group, step -> x: the step itself, or the seeds' mean of metric x at that step.
  x_at = {}
  for label, runs in groups.items():
    where = charts.mean_and_band(runs, x) if x != STEP else None
    x_at[label] = dict(zip(where.steps, where.values)) if where else {}
  fig, axes = plt.subplots(1, len(drawn), figsize=(4.2 * len(drawn), 3.4), squeeze=False)
  for ax, name in zip(axes[0], drawn):
    for label, runs in groups.items():
      series = charts.mean_and_band(runs, name)
      if series is None:
        continue
      kept = [i for i, step in enumerate(series.steps) if x == STEP or step in x_at[label]]
      xs = [series.steps[i] if x == STEP else x_at[label][series.steps[i]] for i in kept]
      line, = ax.plot(xs, [series.values[i] for i in kept], marker="o", markersize=3,
                      label=f"{label} ({len(runs)})")
      ax.fill_between(xs, [series.low[i] for i in kept], [series.high[i] for i in kept],
                      color=line.get_color(), alpha=0.2)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel(x, fontsize=8)
    ax.tick_params(labelsize=7)
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return drawn


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdirs", nargs="+", help="runs, or directories of runs (sweeps)")
  parser.add_argument("--out", required=True, help="the PNG to write")
  parser.add_argument("--metrics", default=",".join(METRICS),
                      help="comma-separated metrics, a panel each (those no group logged at a "
                           "step of every seed are left out)")
  parser.add_argument("--x", default=STEP, help="the x axis: 'step', or a metric logged "
                                                "every step")
  args = parser.parse_args(argv)
  try:
    groups = read_groups(args.workdirs)
  except report.ReportError as e:
    raise SystemExit(f"FATAL: {e}") from None
  drawn = draw(groups, args.metrics.split(","), args.x, args.out)
  for label, runs in groups.items():
    last = [records[-1]["step"] if records else 0 for records in runs]
    print(f"{label}: {len(runs)} seeds, last steps {last}")
  print(f"Wrote {args.out} ({', '.join(drawn)}).")


if __name__ == "__main__":
  main()
