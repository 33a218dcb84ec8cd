"""Advantage estimators: hand-computed golden values, parity with per-timestep loops, jit hygiene.

Layouts mimic multi-turn rows: prompt (mask 0), agent turns (mask 1) separated by observation
segments (mask 0), right padding (mask 0); the outcome reward sits on the last agent token.
"""

from collections import defaultdict

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax.rl import advantages
from agentgym_jax.rl.advantages import ESTIMATORS

GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline")


def _whiten_ref(x, mask):
  """verl's masked_whiten, masked positions set to 0."""
  sel = x[mask > 0]
  mean = sel.mean()
  var = ((sel - mean) ** 2).sum() / (len(sel) - 1)
  return (x - mean) / np.sqrt(var + 1e-8) * mask


# ---------------------------------------------------------------------------- golden values

# The held-out golden values hold in both precisions.
PRECISIONS = pytest.mark.parametrize("x64", [False, True], ids=["float32", "float64"])


def _in_precision(x64, *arrays):
  """The arrays as float64 (x64) or float32 inputs."""
  dtype = np.float64 if x64 else np.float32
  return [np.asarray(a, dtype) for a in arrays]


# Shared tiny layout, B=2, L=5:
#   row 0: agent agent | obs | agent | pad     (turn 1 = t0..t1, turn 2 = t3)
#   row 1: agent | obs | agent agent | pad     (turn 1 = t0,     turn 2 = t2..t3)
MASK = np.array([[1, 1, 0, 1, 0], [1, 0, 1, 1, 0]], np.float32)
REWARDS = np.array([[0, 0, 0, 1, 0], [0, 0, 0, 2, 0]], np.float32)


def test_gae_golden():
  # Values on obs/pad tokens are junk (9, 7, 3) and must not be used.
  values = np.array([[0.5, 0.25, 9.0, 0.5, 7.0], [0.0, 3.0, 1.0, 0.5, 0.0]], np.float32)
  # gamma = 0.5, lam = 0.5, so gamma*lam = 0.25. Reverse over t; V', A' = next agent token's.
  # Row 0: t3: delta = 1 + 0.5*0 - 0.5 = 0.5,         A = 0.5                   (V' = 0.5)
  #        t2: obs, skipped (carry V' = 0.5, A' = 0.5)
  #        t1: delta = 0 + 0.5*0.5 - 0.25 = 0,        A = 0 + 0.25*0.5 = 0.125  (V' = 0.25)
  #        t0: delta = 0 + 0.5*0.25 - 0.5 = -0.375,   A = -0.375 + 0.25*0.125 = -0.34375
  # Row 1: t3: delta = 2 + 0 - 0.5 = 1.5,             A = 1.5                   (V' = 0.5)
  #        t2: delta = 0 + 0.5*0.5 - 1.0 = -0.75,     A = -0.75 + 0.25*1.5 = -0.375 (V' = 1)
  #        t1: obs, skipped (carry V' = 1, A' = -0.375)
  #        t0: delta = 0 + 0.5*1 - 0 = 0.5,           A = 0.5 + 0.25*(-0.375) = 0.40625
  raw = np.array([[-0.34375, 0.125, 0, 0.5, 0], [0.40625, 0, -0.375, 1.5, 0]])
  # returns = A + V on agent tokens.
  want_returns = np.array([[0.15625, 0.375, 0, 1.0, 0], [0.40625, 0, 0.625, 2.0, 0]])
  adv, ret = ESTIMATORS["gae"](REWARDS, MASK, values=values, gamma=0.5, lam=0.5)
  np.testing.assert_allclose(ret, want_returns, atol=1e-6)
  # Whitening over the 6 agent tokens: mean = 1.8125 / 6, unbiased var over 5 degrees.
  np.testing.assert_allclose(adv, _whiten_ref(raw, MASK), atol=1e-6)


def test_masked_whiten_golden():
  # Masked mean of [1, 2, 3] is 2, squared deviations 1, 0, 1 -> unbiased var 2 / 2 = 1.
  out = advantages.masked_whiten(jnp.array([[1.0, 2.0, 3.0, 100.0]]),
                                 jnp.array([[1.0, 1.0, 1.0, 0.0]]))
  np.testing.assert_allclose(out, [[-1.0, 0.0, 1.0, 0.0]], atol=1e-6)


