"""Training metrics: per-batch statistics and the writers (JSONL, TensorBoard, run info).

Every metric of a step is one line of `workdir/metrics.jsonl` ({"step": s, name: value, ...})
and one scalar per name in TensorBoard (`workdir/tb`). A resumed run first drops the lines of
steps after its checkpoint (written by the run that crashed), so the file reads as one run.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import platform
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from agentgym_jax.rollout.envs import FAILURES

METRICS_FILE = "metrics.jsonl"


# Why an episode ended (`Episode.stop_reason`), each reported as the fraction of a batch: the
# environment's or the runner's rules, then the faults that fail an episode.
STOP_REASONS = ("terminated", "env_truncated", "max_turns", "context", *FAILURES)


def episode_metrics(traj: Any, episodes: Sequence[Any]) -> dict[str, float]:
  """Outcome, length and stop-reason statistics of a batch: the one place they are computed.

  Failed episodes are counted (`failed_rate`, `stop_<fault>`) but left out of the outcome and
  length statistics: they say how the infrastructure did, not the policy.

  Args:
    traj: the batch's Trajectory, fields as host arrays.
    episodes: its Episodes (rows in order), for their stop reasons.
  Returns:
    episodes/: count (the episodes of the batch: all of it, on several hosts too),
    failed_rate, stop_<reason> for each of STOP_REASONS; over the healthy episodes (0 when
    there is none): success_rate, reward_mean (Σ token rewards per row), score_mean (raw),
    turns_mean, reply_tokens_mean (sampled tokens per agent turn), invalid_action_rate (turns
    whose action the environment refused, per turn), length_mean (tokens per episode),
    truncated_rate, terminated_rate; batch/length (padded L).
  """
  healthy = ~np.asarray(traj.failed)
  loss_mask = np.asarray(traj.loss_mask)
  turns = np.asarray(traj.num_turns)
  reasons = collections.Counter(e.stop_reason for e in episodes)
  stops = {f"episodes/stop_{r}": reasons[r] / max(len(episodes), 1) for r in STOP_REASONS}
  invalid = np.asarray([e.invalid_actions for e in episodes])

  def mean(x) -> float:
    return float(np.mean(np.asarray(x)[healthy])) if healthy.any() else 0.0

  return stops | {
      "episodes/count": float(turns.size),
      "episodes/failed_rate": float(1.0 - np.mean(healthy)),
      "episodes/success_rate": mean(traj.success),
      "episodes/reward_mean": mean(np.sum(traj.rewards, axis=1)),
      "episodes/score_mean": mean(traj.score),
      "episodes/turns_mean": mean(turns),
      "episodes/reply_tokens_mean": float(loss_mask.sum() / max(turns[healthy].sum(), 1)),
      "episodes/invalid_action_rate": float(invalid[healthy].sum() / max(turns[healthy].sum(), 1)),
      "episodes/length_mean": mean(np.sum(traj.valid, axis=1)),
      "episodes/truncated_rate": mean(traj.truncated),
      "episodes/terminated_rate": mean(traj.terminated),
      "batch/length": float(loss_mask.shape[1]),
  }


# Of a batch's episode statistics, those a mixture logs per environment too.
ENVIRONMENT_METRICS = ("count", "failed_rate", "success_rate", "reward_mean", "score_mean",
                       "turns_mean", "length_mean", "invalid_action_rate", "truncated_rate")


def environment_metrics(traj: Any, episodes: Sequence[Any],
                        environment_of: Callable[[int], str]) -> dict[str, float]:
  """`episode_metrics`' ENVIRONMENT_METRICS over each environment's rows of a mixed batch:
  episodes/<environment>/<metric>, for each environment the batch holds (a group's rows are
  all of one environment, so these are its groups). `environment_of` names a task id's."""
  labels = np.asarray([environment_of(e.task_id) for e in episodes])
  out = {}
  for label in sorted(set(labels.tolist())):
    rows = labels == label
    stats = episode_metrics(jax.tree.map(lambda x: np.asarray(x)[rows], traj),
                            [e for e, keep in zip(episodes, rows) if keep])
    out.update({f"episodes/{label}/{k}": stats[f"episodes/{k}"] for k in ENVIRONMENT_METRICS})
  return out


def failure_summary(episodes: Sequence[Any]) -> tuple[str, int, str] | None:
  """The fault seen most among `episodes`: (kind, how many episodes, one description of it),
  or None when none failed."""
  failed = [e for e in episodes if e.failed]
  if not failed:
    return None
  kind, count = collections.Counter(e.stop_reason for e in failed).most_common(1)[0]
  return kind, count, next(e.error for e in failed if e.stop_reason == kind)


def explained_variance(returns: np.ndarray, values: np.ndarray, mask: np.ndarray) -> float:
  """1 - Var(R - V) / Var(R) over agent tokens: 1 is a perfect critic, <= 0 a useless one."""
  mask = mask.astype(bool)
  r, v = returns[mask], values[mask]
  var = np.var(r)
  return float(1.0 - np.var(r - v) / var) if var > 0 else 0.0


def git_commit() -> str | None:
  """The commit of the checkout this package runs from, or None outside a git checkout."""
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                         timeout=10, check=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                           capture_output=True, text=True, timeout=10, check=True)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def write_run_info(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Writes config.json and run_info.json (git commit, versions, devices) into `workdir`."""
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  info = {
      "git_commit": git_commit(),
      "started": time.strftime("%Y-%m-%d %H:%M:%S"),
      "host": platform.node(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "devices": jax.device_count(),
      "processes": jax.process_count(),
  }
  with open(os.path.join(workdir, "run_info.json"), "w") as f:
    json.dump(info, f, indent=2)


class MetricWriter:
  """Appends metrics to workdir/metrics.jsonl and TensorBoard.

  Args:
    workdir: the run's directory.
    resume_step: the step the run restarts from; logged lines of later steps are removed.
  """

  def __init__(self, workdir: str, resume_step: int = 0):
    self.path = os.path.join(workdir, METRICS_FILE)
    if os.path.exists(self.path):
      with open(self.path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= resume_step]
      with open(self.path, "w") as f:
        f.writelines(kept)
    # Imported here: tensorboardX imports torch when it is installed (seconds at start-up),
    # and only the process that writes metrics needs it.
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    self._tb = SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, step: int, metrics: Mapping[str, float]) -> None:
    """Records the scalars of `step` (logged as the number of steps completed)."""
    clean = {k: float(v) for k, v in sorted(metrics.items())}
    with open(self.path, "a") as f:
      f.write(json.dumps({"step": int(step), **clean}) + "\n")
    for name, value in clean.items():
      self._tb.add_scalar(name, value, int(step))
    self._tb.flush()

  def close(self) -> None:
    self._tb.close()


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The lines of workdir/metrics.jsonl as dicts (tests, notebooks)."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    logging.warning("No metrics file at %s.", path)
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
