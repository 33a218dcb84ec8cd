"""An evaluation's report: `eval_<split>.json` (settings, metrics, per-task results) and
`eval_<split>.md` (what ran and a table shaped like the paper's: one row per metric, one column
per category), and the line that ends an evaluation on the terminal.

A table prints fractions as the paper's percentages; a metric with no healthy episode to
measure prints "-".
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
import json
import os

from agentgym_jax.evaluate import eval_metrics
from agentgym_jax.evaluate.evaluation import EvalResult


def checkpoint_label(workdir: str, step: int) -> str:
  """The table's row label for a training run's policy after `step` steps."""
  return f"{os.path.basename(workdir.rstrip('/'))} step {step}"


def write_report(result: EvalResult, output_dir: str, label: str, split: str
                 ) -> tuple[str, str]:
  """Writes eval_<split>.json and eval_<split>.md into `output_dir`; returns their paths.

  The markdown holds what the run was and its table, nothing that varies between two runs of
  the same evaluation (the JSON adds the seconds it took).
  """
  os.makedirs(output_dir, exist_ok=True)
  per_task = {}
  for i, task_id in enumerate(result.task_ids):
    row = per_task.setdefault(task_id, {
        "task_id": task_id, "category": result.categories.get(task_id), "rewards": [],
        "scores": [], "success": [], "num_turns": [], "stop_reasons": [], "failed": []})
    row["rewards"].append(float(result.rewards[i]))
    row["scores"].append(float(result.scores[i]))
    row["success"].append(bool(result.success[i]))
    row["num_turns"].append(int(result.num_turns[i]))
    row["stop_reasons"].append(result.stop_reasons[i])
    row["failed"].append(bool(result.failed[i]))
  report = {"label": label, "split": split, "settings": result.settings,
            "seconds": round(result.seconds, 1), "metrics": result.summary,
            "tasks": list(per_task.values())}
  json_path = os.path.join(output_dir, f"eval_{split}.json")
  with open(json_path, "w") as f:
    json.dump(report, f, indent=1)

  n = result.summary[eval_metrics.OVERALL]["n"]
  # Pass@k rows, except k = n: that one is the Pass@n row.
  metrics = ["pass", "avg"] + [k for k in result.summary[eval_metrics.OVERALL]
                               if k.startswith("pass@") and k != f"pass@{n}"]
  rows = summary_rows(label, result.summary, metrics)
  columns = list(result.summary)
  settings = result.settings
  lines = [f"# {label}: {settings['env']} {split}", "",
           ", ".join(f"{k}={v}" for k, v in settings.items()), "",
           markdown_table(rows, columns),
           f"Pass@n: % of tasks with a passing sample ({settings['pass_criterion']}). "
           "Avg@n: mean final reward x 100. Tasks per column: "
           + ", ".join(f"{c} {int(m['num_tasks'])}" for c, m in result.summary.items()) + ".",
           "", failed_line(result)]
  md_path = os.path.join(output_dir, f"eval_{split}.md")
  with open(md_path, "w") as f:
    f.write("\n".join(lines) + "\n")
  return json_path, md_path


def markdown_table(
    rows: Sequence[tuple[str, Mapping[str, float]]],
    columns: Sequence[str],
    first_header: str = "Model",
    scale: float = 100.0,
    digits: int = 2,
) -> str:
  """A markdown table shaped like the paper's: one row per model, one column per category.

  Args:
    rows: (row label, {column: value}) pairs; a missing value prints as "-".
    columns: column names in order (e.g. categories then "Overall").
    first_header: header of the label column.
    scale: multiplies every value (100 turns fractions into the paper's percentages).
    digits: decimals printed.
  """
  header = [first_header, *columns]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for label, values in rows:
    cells = [label]
    for column in columns:
      value = values.get(column)
      cells.append("-" if value is None else f"{value * scale:.{digits}f}")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def summary_rows(
    label: str, summary: Mapping[str, Mapping[str, float]], metrics: Sequence[str] = ("pass", "avg")
) -> list[tuple[str, dict[str, float]]]:
  """Table rows for one `summarize` result: one row per metric, labelled e.g. "model Pass@n"."""
  names = {"pass": "Pass@{n}", "avg": "Avg@{n}"}
  n = summary[eval_metrics.OVERALL]["n"]
  rows = []
  for metric in metrics:
    name = names.get(metric, metric.capitalize()).format(n=n)
    rows.append((f"{label} ({name})", {column: m[metric] for column, m in summary.items()}))
  return rows


def failed_line(result: EvalResult) -> str:
  """The table's footer on failed episodes: how many, of which fault, left out of the table."""
  count = int(result.failed.sum())
  if not count:
    return f"Failed episodes: none of {result.failed.size}."
  kinds = collections.Counter(r for r, f in zip(result.stop_reasons, result.failed) if f)
  return (f"Failed episodes: {count} of {result.failed.size} ("
          + ", ".join(f"{kind} {n}" for kind, n in kinds.most_common())
          + "), left out of Avg@n and Pass@n (see the episodes' stop reasons and errors).")


def result_line(result: EvalResult, label: str, split: str, output: str) -> str:
  """The one line that ends an evaluation: the overall numbers and where the files are."""
  overall = result.summary[eval_metrics.OVERALL]
  n = overall["n"]
  settings = result.settings
  # None: every episode failed, so there is nothing to measure (see `failed_line`).
  percent = lambda value: "-" if value is None else f"{100 * value:.2f}"
  return (f"{label} on {settings['env']} {split}: "
          f"Pass@{n} {percent(overall['pass'])}, Avg@{n} {percent(overall['avg'])}, "
          f"success {'-' if result.success_rate is None else f'{result.success_rate:.3f}'} "
          "per episode "
          f"({settings['num_tasks']} tasks x {n}, {int(result.failed.sum())} episodes failed, "
          f"{result.seconds:.0f} s); "
          f"report and episodes in {output}")