@PRECISIONS
def test_reinforce_plus_plus_golden(x64):
  rewards = REWARDS.copy()
  rewards[0, 1] = 0.5   # a per-turn reward at the end of row 0's first turn
  # gamma = 0.5, G' carried through observation tokens:
  # Row 0: t3: G = 1;  t2 obs: carry 1;  t1: G = 0.5 + 0.5*1 = 1.0;  t0: G = 0 + 0.5*1.0 = 0.5
  # Row 1: t3: G = 2;  t2: G = 0 + 0.5*2 = 1;  t1 obs: carry 1;  t0: G = 0.5*1 = 0.5
  # (verl would reset G on the obs token: row 0 t1 -> 0.5, t0 -> 0.25.)
  want_returns = np.array([[0.5, 1.0, 0, 1.0, 0], [0.5, 0, 1.0, 2.0, 0]])
  # Whitening: returns on agent tokens 0.5, 1, 1, 0.5, 1, 2: mean 6/6 = 1, deviations
  # -0.5, 0, 0, -0.5, 0, 1 -> sum of squares 1.5, unbiased var 1.5 / 5 = 0.3.
  want_adv = (want_returns - 1.0) / np.sqrt(0.3 + 1e-8) * MASK
  with jax.enable_x64(x64):
    adv, ret = ESTIMATORS["reinforce_plus_plus"](*_in_precision(x64, rewards, MASK), gamma=0.5)
  np.testing.assert_allclose(ret, want_returns, atol=1e-12 if x64 else 1e-6)
  np.testing.assert_allclose(adv, want_adv, atol=1e-12 if x64 else 1e-6)


# Group layout, B=4, L=6: rows 0-2 are group 7 (scores 1, 0, 0), row 3 is group 9 alone (score 1).
# Agent tokens per row: 2, 1, 2, 1, each row with an observation gap and padding.
G_MASK = np.array([[0, 1, 0, 1, 0, 0],
                   [0, 1, 0, 0, 0, 0],
                   [1, 0, 0, 1, 0, 0],
                   [0, 0, 1, 0, 0, 0]], np.float32)
G_REWARDS = np.array([[0, 0, 0, 1, 0, 0],
                      [0, 0, 0, 0, 0, 0],
                      [0, 0, 0, 0, 0, 0],
                      [0, 0, 1, 0, 0, 0]], np.float32)
G_IDS = np.array([7, 7, 7, 9])


@PRECISIONS
def test_grpo_golden(x64):
  # Group 7: mean 1/3; deviations 2/3, -1/3, -1/3 -> unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3.
  # Group 9 is a singleton: mean 0, std 1 -> A = 1 / (1 + eps).
  std, eps = np.sqrt(1 / 3), 1e-6
  want = np.array([(2 / 3) / (std + eps), (-1 / 3) / (std + eps), (-1 / 3) / (std + eps),
                   1 / (1 + eps)])
  with jax.enable_x64(x64):
    adv, ret = ESTIMATORS["grpo"](*_in_precision(x64, G_REWARDS, G_MASK), group_ids=G_IDS,
                                  eps=eps)
    assert adv.dtype == (jnp.float64 if x64 else jnp.float32)
  np.testing.assert_allclose(adv, want[:, None] * G_MASK, atol=1e-12 if x64 else 1e-6)
  np.testing.assert_allclose(ret, adv)


@PRECISIONS
def test_drgrpo_golden(x64):
  # s - group mean: 1 - 1/3, 0 - 1/3, 0 - 1/3; singleton: 1 - 0.
  want = np.array([2 / 3, -1 / 3, -1 / 3, 1.0])
  with jax.enable_x64(x64):
    adv, _ = ESTIMATORS["drgrpo"](*_in_precision(x64, G_REWARDS, G_MASK), group_ids=G_IDS)
  np.testing.assert_allclose(adv, want[:, None] * G_MASK, atol=1e-12 if x64 else 1e-6)


@PRECISIONS
def test_rloo_golden(x64):
  # s - mean of the others: 1 - (0 + 0)/2 = 1, 0 - (1 + 0)/2 = -0.5 (twice); singleton keeps 1.
  want = np.array([1.0, -0.5, -0.5, 1.0])
  with jax.enable_x64(x64):
    adv, _ = ESTIMATORS["rloo"](*_in_precision(x64, G_REWARDS, G_MASK), group_ids=G_IDS)
  np.testing.assert_allclose(adv, want[:, None] * G_MASK, atol=1e-12 if x64 else 1e-6)


@PRECISIONS
def test_reinforce_plus_plus_baseline_golden(x64):
  # s - group mean (singleton mean 0): 2/3, -1/3, -1/3, 1, repeated on 2, 1, 2, 1 tokens:
  # 2/3, 2/3, -1/3, -1/3, -1/3, 1 -> mean (4/3 - 1 + 1) / 6 = 2/9; deviations 4/9, 4/9, -5/9,
  # -5/9, -5/9, 7/9 -> squares sum (16+16+25+25+25+49)/81 = 156/81, unbiased var 156/405.
  dev = np.array([4 / 9, -5 / 9, -5 / 9, 7 / 9])
  want = dev[:, None] / np.sqrt(156 / 405 + 1e-8) * G_MASK
  with jax.enable_x64(x64):
    adv, ret = ESTIMATORS["reinforce_plus_plus_baseline"](*_in_precision(x64, G_REWARDS, G_MASK),
                                                          group_ids=G_IDS)
  np.testing.assert_allclose(adv, want, atol=1e-12 if x64 else 1e-6)
  np.testing.assert_allclose(ret, adv)


