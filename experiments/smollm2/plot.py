r"""Tables, curves and a metrics summary of the SmolLM2 study from its runs' files.

  python -m experiments.smollm2.plot --root=/tmp/smollm2 --out=experiments/smollm2

reads ROOT/<run>/metrics.jsonl of the runs that exist (bc, grpo, ...; any directory with a
metrics.jsonl) and every `evaluate` report ROOT/<run>/<name>/eval_test.json (and
ROOT/zero_shot/eval_test.json), then writes
  babyai_curves.png   held-out greedy success per step (in-loop, and <run>/eval_greedy; BC
                      steps, then RL steps after BC's last), training success, KL to the
                      starting checkpoint, step wall time;
  summary.json        per run: every step's main metrics, every evaluation's Overall numbers;
and prints the README's markdown tables. Helpers shared with experiments/tiny/plot.py are
imported from there.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position

from experiments.tiny.plot import evals, read_run, train_success, wall_minutes  # pylint: disable=wrong-import-position

KEYS = ("episodes/success_rate", "dynamic_sampling/success_rate", "dynamic_sampling/dropped",
        "time/score", "eval/success_rate", "actor/kl", "actor/approx_kl",
        "actor/clip_frac", "actor/entropy", "actor/grad_norm", "rollout/logprob_gap",
        "rollout/logprob_gap_max", "time/step", "time/rollout", "time/update", "time/eval",
        "rollout/tokens_per_s", "update/tokens_per_s", "episodes/invalid_action_rate",
        "episodes/num_turns", "batch/length")


def series(records: list[dict], key: str) -> list[tuple[int, float]]:
  return [(r["step"], r[key]) for r in records if key in r]


def reports(root: str) -> dict[str, dict]:
  """{relative dir: Overall metrics and settings} of every evaluate report under root."""
  out = {}
  for path in sorted(glob.glob(os.path.join(root, "**", "eval_test.json"), recursive=True)):
    rel = os.path.relpath(os.path.dirname(path), root)
    with open(path) as f:
      report = json.load(f)
    s = report["settings"]
    out[rel] = {**report["metrics"]["Overall"], "temperature": s["temperature"],
                "max_turns": s["max_turns"], "seconds": report.get("seconds")}
  return out


def eval_table(reps: dict[str, dict]) -> str:
  lines = ["| report | tasks | samples | temperature | success per sample, % | Pass@n, % | "
           "wall, s |", "|---|---:|---:|---:|---:|---:|---:|"]
  for rel, m in reps.items():
    lines.append(f"| {rel} | {m['num_tasks']} | {m['n']} | {m['temperature']} | "
                 f"{100 * m['pass@1']:.1f} | {100 * m['pass']:.1f} | {m['seconds']} |")
  return "\n".join(lines)


def step_table(name: str, records: list[dict]) -> str:
  cols = ("episodes/success_rate", "dynamic_sampling/success_rate", "dynamic_sampling/dropped",
          "actor/kl", "actor/entropy", "actor/clip_frac", "rollout/logprob_gap", "time/step",
          "time/rollout", "time/score", "time/update", "time/eval", "rollout/tokens_per_s",
          "update/tokens_per_s")
  lines = [f"**{name}**", "", "| step | " + " | ".join(cols) + " |",
           "|---:|" + "---:|" * len(cols)]
  for r in records:
    if r.get("step", 0) == 0:
      continue
    cells = [f"{r[k]:.4g}" if k in r else "" for k in cols]
    lines.append(f"| {r['step']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def held_out(records: list[dict], report: str) -> list[tuple[int, float]]:
  """The run's in-loop greedy evaluations, and the greedy `evaluate` report of its last
  checkpoint (<run>/eval_greedy, for a run stopped before its own last evaluation)."""
  points = evals(records)
  if os.path.exists(report) and records:
    with open(report) as f:
      points.append((records[-1]["step"], json.load(f)["metrics"]["Overall"]["pass@1"]))
  return points


def plot(runs: dict[str, list[dict]], out: str, root: str) -> None:
  fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
  offset = 0  # RL steps are drawn after BC's last step
  for i, name in enumerate(sorted(runs, key=lambda n: (n != "bc", n))):
    records = runs[name]
    shift = lambda s, o=offset: [(x + o, y) for x, y in s]  # noqa: E731
    color = f"C{i}"
    report = os.path.join(root, name, "eval_greedy", "eval_test.json")
    for ax, data, marker in ((axes[0, 0], held_out(records, report), "o"),
                             (axes[0, 1], train_success(records), None),
                             (axes[1, 0], series(records, "actor/kl"), None),
                             (axes[1, 1], series(records, "time/step"), None)):
      if data:
        ax.plot(*zip(*shift(data)), marker=marker, color=color, label=name)
    if name == "bc" and records:
      offset = records[-1]["step"]
  axes[0, 0].set_title("held-out success, greedy (test split)")
  axes[0, 1].set_title("training success (sampled, T=1)")
  axes[1, 0].set_title("actor/kl: KL to the starting checkpoint (low_var_kl)")
  axes[1, 1].set_title("time/step, s (2 CPU cores)")
  for ax in axes.flat:
    ax.set_xlabel("step (RL after BC's last)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend()
  for ax in axes[0]:
    ax.set_ylim(-0.02, 1.02)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", default="/tmp/smollm2")
  parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  args = parser.parse_args()
  runs = {}
  for name in sorted(os.listdir(args.root)):
    path = os.path.join(args.root, name, "metrics.jsonl")
    if os.path.exists(path):
      runs[name] = read_run(path)  # one record per step (README.md, Commands)
  reps = reports(args.root)
  summary = {"runs": {name: {"wall_minutes": wall_minutes(r),
                             "steps": [{k: v for k, v in rec.items()
                                        if k == "step" or k in KEYS} for rec in r]}
                      for name, r in runs.items()},
             "evaluations": reps}
  with open(os.path.join(args.out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  plot(runs, os.path.join(args.out, "babyai_curves.png"), args.root)
  for name, records in runs.items():
    print(f"{name}: held-out greedy {evals(records)}, training wall "
          f"{wall_minutes(records):.1f} min\n")
    print(step_table(name, records), "\n")
  print(eval_table(reps))


if __name__ == "__main__":
  main()
