"""The RL toolkit of issue 33: truncated importance sampling, overlong filtering / penalty,
dynamic sampling. Golden values by hand, the config fields' validation, and the policy loss
weighted by the TIS weights."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import settings as settings_lib
from agentgym_jax.rl import dynamic_sampling, losses, overlong
from agentgym_jax.train import config as base
from agentgym_jax.train import update as update_lib

# ----------------------------------------------------------- truncated importance sampling


def test_tis_weights_golden():
  # old - rollout = 0, ln 1.5, -ln 2, ln 3 on agent tokens, cap 2:
  #   weights min(e^x, 2) = 1, 1.5, 0.5, 2 (capped); the masked 5th token (ratio e^9) is 0.
  rollout = np.full((1, 5), -2.0)
  old = rollout + np.array([[0.0, math.log(1.5), -math.log(2.0), math.log(3.0), 9.0]])
  mask = np.array([[1, 1, 1, 1, 0]], bool)
  weights, metrics = jax.jit(losses.tis_weights, static_argnums=3)(old, rollout, mask, 2.0)
  np.testing.assert_allclose(weights, [[1.0, 1.5, 0.5, 2.0, 0.0]], rtol=1e-6)
  np.testing.assert_allclose(metrics["tis_weight"], 5.0 / 4, rtol=1e-6)
  np.testing.assert_allclose(metrics["tis_capped"], 1 / 4)
  # A huge gap does not overflow: e^100 is capped before exp.
  weights, _ = losses.tis_weights(np.array([[100.0]]), np.array([[0.0]]), np.ones((1, 1)), 2.0)
  np.testing.assert_allclose(weights, [[2.0]], rtol=1e-6)
  with pytest.raises(ValueError, match="cap must be > 0"):
    losses.tis_weights(old, rollout, mask, 0.0)


def test_tis_weights_carry_no_gradient():
  grad = jax.grad(lambda o: jnp.sum(losses.tis_weights(o, jnp.zeros((1, 2)), jnp.ones((1, 2)),
                                                       5.0)[0]))(jnp.full((1, 2), 0.3))
  np.testing.assert_array_equal(grad, 0.0)


# Policy loss with TIS: a tiny decoder, as tests/test_update.py's.
@functools.lru_cache(maxsize=None)
def _policy():
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from agentgym_jax.models import Decoder, ModelConfig  # pylint: disable=import-outside-toplevel
  from agentgym_jax.train import state as state_lib  # pylint: disable=import-outside-toplevel
  cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1)
  return state_lib.split_params(Decoder(cfg, rngs=nnx.Rngs(0)))


def _update_config(**algo):
  c = base.base_config()
  c.algo.kl_coef = 0.0
  c.algo.entropy_coef = 0.0
  for key, value in algo.items():
    c.algo[key] = value
  return update_lib.UpdateConfig.from_config(c)


def test_policy_loss_is_weighted_token_by_token():
  policy_def, params = _policy()
  rng = np.random.default_rng(0)
  rows, length = 4, 10
  mask = np.zeros((rows, length), bool)
  mask[:, 3:8] = True
  old = np.where(mask, rng.normal(-3.0, 0.2, (rows, length)), 0.0).astype(np.float32)
  # The sampler saw a different number: old - rollout = ln 2 on rows 0-1 (weight 2), ln 4 on
  # rows 2-3 (weight 4, capped to 3).
  gap = np.array([math.log(2.0)] * 2 + [math.log(4.0)] * 2, np.float32)[:, None]
  micro = {"tokens": jnp.asarray(rng.integers(0, 32, (rows, length)), jnp.int32),
           "valid": jnp.ones((rows, length), bool), "loss_mask": jnp.asarray(mask),
           "old_logprobs": jnp.asarray(old),
           "advantages": jnp.asarray(rng.normal(size=(rows, length)) * mask, jnp.float32),
           "rollout_logprobs": jnp.asarray(np.where(mask, old - gap, 0.0))}
  den = losses.aggregation_denominator(mask, "token-mean")

  def pg_loss(cfg, batch):
    fn = functools.partial(update_lib.policy_loss, graphdef=policy_def, cfg=cfg)
    return jax.jit(fn)(params, batch, den)[1]

  off = pg_loss(_update_config(), {k: v for k, v in micro.items() if k != "rollout_logprobs"})
  on = pg_loss(_update_config(tis_cap=3.0), micro)
  # Per-token surrogate of the loss without TIS, recovered row by row: all rows but one masked.
  per_row = []
  for row in range(rows):
    only = dict(micro, loss_mask=micro["loss_mask"] & (jnp.arange(rows)[:, None] == row))
    per_row.append(pg_loss(_update_config(), {k: v for k, v in only.items()
                                              if k != "rollout_logprobs"})["pg_loss"])
  # Denominators are the whole batch's, so the row terms add up to the loss.
  np.testing.assert_allclose(sum(per_row), off["pg_loss"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(on["pg_loss"], 2 * (per_row[0] + per_row[1])
                             + 3 * (per_row[2] + per_row[3]), rtol=1e-5, atol=1e-7)
  tokens = float(on["tokens"])
  np.testing.assert_allclose(on["tis_weight"] / tokens, 2.5, rtol=1e-5)
  np.testing.assert_allclose(on["tis_capped"] / tokens, 0.5, rtol=1e-6)
  assert "tis_weight" not in off


def test_build_batch_carries_the_sampler_logprobs_only_with_tis():
  z = jnp.zeros((2, 3))
  fields = dict(tokens=z, valid=z, loss_mask=z, old_logprobs=z, advantages=z, ref_logprobs=z,
                returns=z, values=z)
  off = update_lib.build_batch(_update_config().algo, **fields)
  assert "rollout_logprobs" not in off
  on = update_lib.build_batch(_update_config(tis_cap=2.0).algo, **fields,
                              rollout_logprobs=z + 1)
  np.testing.assert_array_equal(on["rollout_logprobs"], 1.0)
  with pytest.raises(ValueError, match=r"\['rollout_logprobs'\]"):
    update_lib.build_batch(_update_config(tis_cap=2.0).algo, **fields)


# ----------------------------------------------------------------------- overlong episodes


def test_overlong_episodes_are_truncated_not_terminated_and_not_failed():
  terminated = np.array([True, False, False, True, False])
  truncated = np.array([False, True, False, True, True])
  failed = np.array([False, False, False, False, True])
  np.testing.assert_array_equal(overlong.overlong_episodes(terminated, truncated, failed),
                                [False, True, False, False, False])


def test_overlong_filter_golden():
  mask = np.array([[0, 1, 1, 0, 1], [0, 1, 0, 1, 1], [0, 0, 1, 1, 0]], bool)
  # Packed rows: episode 1 is overlong, its agent tokens leave the loss.
  np.testing.assert_array_equal(overlong.mask_rows(mask, [False, True, False]),
                                [[0, 1, 1, 0, 1], [0, 0, 0, 0, 0], [0, 0, 1, 1, 0]])
  # Per-turn rows (rows 0 and 2 are turns of episode 0, row 1 of episode 1, padding row -1).
  rows = np.vstack([mask, np.ones((1, 5), bool)])
  np.testing.assert_array_equal(
      overlong.mask_rows(rows, [True, False], episode=[0, 1, 0, -1]),
      [[0] * 5, [0, 1, 0, 1, 1], [0] * 5, [1] * 5])


def test_overlong_penalty_golden():
  mask = np.array([[0, 1, 1, 0, 1, 0], [0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], bool)
  rewards = np.zeros((3, 6), np.float32)
  rewards[0, 4], rewards[1, 2] = 0.5, 0.25
  turn_rewards = rewards.copy()
  turn_rewards[0, 2] = 0.1
  rewards[0, 4] += 0.1
  new_rewards, new_turns = overlong.penalise(rewards, turn_rewards, mask, [True, False, True],
                                             0.75)
  # Row 0's last agent token (t4) loses 0.75 in both; row 1 is not overlong; row 2 has no
  # agent token and is left alone.
  want = rewards.copy()
  want[0, 4] -= 0.75
  np.testing.assert_allclose(new_rewards, want)
  want_turns = turn_rewards.copy()
  want_turns[0, 4] -= 0.75
  np.testing.assert_allclose(new_turns, want_turns)
  np.testing.assert_allclose(new_rewards.sum(1), new_turns.sum(1), atol=1e-7)
  assert rewards[0, 4] == pytest.approx(0.6)  # the inputs are not modified


# -------------------------------------------------------------------------- dynamic sampling


def test_informative_groups_golden():
  scores = np.array([[1, 1, 1], [0, 1, 0], [0.9, 0.9, 0.9], [0.3, 0.3, 0.7], [1, 0, 0]])
  members = np.array([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]], bool)
  # Equal rewards: dropped; the 4th group's differing member failed (not a member): dropped;
  # the 5th has one member left: dropped.
  np.testing.assert_array_equal(dynamic_sampling.informative_groups(scores, members),
                                [False, True, False, False, False])
  np.testing.assert_array_equal(dynamic_sampling.informative_groups(scores),
                                [False, True, False, True, True])


def test_select_groups_keeps_informative_first_then_fills():
  flags = np.array([0, 1, 0, 1, 1, 0, 1], bool)
  np.testing.assert_array_equal(dynamic_sampling.select_groups(flags, 3), [1, 3, 4])
  # Only 2 informative groups for 4 places: the earliest uninformative ones fill the batch.
  np.testing.assert_array_equal(dynamic_sampling.select_groups(flags[:4], 4), [0, 1, 2, 3])
  np.testing.assert_array_equal(
      dynamic_sampling.select_groups(np.array([1, 0, 0, 0, 1, 0], bool), 3), [0, 1, 4])
  with pytest.raises(ValueError, match="fewer than the batch's 4"):
    dynamic_sampling.select_groups(flags[:3], 4)


def _drawer(rounds):
  """A fake rollout: round r's informative flags are rounds[r]; records the rounds drawn."""
  drawn = []

  def draw(r):
    drawn.append(r)
    return np.asarray(rounds[r], bool)

  return draw, drawn


