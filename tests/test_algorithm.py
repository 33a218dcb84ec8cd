"""The algorithm spec: every algorithm name resolves to the spec it means, bad configs fail in
one place, and the advantages it assembles (KL in the reward, Dr.GRPO) are the estimator's."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import settings as settings_lib
from agentgym_jax.rl import advantages, losses
from agentgym_jax.rl.algorithm import ALGORITHMS, AlgorithmSpec, make_advantage_fn
from agentgym_jax.train import config as base

# name -> (estimator, critic, reference kept, KL in the loss, KL in the reward, policy loss),
# under the base config (kl_coef 0.001 in the loss).
WANT = {
    "grpo": ("grpo", False, True, True, False, "ppo_clip"),
    "ppo": ("gae", True, True, True, False, "ppo_clip"),
    "reinforce_pp": ("reinforce_plus_plus", False, True, True, False, "ppo_clip"),
    "rloo": ("rloo", False, True, True, False, "ppo_clip"),
    "gigpo": ("gigpo", False, True, True, False, "ppo_clip"),
    "turn_ppo": ("turn_gae", True, True, True, False, "ppo_clip"),
}


def _spec(**algo) -> AlgorithmSpec:
  c = base.base_config()
  for key, value in algo.items():
    if key == "mode":
      c.mode = value
    else:
      c.algo[key] = value
  return settings_lib.algorithm(c)


def _summary(spec: AlgorithmSpec) -> tuple:
  return (spec.estimator, spec.use_critic, spec.keep_reference, spec.kl_in_loss,
          spec.kl_in_reward, spec.policy_loss)


def test_every_algorithm_name_resolves_to_its_spec():
  assert set(ALGORITHMS) == set(WANT)
  for name, estimator in ALGORITHMS.items():
    assert _summary(_spec(estimator=estimator)) == WANT[name], name


@pytest.mark.parametrize("estimator", sorted(advantages.ESTIMATORS))
def test_every_estimator_is_a_valid_spec(estimator):
  spec = _spec(estimator=estimator)
  assert spec.estimator == estimator
  assert spec.use_critic == (estimator in ("gae", "turn_gae"))
  assert spec.uses_turns == (estimator in ("gigpo", "turn_gae"))
  hash(spec)  # static in the jitted update


def test_derived_choices():
  # KL in the reward: the reference stays, the loss has no KL term.
  assert _summary(_spec(kl_in_reward=True)) == ("grpo", False, True, False, True, "ppo_clip")
  # No KL at all: no reference model is kept.
  assert _summary(_spec(kl_coef=0.0)) == ("grpo", False, False, False, False, "ppo_clip")
  # Behaviour cloning: cross-entropy, no estimator, critic, reference or KL, whatever algo says.
  assert _summary(_spec(mode="bc", estimator="gae", kl_in_reward=True)) == (
      "", False, False, False, False, "cross_entropy")
  assert make_advantage_fn(_spec(mode="bc")) is None
  for spec in (_spec(), _spec(mode="bc")):
    assert spec.policy_loss in losses.POLICY_LOSSES


@pytest.mark.parametrize("field, value, message", [
    ("mode", "sft", "mode must be one of"),
    ("estimator", "ppo", "algo.estimator 'ppo' is not one of"),
    ("loss_agg_mode", "sum", "algo.loss_agg_mode 'sum' is not one of"),
    ("kl_estimator", "k4", "algo.kl_estimator 'k4' is not one of"),
    ("clip_dual", 0.5, "algo.clip_dual must be > 1"),
])
def test_bad_algorithm_fields_fail_once_with_the_field_named(field, value, message):
  with pytest.raises(ValueError, match=message):
    _spec(**{field: value})


def test_spec_is_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    _spec().estimator = "gae"


def test_kl_in_reward_and_dr_grpo_advantages():
  spec = _spec(kl_in_reward=True, kl_coef=0.5, kl_estimator="k1", estimator="drgrpo")
  mask = jnp.array([[0, 1, 1, 0], [0, 1, 1, 0]], bool)
  rewards = jnp.array([[0, 0, 1.0, 0], [0, 0, 0, 0]])
  old = jnp.array([[0, -1.0, -2.0, 0], [0, -1.0, -1.0, 0]])
  ref = jnp.array([[0, -1.5, -2.0, 0], [0, -1.0, -0.5, 0]])
  adv, _, kl = make_advantage_fn(spec)(rewards, mask, jnp.array([0, 0]), old, ref,
                                       jnp.zeros_like(old))
  np.testing.assert_allclose(kl, [[0, 0.5, 0, 0], [0, 0, -0.5, 0]])
  scores = np.array([1.0 - 0.25, 0.25])  # reward minus 0.5 x summed k1
  np.testing.assert_allclose(adv, (scores - scores.mean())[:, None] * np.asarray(mask),
                             rtol=1e-6)
  expected = advantages.ESTIMATORS["drgrpo"](
      losses.kl_in_reward(rewards, old, ref, mask, beta=0.5, kind="k1")[0], mask,
      group_ids=jnp.array([0, 0]))[0]
  np.testing.assert_allclose(adv, expected, rtol=1e-6)


def test_whiten_whitens_the_estimators_advantages():
  mask = jnp.array([[0, 1, 1], [0, 1, 0]], bool)
  rewards = jnp.array([[0, 0, 1.0], [0, 0.5, 0]])
  zeros = jnp.zeros_like(rewards)
  adv, _, _ = make_advantage_fn(_spec(estimator="rloo", whiten=True))(
      rewards, mask, jnp.array([0, 0]), zeros, zeros, zeros)
  raw = advantages.ESTIMATORS["rloo"](rewards, mask, group_ids=jnp.array([0, 0]))[0]
  np.testing.assert_allclose(adv, advantages.masked_whiten(raw, mask), rtol=1e-6)


def test_turn_level_options_reach_the_estimator_and_bad_ones_stop_at_the_spec():
  # Two one-turn episodes of one task: gigpo's step groups are its episode groups, so with
  # step_weight w its advantage is (1 + w) times the episode-level one (Dr.GRPO's for
  # "mean_norm", GRPO's for "mean_std_norm").
  mask = jnp.array([[0, 1, 1, 0], [0, 1, 0, 0]], jnp.float32)
  rewards = jnp.array([[0, 0, 1, 0], [0, 0.5, 0, 0]], jnp.float32)
  turns = advantages.Turns(index=jnp.array([[-1, 0, 0, 0], [-1, 0, 0, 0]]), rewards=rewards,
                           anchors=jnp.array([[7, -1], [7, -1]]))
  zeros = jnp.zeros_like(rewards)
  group = jnp.array([0, 0])
  for norm, reference in (("mean_norm", "drgrpo"), ("mean_std_norm", "grpo")):
    spec = _spec(estimator="gigpo", estimator_kwargs=dict(step_weight=0.5, step_norm=norm),
                 kl_coef=0.0)
    adv, _, _ = make_advantage_fn(spec)(rewards, mask, group, zeros, zeros, zeros, turns)
    want = advantages.ESTIMATORS[reference](rewards, mask, group_ids=group)[0]
    np.testing.assert_allclose(adv, 1.5 * np.asarray(want), rtol=1e-5)
  with pytest.raises(ValueError, match=r"algo.estimator_kwargs.step_norm 'std' is not one of"):
    _spec(estimator="gigpo", estimator_kwargs=dict(step_norm="std"))
  with pytest.raises(ValueError, match="turn_gae.*kl_in_reward=False"):
    _spec(estimator="turn_gae", kl_in_reward=True)
  with pytest.raises(ValueError, match="gigpo needs turns"):
    make_advantage_fn(_spec(estimator="gigpo"))(rewards, mask, group, zeros, zeros, zeros)