def turns_of(mask, rewards, seed=0, num_anchors=3, max_turns=32, lone=0.2):
  """The `Turns` of rows laid out as above: each maximal run of agent tokens is a turn (the
  observation after it keeps its index), each turn's reward is what `rewards` holds on its
  agent tokens, and turn k's anchor is drawn from `num_anchors` states (so some turns of a
  group share one, some do not), or with probability `lone` is a state of its own (a step
  group of one)."""
  mask = np.asarray(mask) > 0
  index = np.full(mask.shape, -1, np.int32)
  anchors = np.full((mask.shape[0], max_turns), -1, np.int32)
  rng = np.random.default_rng(seed)
  for b in range(mask.shape[0]):
    turn = -1
    for t in range(mask.shape[1]):
      if mask[b, t] and (t == 0 or not mask[b, t - 1]):
        turn += 1
      index[b, t] = turn
    anchors[b, :turn + 1] = np.where(rng.random(turn + 1) < lone,
                                     1000 + b * max_turns + np.arange(turn + 1),
                                     rng.integers(0, num_anchors, size=turn + 1))
  return advantages.Turns(index=jnp.asarray(index),
                          rewards=jnp.asarray(np.where(mask, rewards, 0.0)),
                          anchors=jnp.asarray(anchors))


def outcome_rewards(scores, mask):
  """[B] scores placed on each row's last agent token, as `build_trajectory` places them."""
  rewards = np.zeros(mask.shape, np.float32)
  for row, score in enumerate(scores):
    rewards[row, np.flatnonzero(mask[row])[-1]] = score
  return rewards


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_reward_on_last_agent_token_reaches_every_turn(name):
  # Three turns, observations after the last one and padding; success row vs failure row in one
  # group. Every agent token of the success row must get a larger advantage than the failure
  # row's: the reward at the last agent token is not lost on the way back over observations.
  mask = np.array([[0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0],
                   [0, 1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0]], np.float32)
  rewards = outcome_rewards([1.0, 0.0], mask)
  adv, _ = ESTIMATORS[name](rewards, mask, values=jnp.zeros_like(rewards),
                            group_ids=jnp.array([0, 0]), gamma=1.0, lam=1.0,
                            turns=turns_of(mask, rewards, num_anchors=1, lone=0.0))
  adv = np.asarray(adv)
  assert adv[0][mask[0] > 0].min() > adv[1][mask[1] > 0].max(), adv


# Turn-level golden values. Rows 0 and 1 are one task's two samples, row 2 another task alone:
#   prompt prompt | turn 0 (2 tokens) | obs | turn 1 (2 tokens) | obs
# Row 0 succeeds at turn 1 (reward 1), row 1 fails; both turn 0s acted from state 5, their
# turn 1s from different states (7, 9); row 2 acts once, from state 5 too (another task: its
# own group), reward 0.3.
TURN_MASK = np.array([[0, 0, 1, 1, 0, 1, 1, 0], [0, 0, 1, 1, 0, 1, 1, 0],
                      [0, 0, 1, 0, 0, 0, 0, 0]], np.float32)
TURN_INDEX = np.array([[-1, -1, 0, 0, 0, 1, 1, 1], [-1, -1, 0, 0, 0, 1, 1, 1],
                       [-1, -1, 0, 0, 0, 0, 0, 0]], np.int32)
TURN_REWARDS = np.zeros((3, 8), np.float32)
TURN_REWARDS[0, 6], TURN_REWARDS[2, 2] = 1.0, 0.3
TURN_ANCHORS = np.array([[5, 7, -1, -1], [5, 9, -1, -1], [5, -1, -1, -1]], np.int32)
TURNS = advantages.Turns(index=jnp.asarray(TURN_INDEX), rewards=jnp.asarray(TURN_REWARDS),
                         anchors=jnp.asarray(TURN_ANCHORS))


