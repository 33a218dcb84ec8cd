"""Evaluation metrics: Avg@n, Pass@n and Pass@k per task category, and paper-style tables.

Pure NumPy, no JAX: the evaluation driver (`agentgym_jax.evaluate`) feeds it one score per
episode; everything here is testable with hand-computed numbers.

Definitions follow AgentGym-RL's `main_generation` eval, for `n` samples of each of `T` tasks:
  Avg@n  = mean over all T*n episodes of the final score.
  Pass@n = fraction of tasks where at least one of the n samples passed (upstream: score > 0).
  Pass@k = the unbiased estimate (Chen et al., 2021) of Pass@k for k <= n, averaged over tasks;
           Pass@k with k == n equals Pass@n.
The paper's tables report percentages per category plus an "Overall" column computed over all
tasks (not the mean of the category columns); `summarize` does the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import math
from typing import Any

import numpy as np

OVERALL = "Overall"


def avg_at_n(scores: np.ndarray) -> float:
  """Mean final score over all episodes. scores: [T, n] -> scalar."""
  scores = _as_task_matrix(scores, "scores")
  return float(scores.mean())


def pass_at_n(passed: np.ndarray) -> float:
  """Fraction of tasks with at least one passing sample. passed: [T, n] bool -> scalar."""
  passed = _as_task_matrix(passed, "passed").astype(bool)
  return float(passed.any(axis=1).mean())


def pass_at_k(passed: np.ndarray, k: int) -> float:
  """Unbiased Pass@k from n >= k samples per task, averaged over tasks.

  Per task with c passing samples out of n: 1 - C(n - c, k) / C(n, k), the probability that a
  random size-k subset of the n samples contains a pass.

  Args:
    passed: [T, n] bool.
    k: subset size, 1 <= k <= n.
  """
  passed = _as_task_matrix(passed, "passed").astype(bool)
  n = passed.shape[1]
  if not 1 <= k <= n:
    raise ValueError(f"pass_at_k needs 1 <= k <= n = {n} samples per task, got k={k}.")
  per_task = [1.0 - math.comb(n - int(c), k) / math.comb(n, k) for c in passed.sum(axis=1)]
  return float(np.mean(per_task))


def passed_from(scores: np.ndarray, success: np.ndarray | None, criterion: str) -> np.ndarray:
  """Per-episode pass flags under `criterion`.

  "score>0" is the upstream rule (a SciWorld episode with partial progress passes; the paper's
  tables appear to use it). "success" uses the environment's own success flag.

  Args:
    scores: [...] final raw scores.
    success: [...] bool, same shape, or None when criterion is "score>0".
    criterion: "score>0" | "success".
  """
  if criterion == "score>0":
    return np.asarray(scores) > 0
  if criterion == "success":
    if success is None:
      raise ValueError("criterion 'success' needs the per-episode success flags.")
    return np.asarray(success, dtype=bool)
  raise ValueError(f"Unknown pass criterion {criterion!r}; use 'score>0' or 'success'.")


def to_task_matrix(task_ids: Sequence[int], values: Sequence[Any]) -> tuple[list[int], np.ndarray]:
  """Groups per-episode values by task: [E] -> (task ids [T] in first-seen order, [T, n]).

  Every task must have the same number of samples n (the evaluation samples each task n times).
  """
  task_ids = [int(t) for t in task_ids]
  values = np.asarray(values)
  if values.shape[0] != len(task_ids):
    raise ValueError(f"{len(task_ids)} task ids but {values.shape[0]} values.")
  rows: dict[int, list[Any]] = {}
  for task_id, value in zip(task_ids, values):
    rows.setdefault(task_id, []).append(value)
  counts = {len(v) for v in rows.values()}
  if len(counts) > 1:
    raise ValueError(f"Tasks have different sample counts {sorted(counts)}; every task needs "
                     "the same number n of episodes.")
  order = list(rows)
  return order, np.asarray([rows[t] for t in order])


def summarize(
    task_ids: Sequence[int],
    scores: Sequence[float],
    passed: Sequence[bool],
    categories: Mapping[int, str] | None = None,
    category_order: Sequence[str] = (),
    ks: Sequence[int] = (1,),
) -> dict[str, dict[str, float]]:
  """Metrics per category and overall from one score per episode.

  Args:
    task_ids: [E] task id of each episode (n episodes per task, any order).
    scores: [E] final score of each episode (any scale; reported as given).
    passed: [E] bool pass flag of each episode (see `passed_from`).
    categories: task id -> category name; tasks missing from it (or None) go to "other".
    category_order: the column order to report (the paper's); categories seen but not listed
      follow in sorted order, listed ones that were not seen are dropped.
    ks: the k values of the Pass@k estimates to add (each must be <= n).

  Returns:
    {category: {"avg": Avg@n, "pass": Pass@n, "pass@k": ..., "num_tasks": T_c, "n": n}} in
    column order, ending with "Overall" over all tasks.
  """
  order, score_matrix = to_task_matrix(task_ids, scores)
  _, pass_matrix = to_task_matrix(task_ids, passed)
  categories = categories or {}
  labels = [categories.get(t) or "other" for t in order]
  seen = set(labels)
  columns = [c for c in category_order if c in seen]
  columns += sorted(seen - set(columns))
  if len(columns) == 1 and columns[0] == "other":
    columns = []  # no categories known: the Overall column says it all.
  result = {}
  for column in columns + [OVERALL]:
    rows = np.array([column == OVERALL or label == column for label in labels])
    result[column] = _metrics(score_matrix[rows], pass_matrix[rows], ks)
  return result


def _metrics(scores: np.ndarray, passed: np.ndarray, ks: Sequence[int]) -> dict[str, float]:
  metrics = {"avg": avg_at_n(scores), "pass": pass_at_n(passed)}
  for k in ks:
    metrics[f"pass@{k}"] = pass_at_k(passed, k)
  metrics["num_tasks"] = int(scores.shape[0])
  metrics["n"] = int(scores.shape[1])
  return metrics


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
  n = summary[OVERALL]["n"]
  rows = []
  for metric in metrics:
    name = names.get(metric, metric.capitalize()).format(n=n)
    rows.append((f"{label} ({name})", {column: m[metric] for column, m in summary.items()}))
  return rows


def _as_task_matrix(array: Any, name: str) -> np.ndarray:
  array = np.asarray(array)
  if array.ndim != 2 or array.shape[0] == 0 or array.shape[1] == 0:
    raise ValueError(f"{name} must be a non-empty [tasks, samples] array, got shape "
                     f"{array.shape}; use to_task_matrix to group per-episode values.")
  return array
