r"""Table and curves of the turn-level credit study (experiments/keypad/credit.py).

  python experiments/keypad/plot_credit.py --root=/tmp/keypad_credit --out=experiments/keypad

reads ROOT/<algo>_s<seed>/metrics.jsonl for every run there, prints the markdown table of
experiments/keypad/README.md (per estimator, over its seeds: training success at step 1, the
first step whose training success reaches 0.9, the mean of the last 5 steps, held-out success
after the last step, sampled as credit.py evaluates) and writes credit_curves.png (training
and held-out success vs step, the seeds' mean as a thick line and each seed as a thin one).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position

ORDER = ("grpo", "ppo", "gigpo", "turn_ppo", "rloo", "reinforce_pp")
LABELS = {"grpo": "GRPO", "ppo": "PPO (token GAE + critic)", "gigpo": "GiGPO",
          "turn_ppo": "PPO, turn-level GAE", "rloo": "RLOO", "reinforce_pp": "REINFORCE++"}
SOLVED = 0.9


def runs_of(root: str) -> dict[str, list[list[dict]]]:
  """{algo: [records of each seed]} from ROOT/<algo>_s<seed>/metrics.jsonl, runs with steps."""
  runs = collections.defaultdict(list)
  for name in sorted(os.listdir(root)):
    match = re.fullmatch(r"(.+)_s\d+", name)
    path = os.path.join(root, name, "metrics.jsonl")
    if match and os.path.exists(path):
      with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
      if series(records, "episodes/success_rate"):  # a run that has not finished a step yet
        runs[match.group(1)].append(records)
  return runs


def series(records: list[dict], key: str) -> list[tuple[int, float]]:
  return [(r["step"], r[key]) for r in records if key in r]


def cell(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
  """Mean over seeds, then each seed: "55.0 (40.0, 70.0)"; "-" for a seed that has none."""
  known = [v for v in values if v is not None]
  if not known:
    return "-"
  each = ", ".join("-" if v is None else f"{scale * v:.{digits}f}" for v in values)
  mean = f"{scale * sum(known) / len(known):.{digits}f}"
  return mean if len(values) == 1 else f"{mean} ({each})"


def first_solved(records: list[dict]) -> float | None:
  return next((s for s, v in series(records, "episodes/success_rate") if v >= SOLVED), None)


def in_order(runs: dict[str, list[list[dict]]]) -> list[str]:
  """The runs' estimators, those of ORDER first and in its order."""
  return sorted(runs, key=lambda a: ORDER.index(a) if a in ORDER else len(ORDER))


def table(runs: dict[str, list[list[dict]]]) -> str:
  lines = ["| estimator (`algo=`) | seeds | training success, step 1, % | first step with "
           f"training success >= {SOLVED} | training success, last 5 steps, % | held-out "
           "success, last step, % | wall per run, min |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for algo in in_order(runs):
    seeds = runs[algo]
    train = [[v for _, v in series(r, "episodes/success_rate")] for r in seeds]
    held_out = [series(r, "eval/success_rate")[-1][1] for r in seeds]
    wall = sum(sum(x.get("time/step", 0.0) for x in r) for r in seeds) / len(seeds) / 60
    lines.append(
        f"| {LABELS.get(algo, algo)} (`{algo}`) | {len(seeds)} | {cell([t[0] for t in train])} | "
        f"{cell([first_solved(r) for r in seeds], scale=1, digits=0)} | "
        f"{cell([sum(t[-5:]) / len(t[-5:]) for t in train])} | {cell(held_out)} | {wall:.1f} |")
  return "\n".join(lines)


def plot(runs: dict[str, list[list[dict]]], out: str) -> None:
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for i, algo in enumerate(in_order(runs)):
    for ax, key in zip(axes, ("episodes/success_rate", "eval/success_rate")):
      per_seed = [dict(series(r, key)) for r in runs[algo]]
      for s in per_seed:
        ax.plot(list(s), list(s.values()), color=f"C{i}", alpha=0.3, linewidth=1)
      steps = sorted(set.intersection(*(set(s) for s in per_seed)))
      mean = [sum(s[x] for s in per_seed) / len(per_seed) for x in steps]
      ax.plot(steps, mean, color=f"C{i}", linewidth=2.5,
              label=f"{LABELS.get(algo, algo)} ({len(per_seed)} seeds)")
  axes[0].set_title("keypad 37: training success (sampled)")
  axes[1].set_title("keypad 37: held-out success (32 test tasks x 4, temperature 1)")
  for ax in axes:
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", default="/tmp/keypad_credit")
  parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  args = parser.parse_args()
  runs = runs_of(args.root)
  if not runs:
    raise SystemExit(f"No <algo>_s<seed>/metrics.jsonl under {args.root}: run the study first "
                     "(experiments/keypad/credit.py has the commands).")
  print(table(runs))
  plot(runs, os.path.join(args.out, "credit_curves.png"))


if __name__ == "__main__":
  main()