@PRECISIONS
@pytest.mark.parametrize("step_norm", ["mean_norm", "mean_std_norm"])
def test_gigpo_golden(step_norm, x64):
  rewards, mask = _in_precision(x64, TURN_REWARDS, TURN_MASK)
  turns = advantages.Turns(index=TURN_INDEX, rewards=rewards, anchors=TURN_ANCHORS)
  with jax.enable_x64(x64):
    adv, ret = ESTIMATORS["gigpo"](rewards, mask, group_ids=np.array([0, 0, 1]), gamma=0.5,
                                   turns=turns, step_norm=step_norm)
    # ω scales the step level only: ω = 0 is the episode level alone.
    adv0, _ = ESTIMATORS["gigpo"](rewards, mask, group_ids=np.array([0, 0, 1]), gamma=0.5,
                                  turns=turns, step_norm=step_norm, step_weight=0.0)
  # Episode level: scores 1, 0 (mean 0.5, std 0.7071) and 0.3 alone (mean 0, std 1, as
  # verl-agent's episode_norm_reward: A^E = 0.3).
  # Step level, γ = 0.5: the turn 0s share state 5, returns 0.5 and 0 (mean 0.25, std
  # 0.3536); each turn 1 is alone in its state, and row 2's turn is alone too (state 5 of
  # another task is not the same step group): a step group of one is its own mean, so its
  # step advantage is 0 (the paper's Eq. 7; verl-agent's step_norm_reward).
  if step_norm == "mean_norm":
    episode, turn0, turn1, alone = [0.5, -0.5], [0.25, -0.25], [0.0, 0.0], 0.3
  else:
    r2 = 1 / np.sqrt(2)
    episode, turn0, turn1, alone = [r2, -r2], [r2, -r2], [0.0, 0.0], 0.3
  want = np.zeros((3, 8))
  for row in range(2):
    want[row, 2:4] = episode[row] + turn0[row]
    want[row, 5:7] = episode[row] + turn1[row]
  want[2, 2] = alone
  np.testing.assert_allclose(adv, want, atol=1e-5)  # eps = 1e-6 in the std divisions
  np.testing.assert_array_equal(ret, adv)
  np.testing.assert_allclose(adv0[0, 2:4], episode[0], atol=2e-6)


@PRECISIONS
@pytest.mark.parametrize("step_norm", ["mean_norm", "mean_std_norm"])
def test_gigpo_lone_step_gets_zero_step_advantage(step_norm, x64):
  # One one-step episode with reward 1, alone in its task group and in its step group:
  # episode level 1 - 0 (a lone episode has baseline 0), step level 1 - 1 = 0 (the mean of a
  # group of one is the member itself: GiGPO Eq. 7, verl-agent's step_norm_reward), so 1.0;
  # treating the lone step like a lone episode would give 2.0.
  mask, rewards = _in_precision(x64, [[0, 1, 1]], [[0, 0, 1]])
  turns = advantages.Turns(index=np.array([[-1, 0, 0]], np.int32), rewards=rewards,
                           anchors=np.array([[3]], np.int32))
  with jax.enable_x64(x64):
    adv, _ = ESTIMATORS["gigpo"](rewards, mask, group_ids=np.array([0]), turns=turns,
                                 step_norm=step_norm)
  np.testing.assert_allclose(adv, [[0, 1.0, 1.0]], atol=2e-6)


# Groups of equal rewards carry no signal: their advantage must be exactly 0, not rounding noise
# of the group mean divided by std + eps (float32: 8 x 0.9 gave GRPO 0.056 on every token).
EQUAL_VALUES = (0.9, 0.1, 1 / 3)


def _equal_groups(x64, values=EQUAL_VALUES, sizes=(8, 3, 5), mixed=False):
  """Groups of equal outcomes (group g: sizes[g] copies of values[g]), each episode of two
  turns that act from the same states with the same step rewards (so every step group is
  equal too); with `mixed`, a last group of 4 with outcomes 0, 1, 0.9, 0.9.
  -> (rewards, mask, group_ids, turns, rows of the equal groups)."""
  scores, ids = [], []
  for g, (value, size) in enumerate(zip(values, sizes)):
    scores += [value] * size
    ids += [g] * size
  equal_rows = len(scores)
  if mixed:
    scores += [0.0, 1.0, 0.9, 0.9]
    ids += [len(values)] * 4
  b = len(scores)
  dtype = np.float64 if x64 else np.float32
  mask = np.tile(np.array([0, 1, 1, 0, 1, 1, 0], dtype), (b, 1))
  rewards = np.zeros_like(mask)
  rewards[:, 5] = np.asarray(scores, dtype)
  index = np.tile(np.array([-1, 0, 0, 0, 1, 1, 1], np.int32), (b, 1))
  anchors = np.tile(np.array([[10, 11]], np.int32), (b, 1))
  turns = advantages.Turns(index=index, rewards=rewards, anchors=anchors)
  return rewards, mask, np.asarray(ids), turns, equal_rows


EQUAL_CASES = [("grpo", {}), ("drgrpo", {}), ("rloo", {}), ("reinforce_plus_plus_baseline", {}),
               ("gigpo", {"step_norm": "mean_norm", "gamma": 0.95}),
               ("gigpo", {"step_norm": "mean_std_norm", "gamma": 0.95})]


@PRECISIONS
@pytest.mark.parametrize("name,options", EQUAL_CASES,
                         ids=[f"{n}-{o.get('step_norm', '')}" for n, o in EQUAL_CASES])
def test_equal_rewards_give_exactly_zero_advantage(name, options, x64):
  # A batch of equal groups only (0.9 x 8, 0.1 x 3, 1/3 x 5): every estimator with group (or
  # batch) statistics gives exactly 0.
  rewards, mask, ids, turns, _ = _equal_groups(x64)
  with jax.enable_x64(x64):
    adv, _ = ESTIMATORS[name](rewards, mask, group_ids=ids, turns=turns, **options)
  np.testing.assert_array_equal(adv, 0.0)


