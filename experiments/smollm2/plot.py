r"""Tables, curves and a metrics summary of the SmolLM2 study from its runs' files.

  python -m experiments.smollm2.plot --root=/tmp/smollm2 --out=experiments/smollm2
  python -m experiments.smollm2.plot --env=textcraft --root=/tmp/smollm2_tc \
      --out=experiments/smollm2

reads ROOT/<run>/metrics.jsonl of the runs that exist (bc, grpo, ...; any directory with a
metrics.jsonl) and every `evaluate` report ROOT/<run>/<name>/eval_test.json (and
ROOT/zero_shot/eval_test.json), then writes
  <env>_curves.png    held-out greedy success per step (in-loop, and <run>/eval_greedy; BC
                      steps, then RL steps after BC's last), training success, KL to the
                      starting checkpoint, step wall time;
  <env>_summary.json  per run: every step's main metrics, every evaluation's Overall numbers;
and prints the README's markdown tables: per step, per evaluation report, and greedy successes
per level (BabyAI) or crafting depth (TextCraft) of every greedy evaluation (the in-loop ones,
ROOT/<run>/eval/step_N, and reports) with the tasks each lost and gained against BC's.
Helpers shared with experiments/tiny/plot.py are imported from there.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

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


def load_reports(root: str) -> dict[str, dict]:
  """{directory relative to root: report} of every `evaluate` report (eval_test.json) under
  root, each read once."""
  out = {}
  for path in sorted(glob.glob(os.path.join(root, "**", "eval_test.json"), recursive=True)):
    with open(path) as f:
      out[os.path.relpath(os.path.dirname(path), root)] = json.load(f)
  return out


def reports(loaded: dict[str, dict]) -> dict[str, dict]:
  """{relative dir: Overall metrics and settings} of the loaded reports."""
  return {rel: {**report["metrics"]["Overall"], "temperature": report["settings"]["temperature"],
                "max_turns": report["settings"]["max_turns"], "seconds": report.get("seconds")}
          for rel, report in loaded.items()}


def eval_table(reps: dict[str, dict]) -> str:
  lines = [("| report | tasks | samples | temperature | success per sample, % | Pass@n, % | "
            "wall, s |"), "|---|---:|---:|---:|---:|---:|---:|"]
  for rel, m in reps.items():
    lines.append(f"| {rel} | {m['num_tasks']} | {m['n']} | {m['temperature']} | "
                 f"{100 * m['pass@1']:.1f} | {100 * m['pass']:.1f} | {m['seconds']} |")
  return "\n".join(lines)


# The README's two per-step tables: what the update learns from, and what a step costs.
LEARNING = {"training success (batch)": ("episodes/success_rate", ".3f"),
            "success of all drawn episodes": ("dynamic_sampling/success_rate", ".3f"),
            "groups dropped": ("dynamic_sampling/dropped", ".2f"),
            "refused actions per turn": ("episodes/invalid_action_rate", ".2f"),
            "actor/kl": ("actor/kl", ".4f"), "entropy": ("actor/entropy", ".3f"),
            "rollout/logprob_gap": ("rollout/logprob_gap", ".1e"),
            "greedy held-out": ("eval/success_rate", ".3f")}
COST = {"time/step, s": ("time/step", ".0f"), "rollout, s": ("time/rollout", ".0f"),
        "scoring, s": ("time/score", ".0f"), "update, s": ("time/update", ".0f"),
        "evaluation, s": ("time/eval", ".0f"), "update tokens/s": ("update/tokens_per_s", ".0f"),
        "rollout tokens/s": ("rollout/tokens_per_s", ".1f")}


def step_table(records: list[dict], columns: dict[str, tuple[str, str]]) -> str:
  """A markdown table of the run's steps (step 0, the start, left out); `columns` maps each
  header to its metric and format. The step's evaluation time is blank when it had none."""
  lines = ["| step | " + " | ".join(columns) + " |", "|---:|" + "---:|" * len(columns)]
  for r in records:
    if r.get("step", 0) == 0:
      continue
    cells = [format(r[key], fmt) if key in r and not (key == "time/eval" and r[key] < 1)
             else "" for key, fmt in columns.values()]
    lines.append(f"| {r['step']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def greedy_reports(loaded: dict[str, dict]) -> dict[str, dict]:
  """{"<run> step N" or "<run>/<report>": {task_id: (level, success)}} of the loaded greedy
  evaluations of one sample per task: BC's first, then each run's in-loop evaluations by step,
  then its other reports."""
  rows = []
  for rel, report in loaded.items():
    if report["settings"]["temperature"] != 0.0 or report["settings"]["num_samples"] != 1:
      continue
    in_loop = re.fullmatch(r"(.+)/eval/step_(\d+)", rel)
    run, step = (in_loop[1], int(in_loop[2])) if in_loop else (rel.split("/")[0], None)
    name = f"{run} step {step}" if in_loop else rel
    tasks = {t["task_id"]: (t["category"], bool(t["success"][0])) for t in report["tasks"]}
    rows.append(((run != "bc", run, step is None, step or 0, name), name, tasks))
  return {name: tasks for _, name, tasks in sorted(rows)}


def level_table(greedy: dict[str, dict], baseline: str) -> str:
  """Greedy successes per level (rows) of each evaluation (columns) on the baseline's tasks,
  and the tasks each lost and gained against the baseline's evaluation."""
  base = greedy[baseline]
  names = [n for n, tasks in greedy.items() if set(tasks) == set(base)]
  levels = list(dict.fromkeys(level for level, _ in base.values()))
  lines = ["| level | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
  for level in levels:
    ids = [t for t, (lv, _) in base.items() if lv == level]
    cells = [f"{sum(greedy[n][t][1] for t in ids)}/{len(ids)}" for n in names]
    lines.append(f"| {level} | " + " | ".join(cells) + " |")
  totals = [f"**{sum(ok for _, ok in greedy[n].values())}/{len(base)}**" for n in names]
  lines.append("| all | " + " | ".join(totals) + " |")
  changes = []
  for n in names:
    lost = sum(base[t][1] and not greedy[n][t][1] for t in base)
    gained = sum(greedy[n][t][1] and not base[t][1] for t in base)
    changes.append("" if n == baseline else f"{lost} / {gained}")
  lines.append(f"| tasks lost / gained against {baseline} | " + " | ".join(changes) + " |")
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
  start = []  # BC's last greedy evaluation: where each RL run's greedy curve starts
  for i, name in enumerate(sorted(runs, key=lambda n: (n != "bc", n))):
    records = runs[name]
    shift = lambda s, o=offset: [(x + o, y) for x, y in s]
    color = f"C{i}"
    report = os.path.join(root, name, "eval_greedy", "eval_test.json")
    greedy = held_out(records, report)
    for ax, data, marker in ((axes[0, 0], greedy if name == "bc" else start + greedy, "o"),
                             (axes[0, 1], train_success(records), None),
                             (axes[1, 0], series(records, "actor/kl"), None),
                             (axes[1, 1], series(records, "time/step"), None)):
      if data:
        ax.plot(*zip(*shift(data)), marker=marker, color=color, label=name)
    if name == "bc" and records:
      offset = records[-1]["step"]
      start = [(0, greedy[-1][1])] if greedy else []
  axes[0, 0].set_title("held-out success, greedy (test split)")
  axes[0, 1].set_title("training success (sampled at the run's temperature)")
  axes[1, 0].set_title("actor/kl: KL to the starting checkpoint (low_var_kl)")
  axes[1, 1].set_title("time/step, s (2 CPU cores)")
  legend = {}  # one legend for the figure: a run has one colour in every panel
  for ax in axes.flat:
    ax.set_xlabel("step (RL after BC's last)")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    legend.update(zip(labels, handles))
  for ax in axes[0]:
    ax.set_ylim(-0.02, 1.02)
  fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=5)
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  fig.savefig(out, dpi=110)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--env", default="babyai", choices=("babyai", "textcraft"))
  parser.add_argument("--root", default="/tmp/smollm2")
  parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  args = parser.parse_args()
  runs = {}
  for name in sorted(os.listdir(args.root)):
    path = os.path.join(args.root, name, "metrics.jsonl")
    if os.path.exists(path):
      runs[name] = read_run(path)  # one record per step (README.md, BabyAI commands)
  loaded = load_reports(args.root)
  reps = reports(loaded)
  summary = {"runs": {name: {"wall_minutes": wall_minutes(r),
                             "steps": [{k: v for k, v in rec.items()
                                        if k == "step" or k in KEYS} for rec in r]}
                      for name, r in runs.items()},
             "evaluations": reps}
  with open(os.path.join(args.out, f"{args.env}_summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  plot(runs, os.path.join(args.out, f"{args.env}_curves.png"), args.root)
  for name, records in runs.items():
    print(f"{name}: held-out greedy {evals(records)}, training wall "
          f"{wall_minutes(records):.1f} min\n")
    print(step_table(records, LEARNING), "\n")
    print(step_table(records, COST), "\n")
  print(eval_table(reps))
  greedy = greedy_reports(loaded)
  bc_evals = [n for n in greedy if n.startswith("bc step")]
  # BC's last in-loop evaluation and its greedy reports (BabyAI: all 90 test tasks), each
  # beside the evaluations of the same tasks.
  for baseline in bc_evals[-1:] + [n for n in greedy if n.startswith("bc/")]:
    print("\n" + level_table(greedy, baseline))


if __name__ == "__main__":
  main()
