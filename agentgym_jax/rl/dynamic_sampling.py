"""Dynamic sampling (DAPO, Yu et al. 2025, arXiv 2503.14476, Sec. 3.2): drop the groups whose
rewards are all equal and draw more tasks until the batch is full.

A group whose samples all got the same reward has advantage exactly 0 under every group
estimator (rl/advantages.py), so it adds nothing to the gradient but still counts in the loss
denominators, diluting the signal of the others. Each step therefore rolls out rounds of
`batch_tasks` tasks (the same batch shape as without it, so nothing recompiles) until
`batch_tasks` informative groups are in hand or `max_extra_rounds` extra rounds are spent;
the batch keeps the first informative groups in draw order, and when the bound is hit it is
filled with the earliest uninformative ones (advantage 0: they train nothing).

  informative_groups(scores [G, n], members [G, n]) -> [G] bool
  select_groups(informative [N], batch_tasks) -> [batch_tasks] indices into the N drawn groups
  fill_batch(draw, batch_tasks, max_extra_rounds) -> (chosen (round, group) pairs, metrics)
  regroup(rounds, chosen, group_size) -> the chosen groups' episodes, group ids renumbered
  sample_until_full(first, draw, ...) -> the trainer's step: rounds of rollouts, one batch

Unlike verl's DAPO recipe, which raises once `max_num_gen_batches` is exceeded, a step whose
bound is hit trains on the batch it has.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np


def informative_groups(scores, members=None) -> np.ndarray:
  """Which groups carry a learning signal: at least two members whose scores differ.

  Args:
    scores: [G, n] each sample's outcome (the rewards the estimator sees, summed over the row).
    members: [G, n] bool, samples that count (not failed, with agent tokens); default all.
  Returns:
    [G] bool. Scores are compared exactly, as the estimators give exactly 0 to equal ones.
  """
  scores = np.asarray(scores, np.float64)
  members = np.ones(scores.shape, bool) if members is None else np.asarray(members, bool)
  high = np.where(members, scores, -np.inf).max(axis=1)
  low = np.where(members, scores, np.inf).min(axis=1)
  return (members.sum(axis=1) >= 2) & (high > low)


def select_groups(informative, batch_tasks: int) -> np.ndarray:
  """The groups of the batch: the first `batch_tasks` informative ones in draw order, then, if
  too few were drawn, the earliest uninformative ones. informative: [N] bool, N >= batch_tasks.
  -> [batch_tasks] int indices, ascending."""
  informative = np.asarray(informative, bool)
  if informative.size < batch_tasks:
    raise ValueError(f"select_groups: {informative.size} groups drawn, fewer than the batch's "
                     f"{batch_tasks}")
  kept = np.flatnonzero(informative)[:batch_tasks]
  filler = np.flatnonzero(~informative)[:batch_tasks - kept.size]
  return np.sort(np.concatenate([kept, filler]))


def fill_batch(draw: Callable[[int], np.ndarray], batch_tasks: int, max_extra_rounds: int
               ) -> tuple[list[tuple[int, int]], dict[str, float]]:
  """Draws rounds until `batch_tasks` informative groups are in hand or the bound is reached.

  Args:
    draw: round r (0, 1, ...) -> [batch_tasks] bool, which of the round's groups are
      informative (the caller rolls the round out and keeps its episodes).
    batch_tasks: groups per round and per batch.
    max_extra_rounds: rounds after the first at most.
  Returns:
    (chosen: [batch_tasks] (round, group in the round) pairs in draw order; metrics:
    `dynamic_sampling/dropped` share of drawn groups left out for equal rewards,
    `dynamic_sampling/extra_rounds`, `dynamic_sampling/uninformative_kept` share of the
    batch's groups that carry no signal (the bound was hit)).
  """
  flags = [np.asarray(draw(0), bool)]
  while sum(int(f.sum()) for f in flags) < batch_tasks and len(flags) <= max_extra_rounds:
    flags.append(np.asarray(draw(len(flags)), bool))
  informative = np.concatenate(flags)
  picked = select_groups(informative, batch_tasks)
  chosen = [(int(i) // batch_tasks, int(i) % batch_tasks) for i in picked]
  dropped = int((~informative).sum()) - int((~informative[picked]).sum())
  return chosen, {"dynamic_sampling/dropped": dropped / informative.size,
                  "dynamic_sampling/extra_rounds": float(len(flags) - 1),
                  "dynamic_sampling/uninformative_kept":
                      float((~informative[picked]).sum()) / batch_tasks}


def regroup(rounds: Sequence[Sequence[Any]], chosen: Sequence[tuple[int, int]],
            group_size: int) -> list[Any]:
  """The episodes of the chosen groups, in order, each group's `group_id` set to its place.

  rounds: per round, its episode records (dataclasses with a `group_id`), rows i*n .. i*n+n-1
  the samples of group i (`run_episodes`' order); chosen: from `fill_batch`."""
  return [dataclasses.replace(episode, group_id=place)
          for place, (r, g) in enumerate(chosen)
          for episode in rounds[r][g * group_size:(g + 1) * group_size]]


# Rollout statistics that add up over a step's rounds.
_SUMMED_STATS = ("rollout/sampled_tokens", "rollout/env_seconds", "rollout/seconds")


def sample_until_full(first: tuple[Any, dict], draw: Callable[[int], tuple[Any, dict]], *,
                      batch_tasks: int, group_size: int, max_extra_rounds: int,
                      rewards_of: Callable[[Any], np.ndarray],
                      build: Callable[[list[Any]], Any]) -> tuple[Any, dict, int, dict]:
  """A trainer step's rollout under dynamic sampling (`fill_batch` over whole rollouts).

  Args:
    first: (host Trajectory [batch_tasks * group_size, L], stats) of the step's first round.
    draw: round r >= 1 -> (host Trajectory, stats) of another `batch_tasks` tasks.
    rewards_of: Trajectory -> [B, L] the rewards the estimator will see (their row sums are
      the groups' scores; rows without agent tokens, failed episodes, are no members).
    build: the chosen episode records -> their Trajectory (`build_trajectory`).
  Returns:
    (trajectory of the chosen groups, group ids 0..batch_tasks-1; stats with the rounds'
    throughput summed and the chosen episodes; rounds drawn; metrics of `fill_batch` plus
    `dynamic_sampling/extra_rollouts`, episodes rolled out beyond the first round, and
    `dynamic_sampling/success_rate`, the success rate of every episode drawn: the step's
    episode metrics describe the trained batch, which over-represents mixed groups).
  """
  rounds = [first]

  def flags(r: int) -> np.ndarray:
    if r:
      rounds.append(draw(r))
    traj = rounds[r][0]
    scores = np.asarray(rewards_of(traj), np.float64).sum(axis=1)
    members = np.asarray(traj.loss_mask, bool).any(axis=1)
    return informative_groups(scores.reshape(batch_tasks, group_size),
                              members.reshape(batch_tasks, group_size))

  chosen, metrics = fill_batch(flags, batch_tasks, max_extra_rounds)
  metrics["dynamic_sampling/extra_rollouts"] = float((len(rounds) - 1) * batch_tasks
                                                     * group_size)
  # The trained batch over-represents mixed groups; this is the policy's rate over all it drew.
  drawn = [bool(getattr(e, "success", False)) for _, s in rounds for e in s["episodes"]]
  metrics["dynamic_sampling/success_rate"] = float(np.mean(drawn)) if drawn else 0.0
  if len(rounds) == 1:  # the first round is the batch, as without dynamic sampling
    return first[0], first[1], 1, metrics
  episodes = regroup([stats["episodes"] for _, stats in rounds], chosen, group_size)
  stats = dict(first[1])
  for key in _SUMMED_STATS:
    if key in stats:
      stats[key] = sum(s[key] for _, s in rounds)
  stats["episodes"] = episodes
  return build(episodes), stats, len(rounds), metrics