@PRECISIONS
@pytest.mark.parametrize("value", EQUAL_VALUES)
def test_equal_returns_whiten_to_exactly_zero(value, x64):
  # Batch statistics (REINFORCE++'s whitening of returns): a batch of equal returns gives 0.
  rewards, mask, ids, turns, _ = _equal_groups(x64, values=(value,) * 3)
  with jax.enable_x64(x64):
    adv, ret = ESTIMATORS["reinforce_plus_plus"](rewards, mask, gamma=1.0)
    whitened = advantages.masked_whiten(jnp.full(mask.shape, value, mask.dtype), mask)
  np.testing.assert_array_equal(ret, value * mask)
  np.testing.assert_array_equal(adv, 0.0)
  np.testing.assert_array_equal(whitened, 0.0)


@PRECISIONS
@pytest.mark.parametrize("name,options", [c for c in EQUAL_CASES
                                          if c[0] in ("grpo", "drgrpo", "rloo", "gigpo")],
                         ids=lambda x: x if isinstance(x, str) else x.get("step_norm", ""))
@pytest.mark.parametrize("value", EQUAL_VALUES)
def test_equal_group_beside_a_mixed_one_gets_exactly_zero(name, options, value, x64):
  # Per-group estimators (no batch whitening): the equal group's rows are exactly 0 whatever
  # the other groups hold, and the mixed group still gets its signal.
  rewards, mask, ids, turns, equal_rows = _equal_groups(x64, values=(value,), sizes=(8,),
                                                        mixed=True)
  with jax.enable_x64(x64):
    adv, _ = ESTIMATORS[name](rewards, mask, group_ids=ids, turns=turns, **options)
  adv = np.asarray(adv)
  np.testing.assert_array_equal(adv[:equal_rows], 0.0)
  assert np.abs(adv[equal_rows:]).max() > 0.1


def test_turn_gae_golden():
  # Row 0 alone; values on the observation tokens (9) are junk and must not be used.
  values = np.array([[9, 9, 0.2, 0.4, 9, 0.5, 0.6, 9]], np.float32)
  turns = advantages.Turns(index=jnp.asarray(TURN_INDEX[:1]),
                           rewards=jnp.asarray(TURN_REWARDS[:1]),
                           anchors=jnp.asarray(TURN_ANCHORS[:1]))
  adv, ret = ESTIMATORS["turn_gae"](TURN_REWARDS[:1], TURN_MASK[:1], values=values, gamma=1.0,
                                    lam=0.5, turns=turns, turn_gamma=0.9)
  # Turns (last-token values 0.4, 0.6; rewards 0, 1):
  #   δ_1 = 1 - 0.6 = 0.4 = A_1;  δ_0 = 0.9 * 0.6 - 0.4 = 0.14,
  #   A_0 = 0.14 + 0.9 * 0.5 * 0.4 = 0.32
  # Tokens: t6 = A_1 = 0.4, t5 = 0.6 - 0.5 + 0.5 * 0.4 = 0.3, t3 = A_0 = 0.32,
  #   t2 = 0.4 - 0.2 + 0.5 * 0.32 = 0.36.
  raw = np.array([[0, 0, 0.36, 0.32, 0, 0.3, 0.4, 0]])
  np.testing.assert_allclose(ret, (raw + values) * TURN_MASK[:1], atol=1e-6)
  np.testing.assert_allclose(adv, _whiten_ref(raw, TURN_MASK[:1]), atol=1e-5)


def test_turn_estimators_need_the_turns():
  r = np.zeros((2, 5), np.float32)
  with pytest.raises(ValueError, match="gigpo needs turns"):
    ESTIMATORS["gigpo"](r, r, group_ids=np.zeros(2, np.int32))
  with pytest.raises(ValueError, match=r"turns.index \(2, 4\)"):
    ESTIMATORS["turn_gae"](r, r, values=r, turns=advantages.Turns(
        index=np.zeros((2, 4), np.int32), rewards=r, anchors=np.zeros((2, 3), np.int32)))
  with pytest.raises(ValueError, match="step_norm must be one of"):
    ESTIMATORS["gigpo"](r, r, group_ids=np.zeros(2, np.int32), turns=advantages.Turns(
        index=np.zeros((2, 5), np.int32), rewards=r, anchors=np.zeros((2, 3), np.int32)),
                        step_norm="std")


# ------------------------------------------------------------- parity with per-timestep loops


