"""Overlong episodes: those cut by the turn cap or the token cap, filtered or penalised.

An episode that reached `max_turns` or `rollout.max_context` (or the environment's own step
limit) before the environment ended it has an outcome that says how far it got, not whether
its actions were good: the same actions with a few more turns might have succeeded. DAPO (Yu
et al. 2025, arXiv 2503.14476, Sec. 3.4) masks the loss of such truncated samples ("overlong
filtering") or penalises them ("overlong punishment"); chosen by name in `OVERLONG_MODES`:

  "none"     train on them as on any episode;
  "filter"   their agent tokens leave the loss (`mask_rows`); they keep their place in their
             group's baseline, as in DAPO, where the advantage is computed before the mask;
  "penalty"  their outcome reward loses `penalty` (`penalise`), on the last agent token where
             the outcome sits, and on the same token of the step rewards (so they still sum to
             the outcome and turn-level estimators see it in the last turn's step reward).

Host-side functions on numpy arrays (or jax arrays) of the `Trajectory` layout:
rewards / turn_rewards / loss_mask [B, L], per-episode flags [B].
"""

from __future__ import annotations

import numpy as np

OVERLONG_MODES = ("none", "filter", "penalty")


def overlong_episodes(terminated, truncated, failed) -> np.ndarray:
  """[B] bool: episodes cut by a cap (truncated and not terminated), failed ones excluded
  (they train nothing anyway). terminated, truncated, failed: [B] bool."""
  return (np.asarray(truncated, bool) & ~np.asarray(terminated, bool)
          & ~np.asarray(failed, bool))


def mask_rows(loss_mask, overlong, episode=None) -> np.ndarray:
  """The loss mask without the agent tokens of overlong episodes.

  Args:
    loss_mask: [R, L] bool, 1 on agent tokens of the update's rows.
    overlong: [B] bool from `overlong_episodes`.
    episode: [R] int, the episode of each row (the per-turn rows of a history window,
      rollout/window.py; -1 for padding rows); None when row r is episode r.
  Returns:
    [R, L] bool.
  """
  overlong = np.asarray(overlong, bool)
  if episode is None:
    drop = overlong
  else:
    episode = np.asarray(episode)
    drop = np.where(episode >= 0, overlong[np.maximum(episode, 0)], False)
  return np.asarray(loss_mask, bool) & ~drop[:, None]


def penalise(rewards, turn_rewards, loss_mask, overlong, penalty: float
             ) -> tuple[np.ndarray, np.ndarray]:
  """Outcome and step rewards with `penalty` subtracted at each overlong episode's last agent
  token. rewards, turn_rewards, loss_mask: [B, L]; overlong: [B] bool; -> two [B, L] float32.
  An overlong row without agent tokens is left as it is."""
  rewards = np.array(rewards, np.float32)
  turn_rewards = np.array(turn_rewards, np.float32)
  mask = np.asarray(loss_mask, bool)
  rows = np.flatnonzero(np.asarray(overlong, bool) & mask.any(axis=1))
  last = mask.shape[1] - 1 - np.argmax(mask[rows, ::-1], axis=1)
  rewards[rows, last] -= penalty
  turn_rewards[rows, last] -= penalty
  return rewards, turn_rewards


def apply(traj, mode: str, penalty: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """What the advantage estimators see of a host `Trajectory` under `mode`: (rewards [B, L],
  turn_rewards [B, L], overlong [B] bool); the rewards are penalised under "penalty", as they
  are otherwise (the "filter" mode acts on the update's loss mask: `mask_rows`)."""
  over = overlong_episodes(traj.terminated, traj.truncated, traj.failed)
  if mode == "penalty":
    return (*penalise(traj.rewards, traj.turn_rewards, traj.loss_mask, over, penalty), over)
  return np.asarray(traj.rewards), np.asarray(traj.turn_rewards), over
