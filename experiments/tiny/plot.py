r"""Tables and curves of the tiny-model study from its runs' metrics.jsonl files.

  python experiments/tiny/plot.py --root=/tmp/tiny --out=experiments/tiny

reads ROOT/<env>/<run>/metrics.jsonl for every run that exists (bc, bc_more, bc_third, grpo,
ppo, reinforce_pp, rloo, gigpo, gigpo_mean_norm, turn_ppo, grpo_kl, gigpo_kl, grpo_bc_more,
ppo_bc_more, the horizon runs h_short, h_long, h_scaling_inter, and seed repeats
<run>_s<seed>), then writes <env>_curves.png (held-out and training success vs step, one line
per run) and horizon_curves.png, and prints the markdown tables of experiments/tiny/README.md
(the sampled one from each run's eval_avg4/ report). `--envs=textcraft` draws only the
environments named.
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

BC_RUNS = ("bc", "bc_more", "bc_third")
ALGO_RUNS = ("grpo", "ppo", "reinforce_pp", "rloo", "gigpo", "gigpo_mean_norm", "turn_ppo",
             "grpo_kl", "gigpo_kl", "grpo_bc_more", "ppo_bc_more")
HORIZON_RUNS = ("h_short", "h_long", "h_scaling_inter")
SAMPLED_REPORT = os.path.join("eval_avg4", "eval_test.json")
LABELS = {"bc": "BC (noisy expert)", "bc_more": "BC, second cycle (from BC)",
          "bc_third": "BC, third cycle (from the second)", "grpo": "GRPO",
          "ppo": "PPO (GAE + critic)", "reinforce_pp": "REINFORCE++", "rloo": "RLOO",
          "gigpo": "GiGPO (mean_std_norm, γ 0.9)", "gigpo_mean_norm": "GiGPO (mean_norm, γ 0.95)",
          "turn_ppo": "PPO, turn-level GAE", "grpo_kl": "GRPO, KL 0.1 to BC",
          "gigpo_kl": "GiGPO, KL 0.1 to BC",
          "grpo_bc_more": "GRPO from the second BC cycle",
          "ppo_bc_more": "PPO from the second BC cycle", "h_short": "fixed short",
          "h_long": "fixed long", "h_scaling_inter": "ScalingInter-RL"}


def read_run(path: str) -> list[dict]:
  """A run's metrics records, one per step: the last written (a line of a process that was
  stopped and whose step was run again is not the run's)."""
  with open(path) as f:
    records = {}
    for line in filter(str.strip, f):
      record = json.loads(line)
      records[record["step"]] = record
  return sorted(records.values(), key=lambda r: r["step"])


def runs_of(env_dir: str) -> dict[str, list[list[dict]]]:
  """{run name: [records of each seed]}; `grpo_s1` is seed 1 of `grpo`."""
  runs = collections.defaultdict(list)
  for name in sorted(os.listdir(env_dir)):
    path = os.path.join(env_dir, name, "metrics.jsonl")
    if os.path.exists(path):
      runs[re.sub(r"_s\d+$", "", name)].append(read_run(path))
  return runs


def evals(records: list[dict]) -> list[tuple[int, float]]:
  return [(r["step"], r["eval/success_rate"]) for r in records if "eval/success_rate" in r]


def train_success(records: list[dict]) -> list[tuple[int, float]]:
  return [(r["step"], r["episodes/success_rate"]) for r in records
          if "episodes/success_rate" in r]


def wall_minutes(records: list[dict]) -> float:
  return sum(r.get("time/step", 0.0) for r in records) / 60


def spread(values: list[float]) -> str:
  if len(values) == 1:
    return f"{100 * values[0]:.1f}"
  mean = sum(values) / len(values)
  return f"{100 * mean:.1f} ({', '.join(f'{100 * v:.1f}' for v in values)})"