def random_batch(seed, batch=12, length=40, groups=4):
  """Multi-turn rows: prompt, agent/obs segments, right padding; one all-masked row."""
  rng = np.random.default_rng(seed)
  mask = np.zeros((batch, length), np.float64)
  for b in range(batch - 1):
    t = int(rng.integers(1, 5))
    end = length - int(rng.integers(0, 8))
    while t < end:
      n = int(rng.integers(1, 7))
      mask[b, t:min(t + n, end)] = 1
      t += n + int(rng.integers(1, 6))
  mask[0, 1] = 1  # at least one agent token somewhere
  rewards = np.zeros_like(mask)
  for b in range(batch):
    agent = np.nonzero(mask[b])[0]
    if len(agent):
      rewards[b, agent[-1]] = rng.choice([0.0, 1.0, 0.3])
      rewards[b, rng.choice(agent, size=min(2, len(agent)))] += rng.normal(0, 0.1, size=min(
          2, len(agent)))  # per-turn rewards / KL penalties on agent tokens
  values = rng.normal(size=mask.shape)
  group_ids = 1000 + 17 * rng.integers(0, groups, size=batch)  # arbitrary, non-contiguous ids
  group_ids[-1] = 5  # a singleton group
  return rewards, mask, values, group_ids


def gae_loop(rewards, mask, values, gamma, lam):
  batch, length = rewards.shape
  adv = np.zeros_like(rewards)
  for b in range(batch):
    next_value, next_adv = 0.0, 0.0
    for t in reversed(range(length)):
      if mask[b, t]:
        delta = rewards[b, t] + gamma * next_value - values[b, t]
        next_adv = delta + gamma * lam * next_adv
        next_value = values[b, t]
        adv[b, t] = next_adv
  return _whiten_ref(adv, mask), (adv + values) * mask


def rfpp_loop(rewards, mask, gamma):
  returns = np.zeros_like(rewards)
  for b in range(rewards.shape[0]):
    g = 0.0
    for t in reversed(range(rewards.shape[1])):
      if mask[b, t]:
        g = rewards[b, t] + gamma * g
        returns[b, t] = g
  return _whiten_ref(returns, mask), returns


def group_loop(name, rewards, mask, group_ids, eps):
  scores = rewards.sum(axis=1)
  members = defaultdict(list)
  for b, g in enumerate(group_ids):
    members[g].append(scores[b])
  out = np.zeros(len(scores))
  for b, g in enumerate(group_ids):
    s = np.array(members[g])
    n = len(s)
    mean = s.mean() if n > 1 else 0.0
    if name == "grpo":
      std = s.std(ddof=1) if n > 1 else 1.0
      out[b] = (scores[b] - mean) / (std + eps)
    elif name == "drgrpo":
      out[b] = scores[b] - mean
    elif name == "rloo":
      out[b] = scores[b] - (s.sum() - scores[b]) / (n - 1) if n > 1 else scores[b]
    else:
      out[b] = scores[b] - mean
  adv = out[:, None] * mask
  if name == "reinforce_plus_plus_baseline":
    adv = _whiten_ref(adv, mask)
  return adv, adv


def _group_norm(members, x, eps, divide, lone_mean=0.0):
  """(x - mean) [/ (std + eps)] over `members`; a group of one has std 1 and mean `lone_mean`
  (verl-agent: 0 for an episode alone in its task group, `episode_norm_reward`; the member
  itself for a step alone in its state, `step_norm_reward`)."""
  s = np.asarray(members)
  mean, std = (s.mean(), s.std(ddof=1)) if len(s) > 1 else (lone_mean, 1.0)
  return (x - mean) / (std + eps) if divide else x - mean


def gigpo_loop(rewards, mask, group_ids, turns, gamma, eps, step_weight=1.0,
               step_norm="mean_norm"):
  """GiGPO as verl-agent computes it, with dicts of lists, one episode per row."""
  index, step_rewards, anchors = (np.asarray(x) for x in (turns.index, turns.rewards,
                                                          turns.anchors))
  divide = step_norm == "mean_std_norm"
  scores = rewards.sum(axis=1)
  episodes, steps, returns = defaultdict(list), defaultdict(list), {}
  for b, g in enumerate(group_ids):
    episodes[g].append(scores[b])
    num_turns = int((anchors[b] >= 0).sum())
    g_return = 0.0
    for k in reversed(range(num_turns)):
      rho = sum(step_rewards[b, t] for t in range(mask.shape[1])
                if mask[b, t] and index[b, t] == k)
      g_return = rho + gamma * g_return
      returns[b, k] = g_return
      steps[g, anchors[b, k]].append(g_return)
  adv = np.zeros_like(rewards)
  for b, g in enumerate(group_ids):
    for t in np.flatnonzero(mask[b]):
      k = index[b, t]
      adv[b, t] = (_group_norm(episodes[g], scores[b], eps, divide) + step_weight
                   * _group_norm(steps[g, anchors[b, k]], returns[b, k], eps, divide,
                                 lone_mean=returns[b, k]))
  return adv, adv