def test_fill_batch_refills_until_full():
  # 4 groups per batch; round 0 has 1 informative group, round 1 two, round 2 three.
  draw, drawn = _drawer([[0, 1, 0, 0], [1, 0, 0, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
  chosen, metrics = dynamic_sampling.fill_batch(draw, 4, max_extra_rounds=5)
  assert drawn == [0, 1, 2]  # stops as soon as the batch is full
  assert chosen == [(0, 1), (1, 0), (1, 3), (2, 0)]
  # 6 of the 12 drawn groups had equal rewards (3 + 2 + 1); round 2's informative groups 1
  # and 2 were not needed (not counted as dropped).
  assert metrics == {"dynamic_sampling/dropped": 6 / 12, "dynamic_sampling/extra_rounds": 2.0,
                     "dynamic_sampling/uninformative_kept": 0.0}


def test_fill_batch_respects_the_bound():
  draw, drawn = _drawer([[0, 1, 0, 0], [0, 0, 0, 1], [1, 1, 1, 1]])
  chosen, metrics = dynamic_sampling.fill_batch(draw, 4, max_extra_rounds=1)
  assert drawn == [0, 1]  # one extra round at most
  # Two informative groups, then the earliest uninformative ones: groups 0, 1 (round 0), 2,
  # and round 1's group 3.
  assert chosen == [(0, 0), (0, 1), (0, 2), (1, 3)]
  assert metrics["dynamic_sampling/extra_rounds"] == 1.0
  assert metrics["dynamic_sampling/uninformative_kept"] == 2 / 4
  assert metrics["dynamic_sampling/dropped"] == 4 / 8  # round 0's group 3, round 1's 0-2
  # No extra round allowed: the first round is the batch, as without dynamic sampling.
  draw, drawn = _drawer([[0, 0, 1, 0]])
  chosen, metrics = dynamic_sampling.fill_batch(draw, 4, max_extra_rounds=0)
  assert drawn == [0] and chosen == [(0, g) for g in range(4)]
  assert metrics["dynamic_sampling/dropped"] == 0.0


@dataclasses.dataclass
class _Episode:
  task_id: int
  group_id: int


def test_regroup_renumbers_the_chosen_groups():
  rounds = [[_Episode(10 + g, g) for g in range(3) for _ in range(2)],
            [_Episode(20 + g, g) for g in range(3) for _ in range(2)]]
  picked = dynamic_sampling.regroup(rounds, [(0, 2), (1, 0), (1, 1)], group_size=2)
  assert [(e.task_id, e.group_id) for e in picked] == [(12, 0), (12, 0), (20, 1), (20, 1),
                                                       (21, 2), (21, 2)]
  assert rounds[0][4].group_id == 2  # the originals are untouched


# ---------------------------------------------------------------------------- config fields


@pytest.mark.parametrize("field,value,match", [
    ("tis_cap", -1.0, r"algo.tis_cap must be > 0 \(or 0 to disable\), got -1.0"),
    ("overlong", "drop", r"algo.overlong 'drop' is not one of \['none', 'filter', 'penalty'\]"),
    ("dynamic_sampling_max_rounds", -1, "algo.dynamic_sampling_max_rounds must be >= 0"),
])
def test_bad_toolkit_fields_fail_in_one_line(field, value, match):
  c = base.base_config()
  c.algo[field] = value
  with pytest.raises(ValueError, match=match) as info:
    settings_lib.algorithm(c)
  assert "\n" not in str(info.value)


def test_overlong_penalty_must_be_positive():
  c = base.base_config()
  c.algo.overlong = "penalty"
  c.algo.overlong_penalty = 0.0
  with pytest.raises(ValueError, match="needs algo.overlong_penalty > 0"):
    settings_lib.algorithm(c)


def test_toolkit_fields_reach_the_spec_and_are_off_in_behaviour_cloning():
  c = base.base_config()
  c.algo.update(tis_cap=2.0, overlong="penalty", overlong_penalty=0.5, dynamic_sampling=True,
                dynamic_sampling_max_rounds=3)
  spec = settings_lib.algorithm(c)
  assert (spec.tis_cap, spec.overlong, spec.overlong_penalty, spec.dynamic_sampling,
          spec.dynamic_sampling_max_rounds) == (2.0, "penalty", 0.5, True, 3)
  c.mode = "bc"
  spec = settings_lib.algorithm(c)
  assert (spec.tis_cap, spec.overlong, spec.dynamic_sampling) == (0.0, "none", False)


@dataclasses.dataclass
class _Traj:
  rewards: np.ndarray
  loss_mask: np.ndarray


def _round(scores, offset):
  """A fake round of 2 tasks x 2 samples: episode records and a trajectory whose row sums are
  `scores` (row order: group 0's samples, then group 1's)."""
  episodes = [_Episode(offset + row // 2, row // 2) for row in range(4)]
  rewards = np.zeros((4, 3), np.float32)
  rewards[:, 1] = scores
  return _Traj(rewards, np.ones((4, 3), bool)), {"episodes": episodes,
                                                "rollout/sampled_tokens": 10}


def test_sample_until_full_rolls_out_rounds_and_builds_one_batch():
  first = _round([1, 1, 0, 1], offset=100)  # group 0 equal (dropped), group 1 informative
  extra = {1: _round([0, 0, 0.5, 0.5], offset=200), 2: _round([1, 0, 1, 1], offset=300)}
  built = []
  traj, stats, drawn, metrics = dynamic_sampling.sample_until_full(
      first, extra.__getitem__, batch_tasks=2, group_size=2, max_extra_rounds=3,
      rewards_of=lambda t: t.rewards, build=lambda eps: built.append(eps) or "batch")
  assert traj == "batch" and drawn == 3
  # Kept: round 0's group 1 and round 2's group 0, renumbered 0 and 1.
  assert [(e.task_id, e.group_id) for e in stats["episodes"]] == [(101, 0), (101, 0),
                                                                   (300, 1), (300, 1)]
  assert built[0] == stats["episodes"]
  assert stats["rollout/sampled_tokens"] == 30
  assert metrics["dynamic_sampling/extra_rollouts"] == 8.0
  assert metrics["dynamic_sampling/dropped"] == 4 / 6  # 1 + 2 + 1 equal groups of 6 drawn
  assert metrics["dynamic_sampling/success_rate"] == 0.0  # the fake episodes have no success
  # A first round whose groups all carry signal is the batch as it is: nothing more is drawn.
  first = _round([1, 0, 0, 1], offset=100)
  traj, stats, drawn, metrics = dynamic_sampling.sample_until_full(
      first, extra.__getitem__, batch_tasks=2, group_size=2, max_extra_rounds=3,
      rewards_of=lambda t: t.rewards, build=None)
  assert traj is first[0] and stats is first[1] and drawn == 1
  assert metrics["dynamic_sampling/extra_rollouts"] == 0.0


def test_overlong_apply_penalises_only_in_penalty_mode():
  traj = dataclasses.make_dataclass("T", ["rewards", "turn_rewards", "loss_mask", "terminated",
                                          "truncated", "failed"])(
      np.array([[0, 1.0], [0, 1.0]]), np.array([[0, 1.0], [0, 1.0]]), np.ones((2, 2), bool),
      np.array([False, True]), np.array([True, False]), np.array([False, False]))
  rewards, turn_rewards, over = overlong.apply(traj, "penalty", 0.5)
  np.testing.assert_array_equal(over, [True, False])
  np.testing.assert_allclose(rewards, [[0, 0.5], [0, 1.0]])
  np.testing.assert_allclose(turn_rewards, [[0, 0.5], [0, 1.0]])
  for mode in ("none", "filter"):
    rewards, _, over = overlong.apply(traj, mode, 0.5)
    np.testing.assert_allclose(rewards, traj.rewards)
    np.testing.assert_array_equal(over, [True, False])
