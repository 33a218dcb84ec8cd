"""Saved training trajectories: a sample of a step's episodes, per turn and per token.

`save_step` writes `workdir/trajectories/step_N.jsonl` (N = steps completed), one line per
episode: the fields of `rollout.records.episode_record` (outcome, stop reason, category,
turns with reply, parsed action, observation and reward; token segments with their text)
plus "step", "replay" (`provenance.episode_provenance`: what `python -m agentgym_jax.replay`
needs to regenerate the episode; absent for behaviour cloning, which samples nothing), and on
every agent segment, per token: "pieces" (its text), "logprobs" (the
sampler's), "advantages" and, with a critic, "values". Each segment also states its
"loss_mask" (segments split where it changes: 1 on agent segments, 0 elsewhere).
`python -m agentgym_jax.viewer WORKDIR` renders these files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from agentgym_jax.rollout import records as records_lib
from agentgym_jax.rollout.trajectory import Episode, Trajectory
from agentgym_jax.train import provenance

TRAJECTORY_DIR = "trajectories"


def step_path(workdir: str, step: int) -> str:
  return os.path.join(workdir, TRAJECTORY_DIR, f"step_{step}.jsonl")


def step_records(step: int, traj: Trajectory, episodes: Sequence[Episode], decode,
                 num_episodes: int, advantages: np.ndarray | None = None,
                 values: np.ndarray | None = None, replay: dict[str, Any] | None = None
                 ) -> list[dict[str, Any]]:
  """The records of the first `num_episodes` rows of a step's batch.

  The first rows are whole groups of the step's first tasks, which the task stream drew at
  random: a fair sample that keeps the n samples of a task (and their group-relative
  advantages) side by side.

  Args:
    step: steps completed.
    traj: the batch as host arrays, [B, L].
    episodes: the B runner records.
    decode: ids -> text.
    num_episodes: rows to keep (all if B is smaller).
    advantages, values: [B, L] host arrays (None: not recorded).
    replay: the step's `provenance.step_provenance` (None: not recorded).
  """
  records = []
  for row in range(min(num_episodes, traj.batch_size)):
    record = {"step": step, **records_lib.episode_record(traj, row, decode, episodes[row])}
    if replay is not None:
      record["replay"] = provenance.episode_provenance(replay, traj, row)
    for seg in record["segments"]:
      seg["loss_mask"] = int(seg["role"] == "agent")
      if not seg["loss_mask"]:
        continue
      cols = slice(seg["start"], seg["start"] + len(seg["tokens"]))
      seg["pieces"] = [decode([t]) for t in seg["tokens"]]
      for name, array in (("logprobs", traj.sample_logprobs), ("advantages", advantages),
                          ("values", values)):
        if array is not None:
          seg[name] = [round(float(x), 4) for x in np.asarray(array)[row, cols]]
    records.append(record)
  return records


def save_step(workdir: str, step: int, traj: Trajectory, episodes: Sequence[Episode], decode,
              num_episodes: int, advantages: np.ndarray | None = None,
              values: np.ndarray | None = None, replay: dict[str, Any] | None = None) -> str:
  """Writes `step_records(...)` to `step_path(workdir, step)`, whole or not at all
  (`records.write_jsonl`); returns the path."""
  path = step_path(workdir, step)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  records_lib.write_jsonl(path, step_records(step, traj, episodes, decode, num_episodes,
                                             advantages, values, replay))
  return path