def turn_gae_loop(mask, values, turns, gamma, lam, turn_gamma):
  """Bi-level GAE as RAGEN's per-row loops: over the turns' last tokens, then inside turns."""
  index, step_rewards = np.asarray(turns.index), np.asarray(turns.rewards)
  adv = np.zeros_like(values)
  length = mask.shape[1]
  for b in range(mask.shape[0]):
    agent = [t for t in range(length) if mask[b, t]]
    ends = [t for t in agent
            if not (t + 1 < length and mask[b, t + 1] and index[b, t + 1] == index[b, t])]
    last = 0.0
    for i in reversed(range(len(ends))):
      rho = sum(step_rewards[b, t] for t in agent if index[b, t] == index[b, ends[i]])
      next_value = values[b, ends[i + 1]] if i + 1 < len(ends) else 0.0
      last = rho + turn_gamma * next_value - values[b, ends[i]] + turn_gamma * lam * last
      adv[b, ends[i]] = last
    for t in reversed(agent):
      if t in ends:
        last = adv[b, t]
      else:
        last = gamma * values[b, t + 1] - values[b, t] + gamma * lam * last
        adv[b, t] = last
  return _whiten_ref(adv, mask), (adv + values) * mask


def reference(name, rewards, mask, values, group_ids, gamma, lam, eps, turns=None):
  if name == "gigpo":
    return gigpo_loop(rewards, mask, group_ids, turns, gamma, eps)
  if name == "turn_gae":
    return turn_gae_loop(mask, values, turns, gamma, lam, turn_gamma=1.0)
  if name == "gae":
    return gae_loop(rewards, mask, values, gamma, lam)
  if name == "reinforce_plus_plus":
    return rfpp_loop(rewards, mask, gamma)
  return group_loop(name, rewards, mask, group_ids, eps)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_loop_float64(name, seed):
  rewards, mask, values, group_ids = random_batch(seed)
  gamma, lam, eps = [(1.0, 1.0, 1e-6), (0.99, 0.95, 1e-6), (0.9, 0.7, 0.1)][seed]
  with jax.enable_x64(True):
    turns = turns_of(mask, rewards, seed)
    want_adv, want_ret = reference(name, rewards, mask, values, group_ids, gamma, lam, eps,
                                   turns)
    adv, ret = ESTIMATORS[name](rewards, mask, values=values, group_ids=group_ids, gamma=gamma,
                                lam=lam, eps=eps, turns=turns)
    assert adv.dtype == jnp.float64
  np.testing.assert_allclose(adv, want_adv, atol=1e-6)
  np.testing.assert_allclose(ret, want_ret, atol=1e-6)


def float32_batch(seed):
  """A [16, 64] float32 batch; the tests below share its shapes, so they share compilations."""
  rewards, mask, values, group_ids = random_batch(seed, batch=16, length=64)
  return rewards.astype(np.float32), mask.astype(bool), values.astype(np.float32), group_ids


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_matches_loop_float32(name):
  rewards, mask, values, group_ids = float32_batch(3)
  turns = turns_of(mask, rewards, 3)
  want_adv, want_ret = reference(name, rewards.astype(np.float64), mask, values.astype(
      np.float64), group_ids, 0.99, 0.95, 1e-6, turns)
  adv, ret = ESTIMATORS[name](rewards, mask, values=values, group_ids=group_ids, gamma=0.99,
                              lam=0.95, turns=turns)
  assert adv.dtype == jnp.float32
  np.testing.assert_allclose(adv, want_adv, atol=1e-5)
  np.testing.assert_allclose(ret, want_ret, atol=1e-5)


@pytest.mark.parametrize("impl", ["_gae_scan", "_gae_associative"])
def test_gae_implementations_match_loop(impl):
  # `gae` runs _gae_scan on CPU and _gae_associative on GPU/TPU: both must equal the loop.
  rewards, mask, values, _ = random_batch(5, batch=9, length=57)
  raw = np.zeros_like(rewards)
  for b in range(rewards.shape[0]):  # verl's loop, output on every position (carry on obs)
    next_value = next_adv = 0.0
    for t in reversed(range(rewards.shape[1])):
      adv = rewards[b, t] + 0.97 * next_value - values[b, t] + 0.97 * 0.9 * next_adv
      if mask[b, t]:
        next_value, next_adv = values[b, t], adv
      raw[b, t] = next_adv
  with jax.enable_x64(True):
    got = jax.jit(getattr(advantages, impl))(rewards, values, mask, 0.97, 0.9)
  np.testing.assert_allclose(got, raw, atol=1e-9)


