"""Episodes as JSON records and JSONL files: the one format evaluations, saved training steps,
replays and the viewer read.

A record is one episode (one row of a `Trajectory`, with the runner's `Episode` where there is
one): outcome fields, stop reason, category, the conversation as messages and as turns, and the
row's token segments with their text. Training adds its own fields to the same records
(train/trajectories.py); every file of them is written by `write_jsonl`.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from agentgym_jax.rollout.trajectory import Episode, Trajectory


def segments(traj: Trajectory, row: int) -> list[dict[str, Any]]:
  """Splits row `row` into maximal runs of one role: "prompt", "agent" or "observation".

  Each segment: {"role", "turn", "start", "tokens"} (start = index of its first token).
  """
  tokens = np.asarray(traj.tokens[row])
  n = int(np.asarray(traj.valid[row]).sum())
  mask = np.asarray(traj.loss_mask[row])
  turns = np.asarray(traj.turn_index[row])
  out: list[dict[str, Any]] = []
  for t in range(n):
    role = "prompt" if turns[t] < 0 else "agent" if mask[t] else "observation"
    if not out or out[-1]["role"] != role or out[-1]["turn"] != int(turns[t]):
      out.append({"role": role, "turn": int(turns[t]), "start": t, "tokens": []})
    out[-1]["tokens"].append(int(tokens[t]))
  return out


def episode_turns(episode: Episode) -> list[dict[str, Any]]:
  """Per agent turn: {"turn", "agent" (reply text), "action" (parsed), "observation" (the
  environment's answer), "reward" (that step's reward)}.

  Each turn added an assistant and a user message after the opening ones, so the turns are
  the last 2 * num_turns messages.
  """
  talk = episode.messages[len(episode.messages) - 2 * episode.num_turns:]
  if len(talk) != 2 * episode.num_turns:
    return []
  rewards = np.zeros(episode.num_turns)
  for turn, reward in zip(episode.turn_index, episode.turn_rewards):
    if 0 <= turn < episode.num_turns:
      rewards[turn] += reward
  return [{"turn": t, "agent": talk[2 * t]["content"],
           "action": episode.actions[t] if t < len(episode.actions) else None,
           "observation": talk[2 * t + 1]["content"], "reward": float(rewards[t])}
          for t in range(episode.num_turns)]


def episode_record(traj: Trajectory, row: int, decode, episode: Episode | None = None
                   ) -> dict[str, Any]:
  """Row `row` as a JSON-ready dict: outcome fields and token segments with their text; with
  the runner's `episode`, also its stop reason, category, messages and `episode_turns`."""
  record: dict[str, Any] = {
      "task_id": int(traj.task_id[row]), "group_id": int(traj.group_id[row]),
      "num_turns": int(traj.num_turns[row]), "success": bool(traj.success[row]),
      "score": float(traj.score[row]), "reward": float(np.asarray(traj.rewards[row]).sum()),
      "terminated": bool(traj.terminated[row]), "truncated": bool(traj.truncated[row]),
      "num_tokens": int(np.asarray(traj.valid[row]).sum()),
  }
  if episode is not None:
    record.update(stop_reason=episode.stop_reason, category=episode.category,
                  messages=episode.messages, turns=episode_turns(episode))
    if episode.failed:
      record["error"] = episode.error
    if episode.policy_versions:
      record["policy_versions"] = episode.policy_versions
  record["segments"] = [dict(seg, text=decode(seg["tokens"])) for seg in segments(traj, row)]
  return record


def write_jsonl(path: str, records: Iterable[dict[str, Any]], append: bool = False) -> None:
  """Writes one JSON line per record to `path`, appended to it when `append`.

  A rewrite goes to a temporary file in the same directory that then replaces `path`, so a
  crash never leaves a half-written file (and a resumed run's rewrite is whole too).
  """
  if append:
    with open(path, "a") as f:
      f.writelines(json.dumps(record) + "\n" for record in records)
    return
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".",
                             prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "w") as f:
      f.writelines(json.dumps(record) + "\n" for record in records)
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


def save_jsonl(path: str, traj: Trajectory, decode, episodes: Sequence[Episode] | None = None,
               append: bool = False) -> None:
  """Writes the `episode_record` of every row of `traj` to `path` (`write_jsonl`).

  Args:
    path: output file (rewritten, or extended when `append`).
    traj: the batch.
    decode: ids -> text (e.g. `ChatTokenizer.decode`).
    episodes: the runner's host records, adding the stop reason and the conversation as
      messages and turns (incl. the final observation, which is not part of the token
      sequence).
  """
  write_jsonl(path, (episode_record(traj, row, decode,
                                    episodes[row] if episodes is not None else None)
                     for row in range(traj.batch_size)), append)
