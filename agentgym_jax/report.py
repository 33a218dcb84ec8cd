r"""Held-out success before and after training, per run and pooled over a sweep's seeds, with
95% bootstrap intervals of the change, overall and per level.

  python -m agentgym_jax.report WORKDIR... [--out DIR] [--before_step N] [--after_step N]
      [--eval_dir eval]

A WORKDIR is a training workdir, or a sweep's base workdir whose sub-directories are runs
(`launch/sweep.py`: one per point, named like `algo=grpo,seed=3`). Runs whose names differ
only by their `seed=` component are pooled into one group. Each run's held-out results are the
trainer's evaluation reports, WORKDIR/eval/step_<N>/eval_<split>.json: "before" is its first
evaluated step, "after" its last (or the steps given). A run that starts from another run's
checkpoint (`init_from`, e.g. RL from BC) and did not evaluate its own start takes its "before"
from that run's last evaluation, the checkpoint it started from (the main job's RL stage,
`eval.at_start = False`). --eval_dir reads other evaluations of the same runs, e.g. of all 90
BabyAI test tasks where training evaluated 48:
  python -m agentgym_jax.evaluate --config=CFG --checkpoint=RUN --num_tasks=90 \
      --output=RUN/eval_all/step_24   # and the BC run's at its last step
  python -m agentgym_jax.report RUN --eval_dir=eval_all

A task's success is the share of its healthy samples that passed (0 or 1 for greedy
evaluation); tasks with no healthy sample at either step, or missing from any run of a group,
are left out, so every run of a group is compared on the same tasks.

The interval is a percentile bootstrap of the paired change (after - before on the same task)
over tasks and seeds together: each resample draws the tasks with replacement and, in a group
of several runs, the seeds with replacement, and takes the mean change over the drawn
(seed, task) cells; the interval is the 2.5% and 97.5% quantiles of the resampled means
(Efron & Tibshirani 1993, ch. 13; the crossed design of Owen 2007, "The pigeonhole bootstrap").
Drawing the same tasks for every drawn seed keeps the pairing: a task that is easy for every
seed counts once per resample, not as independent evidence per seed.

Writes DIR/report.md (the tables, also printed) and DIR/report.json (every number, fractions);
DIR defaults to the first WORKDIR.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import app, flags

from agentgym_jax import cli, sweeps
from agentgym_jax.evaluate import columns

# Where the trainer writes its in-loop evaluation reports (train/loop.py's EVAL_DIR).
EVAL_DIR = "eval"
LEVEL = 0.95
OVERALL = "Overall"


class ReportError(ValueError):
  """A workdir the report cannot read; the message is one line saying what to do."""


# ----- the statistic ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Interval:
  """A mean over (seed, task) cells and its bootstrap interval at `LEVEL`."""
  mean: float
  low: float
  high: float


def bootstrap_means(cells: np.ndarray, *, resamples: int, rng: np.random.Generator
                    ) -> np.ndarray:
  """[resamples] means of `cells` [seeds, tasks] resampled over tasks and seeds with
  replacement (crossed: one draw of tasks per resample, shared by its seeds).

  Per resample b: tasks T_b ~ U{0..tasks-1}^tasks, then seeds S_b ~ U{0..seeds-1}^seeds;
  stat_b = mean over s in S_b, t in T_b of cells[s, t]. With one seed this is the ordinary
  bootstrap of the mean over tasks; the tasks are drawn first, so a group of identical seeds
  gives the one-seed draws exactly.
  """
  cells = np.asarray(cells, np.float64)
  if cells.ndim != 2 or 0 in cells.shape:
    raise ValueError(f"cells must be [seeds, tasks] with both >= 1, got shape {cells.shape}.")
  num_seeds, num_tasks = cells.shape
  tasks = rng.integers(num_tasks, size=(resamples, num_tasks))
  seeds = rng.integers(num_seeds, size=(resamples, num_seeds))
  stats = np.empty(resamples)
  chunk = max(1, 2 ** 22 // (num_seeds * num_tasks))  # at most ~32 MB of gathered cells
  for start in range(0, resamples, chunk):
    stop = min(start + chunk, resamples)
    drawn = cells[seeds[start:stop, :, None], tasks[start:stop, None, :]]
    stats[start:stop] = drawn.mean(axis=(1, 2))
  return stats


def bootstrap_mean(cells: np.ndarray, *, resamples: int, rng: np.random.Generator,
                   level: float = LEVEL) -> Interval:
  """The mean of `cells` [seeds, tasks] and its percentile interval: the ((1 - level) / 2,
  (1 + level) / 2) quantiles (numpy's linear interpolation) of `bootstrap_means`."""
  stats = bootstrap_means(cells, resamples=resamples, rng=rng)
  low, high = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
  return Interval(mean=float(np.mean(cells)), low=float(low), high=float(high))


# ----- reading runs ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunResult:
  """One run's held-out success per task at its before and after steps."""
  name: str  # the workdir's base name
  workdir: str
  seed: int | None
  env: str
  before_step: int
  after_step: int
  num_evaluated: tuple[int, int]  # tasks in the before and after reports
  tasks: dict[int, tuple[str, float, float]]  # task id -> (level, success before, after)
  before_from: str = ""  # the run whose evaluation is "before", when not this one (init_from)


def _eval_steps(workdir: str, eval_dir: str = EVAL_DIR) -> dict[int, str]:
  """Step -> directory of the evaluation reports in `workdir`/`eval_dir`."""
  found = {}
  for path in glob.glob(os.path.join(workdir, eval_dir, "step_*")):
    match = re.fullmatch(r"step_(\d+)", os.path.basename(path))
    if match and os.path.isdir(path):
      found[int(match.group(1))] = path
  return found


def _read_report(step_dir: str, split: str) -> dict[str, Any]:
  path = os.path.join(step_dir, f"eval_{split}.json")
  if not os.path.exists(path):
    raise ReportError(f"No {path}: the run did not finish this evaluation, or evaluated "
                      f"another split (--split).")
  try:
    with open(path) as f:
      report = json.load(f)
    tasks = report["tasks"]
    env = report["settings"]["env"]
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    raise ReportError(f"{path} is not an evaluation report ({type(e).__name__}: {e}); rerun "
                      "the evaluation of that step (python -m agentgym_jax.evaluate).") from e
  success = {}
  for task in tasks:
    healthy = [bool(s) for s, f in zip(task["success"], task["failed"]) if not f]
    if healthy:
      success[int(task["task_id"])] = (columns.paper_column(env, task.get("category")) or "?",
                                       float(np.mean(healthy)))
  return {"env": env, "success": success, "num_tasks": len(tasks)}


def run_config(workdir: str) -> dict[str, Any]:
  """The run's saved config.json ({} without one)."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def start_run(workdir: str, init: str | None) -> str | None:
  """The run directory a run started from (its config's `init_from`), when there is one; a
  relative `init` is relative to `workdir` (`agentgym_jax.archive`'s copies)."""
  if not init:
    return None
  init = os.path.normpath(os.path.join(workdir, init))  # join keeps an absolute init as it is
  return init if os.path.isdir(init) else None


def _start_evaluation(workdir: str, init: str | None, steps: dict[int, str],
                      eval_dir: str = EVAL_DIR) -> tuple[str, int, str] | None:
  """(run, step, report directory) of the evaluation of the checkpoint a run started from
  (its `init` run, `start_run`), when it did not evaluate step 0 itself and that run
  evaluated."""
  init = start_run(workdir, init) if 0 not in steps else None
  if init is None:
    return None
  init_steps = _eval_steps(init, eval_dir)
  if not init_steps:
    return None
  last = max(init_steps)
  return init, last, init_steps[last]


def read_run(workdir: str, *, split: str = "test", before_step: int | None = None,
             after_step: int | None = None, eval_dir: str = EVAL_DIR) -> RunResult:
  """Per-task held-out success of the run in `workdir` at its first and last evaluated steps
  (or the steps given), from the reports in `workdir`/`eval_dir`/step_<N>/.

  Raises:
    ReportError: no evaluation reports, fewer than two evaluated steps, a step not
      evaluated, or a report that does not read.
  """
  steps = _eval_steps(workdir, eval_dir)
  where = os.path.join(workdir, eval_dir)
  config = run_config(workdir)
  start = (_start_evaluation(workdir, config.get("init_from"), steps, eval_dir)
           if before_step is None else None)
  if len(steps) < (1 if start else 2):
    raise ReportError(f"{workdir} has {len(steps)} evaluated step(s) in {where}/step_<N>/, "
                      "the report needs a before and an after: train with eval.every_steps > 0 "
                      "and eval.at_start (the defaults), or from init_from a run that evaluated.")
  after_step = max(steps) if after_step is None else after_step
  before_from, before_dir = "", None
  if start:
    before_from, before_step, before_dir = start
  elif before_step is None:
    before_step = min(steps)
  for step in ((after_step,) if start else (before_step, after_step)):
    if step not in steps:
      raise ReportError(f"{workdir} has no evaluation at step {step}; it has steps "
                        f"{sorted(steps)}.")
  before = _read_report(before_dir or steps[before_step], split)
  after = _read_report(steps[after_step], split)
  both = sorted(before["success"].keys() & after["success"].keys())
  return RunResult(
      name=os.path.basename(os.path.normpath(workdir)), workdir=workdir, seed=config.get("seed"),
      env=after["env"], before_step=before_step, after_step=after_step,
      num_evaluated=(before["num_tasks"], after["num_tasks"]),
      tasks={t: (after["success"][t][0], before["success"][t][1], after["success"][t][1])
             for t in both}, before_from=before_from)


def find_groups(workdirs: Sequence[str], eval_dir: str = EVAL_DIR) -> dict[str, list[str]]:
  """Group label -> the run workdirs pooled in it: per argument, its runs (itself, or its
  sub-directories) grouped by their names without the `seed=` component; runs given as
  arguments themselves pool with each other the same way (e.g. seeds 0 and 1 of one recipe
  from two sweeps' workdirs).

  Raises:
    ReportError: an argument that is not a directory or holds no run with evaluations.
  """
  groups: dict[str, list[str]] = {}
  for workdir in workdirs:
    if not os.path.isdir(workdir):
      raise ReportError(f"{workdir!r} is not a directory: pass training workdirs or a "
                        "sweep's base workdir.")
    runs = sweeps.runs_in(workdir, eval_dir)
    if not runs:
      raise ReportError(f"{workdir} holds no run: neither it nor a sub-directory has "
                        f"{eval_dir}/step_<N>/ evaluation reports (train with "
                        "eval.every_steps > 0).")
    top = os.path.basename(os.path.normpath(workdir))
    for run in runs:
      if run == workdir:  # a run itself: pooled with the runs given beside it that share its name
        label = sweeps.group_name(top) or top
      else:
        name = sweeps.group_name(os.path.basename(os.path.normpath(run)))
        label = f"{top}/{name}" if name else top
      groups.setdefault(label, []).append(run)
  return groups


# ----- the report ------------------------------------------------------------------------------


def _summary(before: np.ndarray, after: np.ndarray, *, resamples: int, seed: int
             ) -> dict[str, Any]:
  """Means of before and after [seeds, tasks] and the change's interval (fractions)."""
  change = bootstrap_mean(after - before, resamples=resamples, rng=np.random.default_rng(seed))
  return {"seeds": int(before.shape[0]), "tasks": int(before.shape[1]),
          "before": float(before.mean()), "after": float(after.mean()),
          "change": change.mean, "low": change.low, "high": change.high}


def _by_level(runs: Sequence[RunResult], task_ids: Sequence[int], *, resamples: int, seed: int
              ) -> dict[str, dict[str, Any]]:
  """Overall and per-level summaries of `runs` on `task_ids` (every run has them all)."""
  levels = {t: runs[0].tasks[t][0] for t in task_ids}
  out = {}
  for level in [OVERALL, *dict.fromkeys(levels[t] for t in task_ids)]:
    chosen = [t for t in task_ids if level == OVERALL or levels[t] == level]
    before = np.array([[run.tasks[t][1] for t in chosen] for run in runs])
    after = np.array([[run.tasks[t][2] for t in chosen] for run in runs])
    out[level] = _summary(before, after, resamples=resamples, seed=seed)
  return out


def build(workdirs: Sequence[str], *, split: str = "test", before_step: int | None = None,
          after_step: int | None = None, resamples: int = 10_000, seed: int = 0,
          eval_dir: str = EVAL_DIR) -> dict[str, Any]:
  """The report of `workdirs` as JSON-ready data: settings, then per group its runs (each
  with its own overall and per-level summary on the group's tasks) and the pooled summary.

  Raises:
    ReportError: see `find_groups` and `read_run`; runs of a group on different
      environments, or sharing no task.
  """
  groups = []
  for label, dirs in find_groups(workdirs, eval_dir).items():
    runs = [read_run(d, split=split, before_step=before_step, after_step=after_step,
                     eval_dir=eval_dir) for d in dirs]
    envs = sorted({run.env for run in runs})
    if len(envs) > 1:
      raise ReportError(f"Group {label} mixes environments {envs}; report them separately.")
    shared = sorted(set.intersection(*(set(run.tasks) for run in runs)))
    if not shared:
      raise ReportError(f"Group {label}: no task was evaluated (healthy) at both steps in "
                        "every run; check the runs' eval reports.")
    groups.append({
        "name": label, "env": envs[0],
        "runs": [{"name": run.name, "workdir": run.workdir, "seed": run.seed,
                  "before_step": run.before_step, "after_step": run.after_step,
                  "before_from": run.before_from, "evaluated": list(run.num_evaluated),
                  "levels": _by_level([run], shared, resamples=resamples, seed=seed)}
                 for run in runs],
        "pooled": _by_level(runs, shared, resamples=resamples, seed=seed)})
  return {"settings": {"split": split, "eval_dir": eval_dir, "level": LEVEL,
                       "resamples": resamples, "seed": seed,
                       "interval": "percentile bootstrap over tasks and seeds, paired"},
          "groups": groups}


def _points(x: float) -> str:
  return f"{100 * x:.1f}"


def _change(s: dict[str, Any]) -> list[str]:
  return [_points(s["before"]), _points(s["after"]), f"{100 * s['change']:+.1f}",
          f"[{100 * s['low']:+.1f}, {100 * s['high']:+.1f}]"]


def _before(run: dict[str, Any]) -> str:
  """The before step, with the run it comes from when not this one (init_from)."""
  if not run.get("before_from"):
    return str(run["before_step"])
  return f"{os.path.basename(os.path.normpath(run['before_from']))}'s {run['before_step']}"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
  return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
          *("| " + " | ".join(str(x) for x in row) + " |" for row in rows)]


def markdown(report: dict[str, Any]) -> str:
  """The report's tables: per group, its runs and the pooled line, then the pooled levels."""
  settings = report["settings"]
  lines = ["# Held-out success before and after training", "",
           f"Success in % of tasks ({settings['split']} split); change in points, after - "
           f"before on the same tasks; {100 * settings['level']:.0f}% interval: "
           f"{settings['interval']} ({settings['resamples']} resamples, seed "
           f"{settings['seed']})."]
  for group in report["groups"]:
    pooled = group["pooled"][OVERALL]
    lines += ["", f"## {group['name']} ({group['env']}, {pooled['seeds']} run"
              f"{'s' * (pooled['seeds'] != 1)}, {pooled['tasks']} tasks)", ""]
    rows = [[run["name"], run["seed"], f"{_before(run)} -> {run['after_step']}",
             run["levels"][OVERALL]["tasks"], *_change(run["levels"][OVERALL])]
            for run in group["runs"]]
    rows.append(["**pooled**", "", "", pooled["tasks"], *_change(pooled)])
    lines += _table(["run", "seed", "steps", "tasks", "before", "after", "change",
                     "95% interval"], rows)
    levels = [(name, s) for name, s in group["pooled"].items() if name != OVERALL]
    if len(levels) > 1:
      lines += ["", "Per level, pooled:", ""]
      lines += _table(["level", "tasks", "before", "after", "change", "95% interval"],
                      [[name, s["tasks"], *_change(s)] for name, s in levels])
  return "\n".join(lines) + "\n"


def write(report: dict[str, Any], out: str) -> tuple[str, str]:
  """Writes out/report.md and out/report.json; returns their paths."""
  os.makedirs(out, exist_ok=True)
  md_path, json_path = os.path.join(out, "report.md"), os.path.join(out, "report.json")
  with open(md_path, "w") as f:
    f.write(markdown(report))
  with open(json_path, "w") as f:
    json.dump(report, f, indent=1)
  return md_path, json_path


# ----- command line ----------------------------------------------------------------------------

_OUT = flags.DEFINE_string("out", None, "Output directory (default: the first WORKDIR).")
_SPLIT = flags.DEFINE_string("split", "test", "The evaluated split whose reports are read.")
_BEFORE = flags.DEFINE_integer("before_step", None, "Step of 'before' (default: the first).")
_AFTER = flags.DEFINE_integer("after_step", None, "Step of 'after' (default: the last).")
_EVAL_DIR = flags.DEFINE_string(
    "eval_dir", EVAL_DIR, "Each run's sub-directory of step_<N>/ reports: the trainer's (eval), "
    "or where `python -m agentgym_jax.evaluate --output=WORKDIR/<eval_dir>/step_<N>` wrote.")
_RESAMPLES = flags.DEFINE_integer("resamples", 10_000, "Bootstrap resamples.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the bootstrap's draws.")


def main(argv: list[str]) -> None:
  if len(argv) < 2:
    cli.fatal("Usage: python -m agentgym_jax.report WORKDIR... [--out DIR]: give training "
              "workdirs or a sweep's base workdir.")
  try:
    report = build(argv[1:], split=_SPLIT.value, before_step=_BEFORE.value,
                   after_step=_AFTER.value, resamples=_RESAMPLES.value, seed=_SEED.value,
                   eval_dir=_EVAL_DIR.value)
  except ReportError as e:
    cli.fatal(str(e))
  md_path, json_path = write(report, _OUT.value or argv[1])
  sys.stdout.write(markdown(report))
  print(f"Wrote {md_path} and {json_path}.")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