@pytest.mark.parametrize("impl", ["_recurrence_scan", "_recurrence_associative"])
def test_recurrence_implementations_match_loop(impl):
  rng = np.random.default_rng(6)
  a, b = rng.uniform(0, 1.2, size=(5, 33)), rng.normal(size=(5, 33))
  want, x = np.zeros_like(a), np.zeros(5)
  for t in reversed(range(33)):
    x = a[:, t] * x + b[:, t]
    want[:, t] = x
  with jax.enable_x64(True):
    np.testing.assert_allclose(jax.jit(getattr(advantages, impl))(a, b), want, atol=1e-9)


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus"])
def test_platform_dispatch(name):
  # Lowered for CPU the recursion is one sequential loop; lowered for TPU or GPU (no device
  # needed: jax.export) it is the log-depth associative scan, with no loop over L.
  r = jnp.zeros((4, 16))
  fn = jax.jit(lambda r, m: ESTIMATORS[name](r, m, values=r, gamma=0.9, lam=0.8))
  loops = {platform: jax.export.export(fn, platforms=[platform])(r, r).mlir_module().count(
      "stablehlo.while") for platform in ("cpu", "tpu", "cuda")}
  assert loops == {"cpu": 1, "tpu": 0, "cuda": 0}


# ------------------------------------------------------------------------------ jit hygiene


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_no_recompile_when_values_change(name):
  traces = []

  def update(rewards, mask, values, group_ids, gamma, lam, turns):
    traces.append(None)  # runs once per trace
    return ESTIMATORS[name](rewards, mask, values=values, group_ids=group_ids, gamma=gamma,
                            lam=lam, turns=turns)

  jitted = jax.jit(update)
  fn = ESTIMATORS[name]
  before = fn._cache_size()
  for seed in range(3):
    rewards, mask, values, group_ids = random_batch(seed, batch=7, length=29)
    args = (rewards.astype(np.float32), mask.astype(bool), values.astype(np.float32),
            group_ids.astype(np.int32))
    turns = turns_of(args[1], args[0], seed)
    gamma, lam = 0.9 + 0.03 * seed, 0.8 + 0.05 * seed
    jax.block_until_ready(jitted(*args, gamma, lam, turns))
    jax.block_until_ready(fn(args[0], args[1], values=args[2], group_ids=args[3], gamma=gamma,
                             lam=lam, turns=turns))
  assert len(traces) == 1
  assert fn._cache_size() - before == 1


# ------------------------------------------------------------------------------- bad input


def test_shape_errors_are_clear():
  r = np.zeros((2, 5), np.float32)
  with pytest.raises(ValueError, match=r"mask shape \(2, 4\) != rewards shape \(2, 5\)"):
    ESTIMATORS["grpo"](r, np.zeros((2, 4)), group_ids=np.zeros(2, np.int32))
  with pytest.raises(ValueError, match="values shape"):
    ESTIMATORS["gae"](r, r, values=np.zeros((2, 6)))
  with pytest.raises(ValueError, match="gae needs values"):
    ESTIMATORS["gae"](r, r)
  with pytest.raises(ValueError, match="needs group_ids"):
    ESTIMATORS["rloo"](r, r)
  with pytest.raises(ValueError, match=r"group_ids must be \[B\]"):
    ESTIMATORS["grpo"](r, r, group_ids=np.zeros(3, np.int32))
  with pytest.raises(ValueError, match=r"rewards must be \[B, L\]"):
    ESTIMATORS["reinforce_plus_plus"](np.zeros(5), np.zeros(5))
  with pytest.raises(KeyError, match="registered: .*grpo"):
    ESTIMATORS["gpro"]  # pylint: disable=pointless-statement


def test_shape_errors_raise_inside_jit():
  r = jnp.zeros((2, 5))
  with pytest.raises(ValueError, match="mask shape"):
    jax.jit(lambda r, m: ESTIMATORS["reinforce_plus_plus"](r, m))(r, jnp.zeros((2, 3)))


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_all_masked_rows_give_zeros(name):
  rewards, mask, values, group_ids = float32_batch(4)
  mask[2] = False
  rewards[2, 5] = 3.0  # a stray reward on a row without agent tokens
  adv, ret = ESTIMATORS[name](rewards, mask, values=values, group_ids=group_ids,
                              turns=turns_of(mask, rewards))
  assert np.isfinite(adv).all() and np.isfinite(ret).all()
  np.testing.assert_array_equal(adv[2], 0)
  np.testing.assert_array_equal(ret[2], 0)
  # A batch without any agent token at all.
  no_agent = np.zeros_like(mask)
  adv, ret = ESTIMATORS[name](rewards, no_agent, values=values, group_ids=group_ids,
                              turns=turns_of(no_agent, rewards))
  np.testing.assert_array_equal(adv, 0)
  np.testing.assert_array_equal(ret, 0)


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus"])
def test_non_finite_junk_off_agent_tokens_does_not_leak(name):
  rewards, mask, values, group_ids = float32_batch(6)
  want = ESTIMATORS[name](rewards, mask, values=np.where(mask, values, 0.0), group_ids=group_ids)
  values = np.where(mask, values, np.inf)   # critic junk on obs/padding
  rewards = np.where(mask, rewards, np.nan)  # stray NaN rewards off agent tokens
  got = ESTIMATORS[name](rewards, mask, values=values, group_ids=group_ids)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
