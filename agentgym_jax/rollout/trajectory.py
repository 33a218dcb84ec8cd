"""The `Trajectory` batch: finished episodes as right-padded token arrays.

One row per episode holds the whole interaction as ONE token sequence: the opening prompt, then
for each turn the agent's sampled tokens (ending in its end-of-turn token) and the observation
chunk that follows. The arrays are what the trainer consumes; lengths are bucketed
(`bucket_length`) so the jitted update compiles for a few static shapes only. With a history
window the model saw less than the whole row at each turn; rollout/window.py cuts the row into
the per-turn rows the update then trains. rollout/records.py writes the episodes as JSON.

A failed episode (its environment worker crashed or hung, its reset failed, the environment or
env server raised) says nothing about the policy: its row is marked with the kind of fault
(`failure`) and its loss mask is all 0, so it trains nothing and, having no agent token, stays
out of its group's statistics (rl/advantages.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import struct

from agentgym_jax.rollout.envs import FAILURES


@struct.dataclass
class Trajectory:
  """A batch of B finished episodes, right-padded to L tokens.

  Per token, [B, L]:
    tokens: int32 ids (pad id past the end).
    positions: int32 position of each token (t; the model's forward uses the same).
    valid: bool, not padding.
    loss_mask: bool, tokens the policy sampled, incl. each turn's end-of-turn token; all 0 in
      the row of a failed episode.
    sample_logprobs: float32 log-prob of each sampled token under the sampler's temperature-
      scaled full softmax (0 where loss_mask is 0).
    rewards: float32 outcome reward on the episode's last agent token (the last position with
      loss_mask 1), 0 elsewhere.
    turn_rewards: float32 what each environment step added to the episode's reward, on the last
      sampled token of the turn that took it, 0 elsewhere. An environment reports the
      episode's reward so far at every step (the last one is the outcome), so these are its
      increments (SciWorld's score deltas) and sum to the outcome.
    turn_index: int32 agent turn of each token: -1 for the opening prompt, t for the turn-t
      reply and the observation that answers it.
  Per turn, [B, T] (T: the batch's most turns, bucketed):
    turn_anchors: int32 id of the state turn t acted from (`anchor_id`: equal ids, same
      state), -1 past the episode's last turn. Turn-level estimators group turns by it.
  Per episode, [B]:
    task_id, group_id (shared by the n samples of one task), num_turns: int32.
    success, terminated, truncated: bool. score: float32 (the environment's raw score).
    failure: int32, 0 for a healthy episode, else 1 + the index in FAILURES of its fault.
  """

  tokens: jax.Array
  positions: jax.Array
  valid: jax.Array
  loss_mask: jax.Array
  sample_logprobs: jax.Array
  rewards: jax.Array
  turn_rewards: jax.Array
  turn_index: jax.Array
  turn_anchors: jax.Array
  task_id: jax.Array
  group_id: jax.Array
  num_turns: jax.Array
  success: jax.Array
  score: jax.Array
  terminated: jax.Array
  truncated: jax.Array
  failure: jax.Array

  @property
  def failed(self) -> jax.Array:
    """[B] bool: the episodes that ended on a fault of the infrastructure."""
    return self.failure > 0

  @property
  def batch_size(self) -> int:
    return self.tokens.shape[0]


@dataclasses.dataclass
class Episode:
  """Host-side record of one episode while it runs (lists grow turn by turn).

  `messages` is the conversation as text (for inspection); `actions` the environment's parse
  of each turn's reply (None where not recorded); `anchors[t]` the `anchor_id` of the state
  turn t acted from (empty where not recorded); `category` the task's reset
  `info["category"]`; `stop_reason` is one of "terminated", "env_truncated", "max_turns",
  "context", or for a failed episode the kind of fault (one of FAILURES), whose description is
  `error` (e.g. "env worker 0 (pid 7) was replaced: it died during step (killed by SIGKILL)").
  """

  task_id: int
  group_id: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[bool] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  turn_index: list[int] = dataclasses.field(default_factory=list)
  turn_rewards: list[float] = dataclasses.field(default_factory=list)
  messages: list[dict[str, str]] = dataclasses.field(default_factory=list)
  actions: list[str | None] = dataclasses.field(default_factory=list)
  anchors: list[int] = dataclasses.field(default_factory=list)
  category: str | None = None
  num_turns: int = 0
  invalid_actions: int = 0  # turns whose action the environment refused (info["invalid_action"])
  reward: float = 0.0
  success: bool = False
  score: float = 0.0
  terminated: bool = False
  truncated: bool = False
  stop_reason: str = ""
  error: str = ""
  # The policy version (updates its weights had) that sampled each turn's reply: one per turn,
  # all equal unless the rollout took newer weights mid-episode (`run_episodes`' `weights`).
  policy_versions: list[int] = dataclasses.field(default_factory=list)

  @property
  def failed(self) -> bool:
    return self.stop_reason in FAILURES

  def append(self, ids: Sequence[int], turn: int, logprobs: Sequence[float] | None = None
             ) -> None:
    """Adds tokens; with `logprobs` they are sampled tokens (loss_mask 1)."""
    self.tokens.extend(int(i) for i in ids)
    self.turn_index.extend([turn] * len(ids))
    self.turn_rewards.extend([0.0] * len(ids))
    if logprobs is None:
      self.loss_mask.extend([False] * len(ids))
      self.logprobs.extend([0.0] * len(ids))
    else:
      self.loss_mask.extend([True] * len(ids))
      self.logprobs.extend(float(x) for x in logprobs)

  def finish(self, reason: str, terminated: bool = False, truncated: bool = False) -> None:
    self.stop_reason = reason
    self.terminated = terminated
    self.truncated = truncated

  def record_step(self, reward: float, info: dict[str, Any],
                  invalid_action_reward: float = 0.0) -> None:
    """Books an environment step's outcome on the turn just sampled.

    `reward` is the episode's reward so far (the environment contract); the turn's own reward
    is what it added, plus `invalid_action_reward` if the environment refused the turn's
    action (`info["invalid_action"]`). Success and score stay the environment's.
    """
    self.num_turns += 1
    self.invalid_actions += bool(info.get("invalid_action", False))
    total = float(reward) + invalid_action_reward * self.invalid_actions
    self.turn_rewards[-1] = total - self.reward
    self.reward = total
    self.success = bool(info.get("success", False))
    self.score = float(info.get("score", reward))

  def fail(self, info: dict[str, Any]) -> None:
    """Ends the episode on the fault a failed outcome's `info` describes."""
    failure = info.get("failure")
    # A pool that does not name the kind (an older or a custom one) reports the environment.
    self.finish(failure if failure in FAILURES else "env_error", terminated=True)
    self.error = str(info["error"])


def anchor_id(observation: str, info: dict[str, Any]) -> int:
  """A state's id for turn-level credit: the environment's `info["state_key"]` where it gives
  one, else the observation text, hashed to 31 bits (stable across processes, unlike
  `hash`; a collision merges two states' groups, about 1 in 2^31 per pair)."""
  key = str(info.get("state_key", observation))
  return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little") >> 1


def bucket_length(n: int, minimum: int = 64) -> int:
  """Smallest size >= n of the form 2^k or 3 * 2^(k-1) from `minimum` (a power of two) on:
  64, 96, 128, 192, 256, ... by default.

  Padding waste stays under a third while a run sees only a few distinct lengths (trajectory
  lengths for the update, chunk lengths for the sampler's extend).
  """
  size = minimum
  while True:
    if size >= n:
      return size
    if size * 3 // 2 >= n:
      return size * 3 // 2
    size *= 2


def build_trajectory(episodes: Sequence[Episode], pad_id: int, length: int | None = None
                     ) -> Trajectory:
  """Packs finished episodes into a Trajectory of length `length` (default: bucketed max).

  Raises:
    ValueError: an episode is longer than `length`.
  """
  longest = max((len(e.tokens) for e in episodes), default=0)
  length = bucket_length(longest) if length is None else length
  if longest > length:
    raise ValueError(f"An episode has {longest} tokens but the trajectory length is {length}.")
  b = len(episodes)
  tokens = np.full((b, length), pad_id, np.int32)
  valid = np.zeros((b, length), bool)
  loss_mask = np.zeros((b, length), bool)
  logprobs = np.zeros((b, length), np.float32)
  rewards = np.zeros((b, length), np.float32)
  turn_rewards = np.zeros((b, length), np.float32)
  turn_index = np.full((b, length), -1, np.int32)
  turn_anchors = np.full((b, bucket_length(max((e.num_turns for e in episodes), default=1),
                                           minimum=8)), -1, np.int32)
  for row, e in enumerate(episodes):
    n = len(e.tokens)
    tokens[row, :n] = e.tokens
    valid[row, :n] = True
    loss_mask[row, :n] = e.loss_mask
    logprobs[row, :n] = e.logprobs
    turn_rewards[row, :n] = e.turn_rewards
    turn_index[row, :n] = e.turn_index
    turn_anchors[row, :len(e.anchors)] = e.anchors
    if e.failed:
      loss_mask[row] = False  # an infrastructure fault is not the policy's doing
    agent = np.flatnonzero(loss_mask[row])
    if agent.size:
      rewards[row, agent[-1]] = e.reward
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy()

  def per_episode(field, dtype):
    return np.asarray([getattr(e, field) for e in episodes], dtype)

  return Trajectory(
      tokens=tokens, positions=positions, valid=valid, loss_mask=loss_mask,
      sample_logprobs=logprobs, rewards=rewards, turn_rewards=turn_rewards,
      turn_index=turn_index, turn_anchors=turn_anchors, task_id=per_episode("task_id", np.int32),
      group_id=per_episode("group_id", np.int32), num_turns=per_episode("num_turns", np.int32),
      success=per_episode("success", bool), score=per_episode("score", np.float32),
      terminated=per_episode("terminated", bool), truncated=per_episode("truncated", bool),
      failure=np.asarray([FAILURES.index(e.stop_reason) + 1 if e.failed else 0
                          for e in episodes], np.int32))