def table(env: str, runs: dict[str, list[list[dict]]], names: tuple[str, ...]) -> str:
  """Markdown: each named run's held-out success at its first and last evaluation."""
  lines = ["| run | seeds | held-out success before, % | after, % | gain, points | steps | "
           "training wall, min |", "|---|---:|---:|---:|---:|---:|---:|"]
  for name in names:
    if name not in runs:
      continue
    seeds = runs[name]
    before = [evals(r)[0][1] for r in seeds]
    after = [evals(r)[-1][1] for r in seeds]
    gain = sum(a - b for a, b in zip(after, before)) / len(seeds)
    lines.append(f"| {LABELS[name]} | {len(seeds)} | {spread(before)} | {spread(after)} | "
                 f"{100 * gain:+.1f} | {seeds[0][-1]['step']} | "
                 f"{sum(wall_minutes(r) for r in seeds) / len(seeds):.1f} |")
  return f"**{env}**\n\n" + "\n".join(lines)


def sampled_table(env_dir: str, names: tuple[str, ...]) -> str:
  """Markdown: each run's final checkpoint at temperature 1 (`evaluate --num_samples=4
  --temperature=1.0 --output=<run>/eval_avg4`, as run_study.sh runs it), where it exists."""
  lines = ["| checkpoint | seeds | success per sample, % | Avg@4 | Pass@4, % |",
           "|---|---:|---:|---:|---:|"]
  for name in names:
    seeds = []  # the run, then its seed repeats <name>_s<seed>, where each has the report
    for run in [name] + sorted(d for d in os.listdir(env_dir) if re.fullmatch(rf"{name}_s\d+", d)):
      path = os.path.join(env_dir, run, SAMPLED_REPORT)
      if os.path.exists(path):
        with open(path) as f:
          seeds.append(json.load(f)["metrics"]["Overall"])
    if seeds:
      cells = [spread([s[key] for s in seeds]) for key in ("pass@1", "avg", "pass")]
      lines.append(f"| {LABELS[name]} | {len(seeds)} | " + " | ".join(cells) + " |")
  return "\n".join(lines) if len(lines) > 2 else ""


def plot(runs: dict[str, list[list[dict]]], names: tuple[str, ...], title: str, out: str) -> None:
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for name in names:
    for i, records in enumerate(runs.get(name, [])):
      label = LABELS[name] if i == 0 else None
      for ax, series in zip(axes, (evals(records), train_success(records))):
        if series:
          line, = ax.plot(*zip(*series), marker="o" if ax is axes[0] else None, label=label,
                          alpha=1.0 if i == 0 else 0.5)
          label = None
          line.set_color(f"C{names.index(name)}")
  axes[0].set_title(f"{title}: held-out success (greedy, test split)")
  axes[1].set_title(f"{title}: training success (sampled)")
  for ax in axes:
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
  if axes[0].get_legend_handles_labels()[0]:
    axes[0].legend()
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", default="/tmp/tiny")
  parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  parser.add_argument("--envs", default="",
                      help="comma-separated environments to draw (default: all under ROOT)")
  args = parser.parse_args()
  for env in args.envs.split(",") if args.envs else sorted(os.listdir(args.root)):
    env_dir = os.path.join(args.root, env)
    if not os.path.isdir(env_dir):
      continue
    runs = runs_of(env_dir)
    print(table(env, runs, BC_RUNS + ALGO_RUNS), "\n")
    sampled = sampled_table(env_dir, BC_RUNS + ALGO_RUNS)
    if sampled:
      print(f"**{env}, sampled at temperature 1**\n\n{sampled}\n")
    plot(runs, ALGO_RUNS, env, os.path.join(args.out, f"{env}_curves.png"))
    if any(name in runs for name in HORIZON_RUNS):
      print(table(f"{env}, horizon study (GRPO)", runs, HORIZON_RUNS), "\n")
      plot(runs, HORIZON_RUNS, f"{env} horizons", os.path.join(args.out, "horizon_curves.png"))


if __name__ == "__main__":
  main()
