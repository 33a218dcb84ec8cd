"""The one door from a run's config to typed settings: what each part of it means, read once.

The config (`train/config.py`'s `base_config`, an `ml_collections.ConfigDict`) is what an
experiment file writes and the command line overrides; the library below the trainer never
reads it. Each of its parts takes a small frozen settings object instead, and the command lines
(the trainer, `python -m agentgym_jax.evaluate`, the plan, replay) make those here, once each:

  env(config)         rollout.envs.EnvSettings               config.env, data.split/categories
  rollout(config)     rollout.RolloutSettings                config.rollout, episode limits
  schedule(config)    rl.schedule.Schedule                   config.schedule
  algorithm(config)   rl.algorithm.AlgorithmSpec             config.mode, config.algo
  expert(config)      rollout.demonstrations.ExpertSettings  config.bc, the runner's limits
  policy(config)      policies.PolicySettings                config.model, config.tokenizer
  evaluation(config)  EvalSettings (below)                   config.eval

Each function is the one reader of its part of the config: it copies the fields into its
object (`algorithm` also makes, and checks, the choices the algorithm derives from them). The
objects check themselves (`Schedule`, `RolloutSettings`) or are checked by the module that
uses them (`rollout.envs.check`); what only the config's form can get wrong (a mixture entry's
fields) is checked here. `checked_env` and `checked_algorithm` are the command lines'
start-up checks: one line and exit, before anything is written.

`EvalSettings` is defined here, not in `evaluate/`: the evaluation command line stands above
this module (tests/test_layout.py's floors) and the trainer builds the same object.
This is the one module below `train/` whose functions take the ConfigDict
(tests/test_layout.py:test_no_module_below_the_trainer_takes_the_config names it as the
exception).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from agentgym_jax import cli
from agentgym_jax.policies import PolicySettings
from agentgym_jax.rl import advantages as advantages_lib
from agentgym_jax.rl import losses
from agentgym_jax.rl import overlong as overlong_lib
from agentgym_jax.rl.algorithm import MODES, AlgorithmSpec, estimator_options
from agentgym_jax.rl.schedule import Schedule
from agentgym_jax.rollout import RolloutSettings, SamplingConfig
from agentgym_jax.rollout import envs
from agentgym_jax.rollout.demonstrations import ExpertSettings

__all__ = ["EvalSettings", "algorithm", "checked_algorithm", "checked_env", "env",
           "evaluation", "expert", "policy", "rollout", "schedule"]


# ----- environments ----------------------------------------------------------------------------


def env(config: ml_collections.ConfigDict) -> envs.EnvSettings:
  """`config.env` with the training split of `config.data`; a mixture's entries each become
  a `Member` whose `env` is this one with the entry's environment fields.

  Raises:
    ValueError: a mixture entry that is not `rollout.envs.member`'s form (its fields named).
  """
  own = envs.EnvSettings(
      name=config.env.name, kwargs=_plain(config.env.kwargs),
      categories=tuple(config.env.categories), system_prompt=config.env.system_prompt,
      num_workers=config.env.num_workers, timeout_s=config.env.timeout_s,
      urls=tuple(config.env.urls), train_split=config.data.split,
      train_categories=tuple(config.data.categories))
  members = []
  for index, (label, entry) in enumerate(config.env.mix.items()):
    where = f"config.env.mix.{label}"
    if not isinstance(entry, ml_collections.ConfigDict):
      raise ValueError(f"{where} must be a ConfigDict of {envs.MEMBER_FIELDS} "
                       f"(rollout.envs.member builds one), got {entry!r}.")
    missing = [f for f in envs.MEMBER_FIELDS if f not in entry]
    unknown = sorted(set(entry) - set(envs.MEMBER_FIELDS))
    if missing or unknown:
      raise ValueError(f"{where} lacks {missing} and has unknown {unknown}; its fields are "
                       f"{envs.MEMBER_FIELDS}.")
    alone = dataclasses.replace(
        own, name=entry.name, kwargs=_plain(entry.kwargs),
        categories=tuple(entry.categories), system_prompt=entry.system_prompt)
    members.append(envs.Member(label=label, index=index, ratio=float(entry.ratio),
                               max_turns=int(entry.max_turns), env=alone))
  return dataclasses.replace(own, mix=tuple(members))


def _plain(kwargs: Any) -> dict[str, Any]:
  """Constructor arguments as plain values (a worker process unpickles them)."""
  return kwargs.to_dict() if isinstance(kwargs, ml_collections.ConfigDict) else dict(kwargs)


def checked_env(config: ml_collections.ConfigDict) -> envs.EnvSettings:
  """`env(config)`, checked by `rollout.envs.check`; exits with one line (a command line's
  start-up check) when it names no environment this install can run."""
  try:
    settings = env(config)
    envs.check(settings)
  except ValueError as e:
    cli.fatal(f"config.env: {e}")
  return settings


# ----- rollouts and their turn limits ------------------------------------------------------------


def schedule(config: ml_collections.ConfigDict) -> Schedule:
  """`config.schedule` (checked as the `Schedule` is made)."""
  c = config.schedule
  return Schedule(kind=c.kind, horizons=c.horizons, steps_per_phase=c.steps_per_phase,
                  advance=c.advance, window=c.window,
                  success_threshold=float(c.success_threshold), min_gain=float(c.min_gain))


def rollout(config: ml_collections.ConfigDict) -> RolloutSettings:
  """The training rollouts' settings: `config.rollout`, `data.group_size`, the system prompt
  and invalid-action reward of `config.env`, and the turn limit of the schedule's first phase
  (the trainer replaces it with each step's)."""
  c = config.rollout
  return RolloutSettings(
      sampling=SamplingConfig(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                              max_reply_tokens=c.max_reply_tokens),
      group_size=config.data.group_size, max_turns=schedule(config).horizons[0],
      max_context=c.max_context, system_prompt=config.env.system_prompt or None,
      replicas=c.replicas, history_turns=c.history_turns, overlap_env=c.overlap_env,
      invalid_action_reward=config.env.invalid_action_reward, compact=c.compact)


def expert(config: ml_collections.ConfigDict) -> ExpertSettings:
  """How the expert plays behaviour cloning's demonstrations: the runner's limits (the
  schedule's longest horizon, `rollout.max_context` and `rollout.max_reply_tokens`) and
  `config.bc`'s noise, drawn from the run's seed."""
  return ExpertSettings(
      max_turns=max(config.schedule.horizons), max_context=config.rollout.max_context,
      max_reply_tokens=config.rollout.max_reply_tokens, noise=config.bc.noise,
      drop_thought=config.bc.drop_thought, seed=config.seed)


# ----- the algorithm ---------------------------------------------------------------------------


def algorithm(config: ml_collections.ConfigDict) -> AlgorithmSpec:
  """The spec of `config.mode` and `config.algo`, every derived choice made here.

  Raises:
    ValueError: an unknown mode, estimator, KL estimator or aggregation mode, an estimator
      option the estimator does not take (or a value outside its choices), or a dual clip
      constant in (0, 1] (each message names the field and the allowed values).
  """
  algo = config.algo
  if config.mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {config.mode!r}.")
  for field, allowed in (("estimator", advantages_lib.ESTIMATORS),
                         ("loss_agg_mode", losses.LOSS_AGG_MODES),
                         ("kl_estimator", losses.KL_ESTIMATORS)):
    if algo[field] not in allowed:
      raise ValueError(f"algo.{field} {algo[field]!r} is not one of {sorted(allowed)}.")
  options = estimator_options(algo.estimator, algo.estimator_kwargs)
  if algo.estimator == "turn_gae" and algo.kl_coef > 0 and algo.kl_in_reward:
    raise ValueError("algo.estimator='turn_gae' reads the environment's step rewards only: "
                     "set algo.kl_in_reward=False (the KL penalty then goes in the loss).")
  if algo.clip_dual and algo.clip_dual <= 1.0:
    raise ValueError(f"algo.clip_dual must be > 1 (or 0 to disable), got {algo.clip_dual}.")
  if algo.tis_cap < 0:
    raise ValueError(f"algo.tis_cap must be > 0 (or 0 to disable), got {algo.tis_cap}.")
  if algo.overlong not in overlong_lib.OVERLONG_MODES:
    raise ValueError(f"algo.overlong {algo.overlong!r} is not one of "
                     f"{list(overlong_lib.OVERLONG_MODES)}.")
  if algo.overlong == "penalty" and algo.overlong_penalty <= 0:
    raise ValueError("algo.overlong='penalty' needs algo.overlong_penalty > 0 (subtracted "
                     f"from the outcome reward), got {algo.overlong_penalty}.")
  if algo.dynamic_sampling_max_rounds < 0:
    raise ValueError("algo.dynamic_sampling_max_rounds must be >= 0 (extra rollout rounds "
                     f"per step), got {algo.dynamic_sampling_max_rounds}.")
  rl = config.mode == "rl"
  estimator = algo.estimator
  kl = rl and algo.kl_coef > 0
  return AlgorithmSpec(
      estimator=estimator if rl else "",
      use_critic=rl and advantages_lib.ESTIMATORS.traits(estimator)["uses_critic"],
      keep_reference=kl, kl_in_loss=kl and not algo.kl_in_reward,
      kl_in_reward=kl and algo.kl_in_reward, kl_coef=algo.kl_coef,
      kl_estimator=algo.kl_estimator, whiten=algo.whiten, gamma=algo.gamma, lam=algo.lam,
      policy_loss="ppo_clip" if rl else "cross_entropy", loss_agg_mode=algo.loss_agg_mode,
      clip_low=algo.clip_low, clip_high=algo.clip_high, clip_dual=algo.clip_dual,
      entropy_coef=algo.entropy_coef, value_coef=algo.value_coef, value_clip=algo.value_clip,
      estimator_options=options if rl else (), tis_cap=algo.tis_cap if rl else 0.0,
      overlong=algo.overlong if rl else "none",
      overlong_penalty=algo.overlong_penalty if rl and algo.overlong == "penalty" else 0.0,
      dynamic_sampling=rl and algo.dynamic_sampling,
      dynamic_sampling_max_rounds=algo.dynamic_sampling_max_rounds if rl else 0,
      old_logprobs_from_update=(rl and algo.epochs == 1 and algo.minibatches == 1
                                and not (kl and algo.kl_in_reward)))


def checked_algorithm(config: ml_collections.ConfigDict) -> AlgorithmSpec:
  """`algorithm(config)`; exits with one line when `config.algo` is no valid algorithm (an
  unknown estimator, an estimator option it does not take, ...), which the trainer would
  otherwise raise with a traceback once the run is set up."""
  try:
    return algorithm(config)
  except ValueError as e:
    cli.fatal(str(e))


# ----- the policy ------------------------------------------------------------------------------


def policy(config: ml_collections.ConfigDict) -> PolicySettings:
  """`config.model` and `config.tokenizer`, with the run's `init_from` and seed."""
  m = config.model
  return PolicySettings(
      source=m.source, path=m.path, arch=dict(m.arch), dtype=m.dtype, remat=m.remat,
      attention=m.attention, layer_loop=m.layer_loop, matmul_precision=m.matmul_precision,
      lora_rank=m.lora_rank, lora_alpha=m.lora_alpha, tokenizer=config.tokenizer.spec,
      bpe_tasks=config.tokenizer.bpe_tasks, init_from=config.init_from, seed=config.seed)


# ----- evaluation ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """What an evaluation runs (`evaluate.evaluate`): `config.eval`'s defaults, each of the
  first six replaceable by a flag of the evaluation command line.

  Attributes:
    split, num_tasks: the split and its first N tasks (0: all).
    num_samples: n, episodes per task.
    max_turns, temperature, max_reply_tokens: the episodes' turn limit, sampling temperature
      (0: greedy) and per-turn token cap.
    rollout: the training rollouts' settings, which the episodes keep in everything the
      fields above do not set (top-p/top-k, context, history window).
    rows: episodes run at a time: eval.rows, by default (0) those of one training step (known
      to fit in memory).
    seed: the run's seed, written in the report.
    pass_criterion: "score>0" or "success".
    ks: Pass@k estimates to add (k > n are skipped).
  """

  split: str
  num_tasks: int
  num_samples: int
  max_turns: int
  temperature: float
  max_reply_tokens: int
  rollout: RolloutSettings
  rows: int
  seed: int
  pass_criterion: str = "score>0"
  ks: tuple[int, ...] = (1,)


def evaluation(config: ml_collections.ConfigDict, **overrides: Any) -> EvalSettings:
  """The config's evaluation settings, with the `overrides` that are not None (the command
  line's flags).

  The turn limit is eval.max_turns, by default (0) the schedule's longest horizon: the turn
  budget the trained agent is meant for.
  """
  if config.eval.rows < 0:
    raise ValueError(f"eval.rows must be >= 0 (0 = one training step's rows), got "
                     f"{config.eval.rows}.")
  if config.eval.max_turns < 0:
    raise ValueError(f"eval.max_turns must be >= 0 (0 = the schedule's longest horizon), got "
                     f"{config.eval.max_turns}.")
  settings = EvalSettings(
      split=config.eval.split, num_tasks=config.eval.num_tasks,
      num_samples=config.eval.group_size,
      max_turns=config.eval.max_turns or max(config.schedule.horizons),
      temperature=config.eval.temperature, max_reply_tokens=config.rollout.max_reply_tokens,
      rollout=rollout(config),
      rows=config.eval.rows or config.data.batch_tasks * config.data.group_size,
      seed=config.seed)
  return dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})
