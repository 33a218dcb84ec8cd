"""What `config.algo` means, resolved once: the algorithm spec, and the advantages it assembles.

Every other module reads the algorithm from an `AlgorithmSpec` instead of from the config, so
each derived choice (which estimator, whether a critic and a reference model are kept, where
the KL penalty goes, which policy loss, whether the old log-probs are scored before the update
or taken from its own forward) is made, and validated, in one place, the config's door
(agentgym_jax/settings.py:algorithm):

  spec = agentgym_jax.settings.algorithm(config)
  advantages_fn = make_advantage_fn(spec)   # jitted; None for behaviour cloning

`ALGORITHMS` names the algorithms the experiments run, the paper's four (`PAPER_ALGORITHMS`)
and two with turn-level credit (their `algo=` config argument); each is an advantage
estimator of `advantages.ESTIMATORS`, set as `config.algo.estimator`, whose own keyword options
are `config.algo.estimator_kwargs`. What an estimator needs (a critic, the turn structure) is
read from its registration (`advantages.ESTIMATORS.traits`), so a new estimator is one
registered function.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from agentgym_jax.rl import advantages as advantages_lib
from agentgym_jax.rl import losses

# The experiments' algorithm names (their `algo=` config argument) -> advantage estimator.
ALGORITHMS = {"grpo": "grpo", "ppo": "gae", "reinforce_pp": "reinforce_plus_plus", "rloo": "rloo",
              "gigpo": "gigpo", "turn_ppo": "turn_gae"}
# The four the paper compares (its Table 6; AgentGym-RL, arXiv 2509.08755).
PAPER_ALGORITHMS = ("grpo", "ppo", "reinforce_pp", "rloo")
# config.mode: "rl" trains on the policy's own rollouts, "bc" clones the expert's.
MODES = ("rl", "bc")


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
  """The algorithm of a run, every field final (hashable: it is static in the jitted update).

  estimator: key of `advantages.ESTIMATORS` ("" in behaviour cloning, which has none).
  use_critic: a value model is trained (GAE's values): the estimator's `uses_critic` trait.
  uses_turns (property): the estimator reads the batch's turn structure (its `uses_turns`).
  keep_reference: the initial policy is kept as the KL reference.
  kl_in_loss, kl_in_reward: where kl_coef · KL(π || π_ref) goes (at most one; neither when
    kl_coef is 0 or in behaviour cloning).
  policy_loss: key of `losses.POLICY_LOSSES` ("ppo_clip", or "cross_entropy" for cloning).
  loss_agg_mode: one of `losses.LOSS_AGG_MODES`.
  estimator_options: `algo.estimator_kwargs` as sorted (name, value) pairs, checked against
    the estimator's signature (`advantages.options`); empty in behaviour cloning.
  tis_cap: truncated importance sampling's cap (`losses.tis_weights`), 0 = off.
  overlong, overlong_penalty: what happens to episodes cut by a cap (`overlong.OVERLONG_MODES`).
  dynamic_sampling, dynamic_sampling_max_rounds: DAPO's dynamic sampling and its bound on
    extra rollout rounds (`dynamic_sampling.fill_batch`).
  (In behaviour cloning these four are off: the batch is the expert's.)
  old_logprobs_from_update: the update's own first forward gives the old log-probs (held
    constant: ratio 1), so the policy is not scored apart before it. Exact when the update
    makes one optimizer step per batch (algo.epochs = algo.minibatches = 1: the parameters
    do not change between the micro-batches of its one minibatch) and nothing before the
    update reads them (the KL in the reward does); the update then logs the sampler/trainer
    log-prob gap (`update.logprob_gap`).
  The rest are `config.algo`'s coefficients, as documented in train/config.py.
  """

  estimator: str
  use_critic: bool
  keep_reference: bool
  kl_in_loss: bool
  kl_in_reward: bool
  kl_coef: float
  kl_estimator: str
  whiten: bool
  gamma: float
  lam: float
  policy_loss: str
  loss_agg_mode: str
  clip_low: float
  clip_high: float
  clip_dual: float
  entropy_coef: float
  value_coef: float
  value_clip: float
  estimator_options: tuple[tuple[str, Any], ...] = ()
  tis_cap: float = 0.0
  overlong: str = "none"
  overlong_penalty: float = 0.0
  dynamic_sampling: bool = False
  dynamic_sampling_max_rounds: int = 0
  old_logprobs_from_update: bool = False

  @property
  def trains_with_rollout_logprobs(self) -> bool:
    """Whether the update reads the sampler's log-probs: truncated importance sampling
    weighs by them, and an update whose old log-probs are its own logs its gap to them."""
    return self.tis_cap > 0 or self.old_logprobs_from_update

  @property
  def uses_turns(self) -> bool:
    return bool(self.estimator) and advantages_lib.ESTIMATORS.traits(self.estimator)["uses_turns"]


def estimator_options(estimator: str, kwargs: Any) -> tuple[tuple[str, Any], ...]:
  """`kwargs` (`algo.estimator_kwargs`) as sorted (name, value) pairs, checked against what
  `estimator` takes: its keyword options beyond `advantages.COMMON_ARGS`, and the values its
  `choices` trait allows.

  Raises:
    ValueError: an option the estimator does not take, a value outside its choices, or an
      unhashable value (the spec is static in the jitted update).
  """
  accepted = advantages_lib.options(estimator)
  choices = advantages_lib.ESTIMATORS.traits(estimator)["choices"]
  pairs = []
  for name, value in sorted(dict(kwargs).items()):
    if name not in accepted:
      raise ValueError(f"algo.estimator_kwargs has {name!r}, which {estimator} does not take; "
                       f"its options: {sorted(accepted)}")
    if name in choices and value not in choices[name]:
      raise ValueError(f"algo.estimator_kwargs.{name} {value!r} is not one of "
                       f"{list(choices[name])} ({estimator}'s choices).")
    try:
      hash(value)
    except TypeError:
      raise ValueError(f"algo.estimator_kwargs.{name} must be a number, string or tuple, got "
                       f"{type(value).__name__} {value!r}.") from None
    pairs.append((name, value))
  return tuple(pairs)


def make_advantage_fn(spec: AlgorithmSpec) -> Callable | None:
  """Jitted (rewards, mask, group_ids, old_lp, ref_lp, values, turns=None) -> (advantages,
  returns, kl).

  All [B, L] but group_ids [B] and `turns` (an `advantages.Turns`, needed by the turn-level
  estimators, `spec.uses_turns`). With `kl_in_reward` the reward of every agent token first
  loses kl_coef · KL(old || ref) (kl: that penalty, else zeros); `whiten` whitens the
  estimator's advantages over the batch's agent tokens. The estimator's options
  (`spec.estimator_options`) are bound before tracing, so a string option reaches the
  estimator as the Python value its own jit takes as static. None in behaviour cloning.
  """
  if not spec.estimator:
    return None
  estimator = functools.partial(advantages_lib.ESTIMATORS[spec.estimator],
                                **dict(spec.estimator_options))

  @jax.jit
  def compute(rewards, mask, group_ids, old_logprobs, ref_logprobs, values, turns=None):
    kl = jnp.zeros_like(rewards)
    if spec.kl_in_reward:
      rewards, kl = losses.kl_in_reward(rewards, old_logprobs, ref_logprobs, mask,
                                        beta=spec.kl_coef, kind=spec.kl_estimator)
    adv, returns = estimator(rewards, mask, values=values, group_ids=group_ids,
                             gamma=spec.gamma, lam=spec.lam, turns=turns)
    if spec.whiten:
      adv = advantages_lib.masked_whiten(adv, mask)
    return adv, returns, kl

  return compute
