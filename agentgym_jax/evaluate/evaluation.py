"""One evaluation: every task of a split (or its first `num_tasks`) n times through the rollout
engine, and the summary `eval_metrics` makes of the final scores, per paper column and overall
(a mixture's: each environment's first `num_tasks`, one column per environment).

On several hosts (every process calling `evaluate` alike) each process runs a share of the
episodes and gets the results of all of them. Episodes that failed (an env worker crashed or
hung, the env server answered an error) are left out of Avg@n and Pass@n, which are computed
over the healthy ones, and counted by fault in the report: a flaky env server does not look
like a weak policy.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
import tqdm

from agentgym_jax import multihost
from agentgym_jax.evaluate import eval_metrics
from agentgym_jax.evaluate.columns import PAPER_COLUMNS, paper_column
from agentgym_jax.rollout import SamplingConfig, envs, run_episodes, save_jsonl
from agentgym_jax.rollout.trajectory import build_trajectory
from agentgym_jax.settings import EvalSettings
from agentgym_jax.tokenization import ChatTokenizer


def eval_key(seed: int) -> jax.Array:
  """The sampling key of a run's evaluations, the trainer's in-loop ones and the command
  line's alike.

  One key for every evaluation of a run, so checkpoints are compared on the same sampling
  noise and a change between them is the policy's. The training streams fold the step and
  their stream id into this key, so none of them draws with this key itself.
  """
  return jax.random.key(seed)


@dataclasses.dataclass
class EvalResult:
  """Per-episode outcomes ([E] each, E = tasks x n, grouped by task) and their summary."""

  summary: dict[str, dict[str, float]]
  settings: dict[str, Any]  # what ran, as written at the head of the report
  task_ids: list[int]
  rewards: np.ndarray  # final reward as trained on (normalised unless reward_mode="paper")
  scores: np.ndarray  # the environment's raw final score
  success: np.ndarray
  passed: np.ndarray
  num_turns: np.ndarray
  failed: np.ndarray  # the episodes that ended on a fault, left out of the summary
  stop_reasons: list[str]
  categories: dict[int, str | None]
  seconds: float  # wall time of the episodes

  @property
  def success_rate(self) -> float | None:
    """Success per healthy episode (None when every episode failed)."""
    return float(self.success[~self.failed].mean()) if not self.failed.all() else None


def evaluate(env: envs.EnvSettings, settings: EvalSettings, graphdef: nnx.GraphDef,
             state: nnx.State, tok: ChatTokenizer, pool: Any, *, rng: jax.Array,
             mesh: jax.sharding.Mesh | None = None, episodes_path: str | None = None,
             progress_bar: bool = False) -> EvalResult:
  """Runs every task of the settings' split n times and summarises per paper column.

  The trainer's in-loop evaluation and `python -m agentgym_jax.evaluate` both call this, so
  they sample alike (the rollout's top-p/top-k at `settings.temperature`), name the
  environment alike (a remote env by the one it serves), and run the same chunks: as many
  tasks at a time as fill the rows of one training step, which are known to fit in memory.

  Args:
    env: the run's environments (`settings.env`).
    settings: see `EvalSettings` (`settings.evaluation`).
    graphdef, state: `nnx.split(policy)`.
    tok: the policy's chat tokenizer.
    pool: an `environments.workers.EnvPool` from `envs.make_pool(env)` (or anything with
      its reset/step interface).
    rng: the sampling key (`eval_key`); chunk c uses fold_in(rng, c).
    mesh: shard rollout rows over its data axes. On a mesh over several processes every
      process must call this (with the same arguments): each runs an even share of the
      episodes on its own devices and every process gets the result of all of them.
    episodes_path: write every episode as JSONL here (from one process only).
    progress_bar: show a tqdm bar over this process's episodes as they end (the command
      line's; the trainer's console has its own bar over steps).
  Raises:
    ValueError: an unknown split, or no task to evaluate.
  """
  task_ids = envs.evaluation_tasks(env, settings.split, settings.num_tasks)
  if not task_ids:
    raise ValueError("No tasks to evaluate: the split is empty or --num_tasks is 0.")
  env_name = envs.served_name(env)
  n = settings.num_samples
  # The training rollouts' settings but for what evaluation sets itself; an invalid action
  # costs nothing here (the reward is reported, never trained on).
  trained = settings.rollout
  rollout = dataclasses.replace(
      trained,
      sampling=SamplingConfig(temperature=settings.temperature, top_p=trained.sampling.top_p,
                              top_k=trained.sampling.top_k,
                              max_reply_tokens=settings.max_reply_tokens),
      group_size=n, max_turns=settings.max_turns, invalid_action_reward=0.0)
  start_time = time.perf_counter()
  chunk = max(1, settings.rows // n)
  # On several hosts each process runs an even share of every chunk's episodes on its own
  # devices (keys and group ids of the whole chunk, so the samples are those of one process).
  share = multihost.process_share(mesh)
  local_state = share.local(state)
  plan = []  # (chunk, its task ids, this process's rows of it or None for all)
  for c, start in enumerate(range(0, len(task_ids), chunk)):
    chunk_ids = task_ids[start:start + chunk]
    rows = multihost.split_rows(len(chunk_ids) * n)
    if rows is None or rows.size:
      plan.append((c, chunk_ids, rows))
  total = sum(len(ids) * n if rows is None else rows.size for _, ids, rows in plan)
  mine = []  # (chunk, row, Episode) run by this process
  with tqdm.tqdm(total=total, desc="evaluate", unit="episode", disable=not progress_bar,
                 dynamic_ncols=True) as progress:
    for c, chunk_ids, rows in plan:
      _, stats = run_episodes(
          (graphdef, local_state), tok, pool, chunk_ids, rollout,
          rng=jax.random.fold_in(rng, c), mesh=share.mesh, rows=rows,
          on_ended=progress.update)
      ran = range(len(stats["episodes"])) if rows is None else rows.tolist()
      mine += [(c, row, e) for row, e in zip(ran, stats["episodes"])]
  gathered = sorted(itertools.chain.from_iterable(multihost.allgather_objects(mine)),
                    key=lambda item: item[:2])
  episodes = [e for _, _, e in gathered]
  if episodes_path:
    open(episodes_path, "w").close()
    for _, items in itertools.groupby(gathered, key=lambda item: item[0]):
      chunk_episodes = [e for _, _, e in items]
      save_jsonl(episodes_path, build_trajectory(chunk_episodes, tok.pad_id), tok.decode,
                 chunk_episodes, append=True)

  ids = [e.task_id for e in episodes]
  categories: dict[int, str | None] = {}
  for e in episodes:  # an episode whose reset failed has no category; its task's others may
    if e.category is not None or e.task_id not in categories:
      categories[e.task_id] = e.category
  scores = np.array([e.score for e in episodes], np.float64)
  success = np.array([e.success for e in episodes], bool)
  passed = eval_metrics.passed_from(scores, success, settings.pass_criterion)
  rewards = np.array([e.reward for e in episodes], np.float64)
  failed = np.array([e.failed for e in episodes], bool)
  if env.is_mixture:  # one column per environment
    columns = {t: envs.environment_of(env, t) for t in categories}
    order = [m.label for m in env.mix]
  else:
    columns = {t: paper_column(env_name, cat) for t, cat in categories.items()}
    order = [column for column, _ in PAPER_COLUMNS.get(env_name, ())]
  summary = eval_metrics.summarize(ids, rewards, passed, columns, order,
                                   ks=[k for k in settings.ks if k <= n], failed=failed)
  # The raw-score mean too (SciWorld's 0..100 score, BabyAI's step-discounted reward).
  for column, metrics in eval_metrics.summarize(ids, scores, passed, columns, order,
                                                failed=failed).items():
    summary[column]["avg_raw"] = metrics["avg"]
  report_settings = {
      "env": env_name, "num_tasks": len(task_ids), "num_samples": n,
      "max_turns": settings.max_turns, "max_reply_tokens": settings.max_reply_tokens,
      "temperature": settings.temperature, "top_p": rollout.sampling.top_p,
      "top_k": rollout.sampling.top_k, "max_context": rollout.max_context,
      "history_turns": rollout.history_turns, "pass_criterion": settings.pass_criterion,
      "seed": settings.seed}
  return EvalResult(summary=summary, settings=report_settings, task_ids=ids, rewards=rewards,
                    scores=scores, success=success, passed=passed,
                    num_turns=np.array([e.num_turns for e in episodes], np.int32),
                    failed=failed, stop_reasons=[e.stop_reason for e in episodes],
                    categories=categories, seconds=time.perf_counter() - start_time)


def environment_metrics(env: envs.EnvSettings, result: EvalResult) -> dict[str, float]:
  """A mixture's held-out results per environment: <environment>/success_rate (per healthy
  episode) and <environment>/avg and /pass (its summary column); empty outside a mixture. An
  environment whose episodes all failed measured nothing and is left out."""
  if not env.is_mixture:
    return {}
  labels = np.asarray([envs.environment_of(env, t) for t in result.task_ids])
  out = {}
  for label in [m.label for m in env.mix]:
    healthy = (labels == label) & ~result.failed
    if not healthy.any():
      continue
    out[f"{label}/success_rate"] = float(result.success[healthy].mean())
    column = result.summary.get(label, {})
    out.update({f"{label}/{k}": float(column[k]) for k in ("avg", "pass")
                if column.get(k) is not None})
  return out
