"""Evaluation metrics: Avg@n, Pass@n and Pass@k per task category.

Pure NumPy, no JAX: the evaluation (`evaluate.evaluation`) feeds it one score per episode;
everything here is testable with hand-computed numbers; `evaluate.report` prints them.

Definitions follow AgentGym-RL's `main_generation` eval, for `n` samples of each of `T` tasks:
  Avg@n  = mean over all T*n episodes of the final score.
  Pass@n = fraction of tasks where at least one of the n samples passed (upstream: score > 0).
  Pass@k = the unbiased estimate (Chen et al., 2021) of Pass@k for k <= n, averaged over tasks;
           Pass@k with k == n equals Pass@n.
The paper's tables report percentages per category plus an "Overall" column computed over all
tasks (not the mean of the category columns); `summarize` does the same.

Failed episodes (an env worker crashed or hung, the env server answered an error) are no
measurement of the policy: given a `healthy` mask, every metric is computed over the healthy
episodes only (Avg@n over them, Pass@n over the tasks with at least one, Pass@k over the tasks
with at least k, from their c of n_t), and `summarize` counts the failed ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import math
from typing import Any

import numpy as np

OVERALL = "Overall"


def avg_at_n(scores: np.ndarray, healthy: np.ndarray | None = None) -> float:
  """Mean final score over the (healthy) episodes. scores, healthy: [T, n] -> scalar."""
  scores = _as_task_matrix(scores, "scores")
  healthy = _healthy(healthy, scores)
  return float(scores[healthy].mean())


def pass_at_n(passed: np.ndarray, healthy: np.ndarray | None = None) -> float:
  """Fraction of tasks with at least one passing sample, over the tasks with a healthy one.
  passed, healthy: [T, n] bool -> scalar."""
  passed = _as_task_matrix(passed, "passed").astype(bool)
  healthy = _healthy(healthy, passed)
  scored = healthy.any(axis=1)
  return float((passed & healthy).any(axis=1)[scored].mean())


def pass_at_k(passed: np.ndarray, k: int, healthy: np.ndarray | None = None) -> float:
  """Unbiased Pass@k from n >= k samples per task, averaged over tasks.

  Per task with c passing samples out of n: 1 - C(n - c, k) / C(n, k), the probability that a
  random size-k subset of the n samples contains a pass. With `healthy`, n and c count a
  task's healthy samples, and tasks with fewer than k of them are left out.

  Args:
    passed: [T, n] bool.
    k: subset size, 1 <= k <= n.
    healthy: [T, n] bool, default all.
  """
  passed = _as_task_matrix(passed, "passed").astype(bool)
  healthy = _healthy(healthy, passed)
  n = passed.shape[1]
  if not 1 <= k <= n:
    raise ValueError(f"pass_at_k needs 1 <= k <= n = {n} samples per task, got k={k}.")
  per_task = [1.0 - math.comb(int(m) - int(c), k) / math.comb(int(m), k)
              for m, c in zip(healthy.sum(axis=1), (passed & healthy).sum(axis=1)) if m >= k]
  return float(np.mean(per_task)) if per_task else float("nan")


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
    failed: Sequence[bool] | None = None,
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
    failed: [E] bool, the episodes that failed (left out of every metric); default none.

  Returns:
    {category: {"avg": Avg@n, "pass": Pass@n, "pass@k": ..., "num_tasks": T_c, "n": n,
    "failed": failed episodes}} in column order, ending with "Overall" over all tasks. A
    column whose episodes all failed has metrics None (no measurement), not 0.
  """
  order, score_matrix = to_task_matrix(task_ids, scores)
  _, pass_matrix = to_task_matrix(task_ids, passed)
  failed = np.zeros(len(task_ids), bool) if failed is None else np.asarray(failed, bool)
  _, healthy_matrix = to_task_matrix(task_ids, ~failed)
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
    result[column] = _metrics(score_matrix[rows], pass_matrix[rows], healthy_matrix[rows], ks)
  return result


def _metrics(scores: np.ndarray, passed: np.ndarray, healthy: np.ndarray, ks: Sequence[int]
             ) -> dict[str, float | None]:
  metrics: dict[str, float | None] = {"avg": None, "pass": None}
  metrics.update({f"pass@{k}": None for k in ks})
  if healthy.any():
    metrics["avg"] = avg_at_n(scores, healthy)
    metrics["pass"] = pass_at_n(passed, healthy)
    for k in ks:
      estimate = pass_at_k(passed, k, healthy)
      metrics[f"pass@{k}"] = None if math.isnan(estimate) else estimate
  metrics["num_tasks"] = int(scores.shape[0])
  metrics["n"] = int(scores.shape[1])
  metrics["failed"] = int((~healthy).sum())
  return metrics


def _healthy(healthy: np.ndarray | None, like: np.ndarray) -> np.ndarray:
  """The [T, n] healthy mask (default all), which must leave some episode to measure."""
  healthy = np.ones(like.shape, bool) if healthy is None else np.asarray(healthy, bool)
  if healthy.shape != like.shape or not healthy.any():
    raise ValueError(f"healthy must be a [tasks, samples] mask of shape {like.shape} with at "
                     f"least one healthy episode, got shape {healthy.shape}.")
  return healthy


def _as_task_matrix(array: Any, name: str) -> np.ndarray:
  array = np.asarray(array)
  if array.ndim != 2 or array.shape[0] == 0 or array.shape[1] == 0:
    raise ValueError(f"{name} must be a non-empty [tasks, samples] array, got shape "
                     f"{array.shape}; use to_task_matrix to group per-episode values.")
  return array
