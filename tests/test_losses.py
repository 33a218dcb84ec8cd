"""Losses, KL, entropy and loss aggregation: golden values by hand, loop parity, exact
micro-batching of every aggregation mode (values and gradients), jit hygiene, bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax.rl import losses
from agentgym_jax.rl.logprobs import token_logprobs_and_entropy
from agentgym_jax.rl.losses import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES


def random_mask(rng, batch, length):
  """Multi-turn masks (agent segments between observation gaps, right padding), 2 empty rows."""
  mask = np.zeros((batch, length), bool)
  for b in range(batch - 2):
    t = int(rng.integers(1, 4))
    end = length - int(rng.integers(0, 5))
    while t < end:
      n = int(rng.integers(1, 6))
      mask[b, t:min(t + n, end)] = True
      t += n + int(rng.integers(1, 5))
  return rng.permutation(mask)


# ---------------------------------------------------------------------------- golden values


def test_ppo_clip_golden():
  # clip_ratio_low = 0.2, clip_ratio_high = 0.28 -> clip range [0.8, 1.28]; clip_ratio_c = 3.
  # (ratio, A): l1 = -A ratio, l2 = -A clip(ratio), l = max(l1, l2), for A < 0 min(l, -3A)
  #  (1,   1): l1 = -1,   l2 = -1             -> -1
  #  (1.5, 1): l1 = -1.5, l2 = -1.28          -> -1.28  clipped
  #  (0.5, 1): l1 = -0.5, l2 = -0.8           -> -0.5
  #  (0.5,-1): l1 = 0.5,  l2 = 0.8            -> 0.8    clipped; dual bound 3 not hit
  #  (4,  -1): l1 = 4,    l2 = 1.28  -> 4, dual: min(4, 3) = 3   dual clip
  #  (1.5,-2): l1 = 3,    l2 = 2.56  -> 3, dual: min(3, 6) = 3
  # The 4th column is masked (a huge ratio there must not count).
  ratio = np.array([[1, 1.5, 0.5, 100.0], [0.5, 4, 1.5, 100.0]])
  adv = np.array([[1, 1, 1, 5.0], [-1, -1, -2, 5.0]])
  mask = np.array([[1, 1, 1, 0], [1, 1, 1, 0]], bool)
  old = np.full((2, 4), -1.3)
  ppo_clip = jax.jit(POLICY_LOSSES["ppo_clip"])
  loss, metrics = ppo_clip(old + np.log(ratio), old, adv, mask, clip_ratio_low=0.2,
                           clip_ratio_high=0.28, clip_ratio_c=3.0)
  np.testing.assert_allclose(loss, [[-1, -1.28, -0.5, 0], [0.8, 3, 3, 0]], atol=1e-6)
  # clipped: 2 of 6 agent tokens, dual: 1 of 6.
  np.testing.assert_allclose(metrics["clip_frac"], 2 / 6, atol=1e-6)
  np.testing.assert_allclose(metrics["clip_frac_lower"], 1 / 6, atol=1e-6)
  # approx_kl = mean(-log ratio) = -(0 + ln1.5 + ln.5 + ln.5 + ln4 + ln1.5)/6 = -ln(1.5)/3.
  np.testing.assert_allclose(metrics["approx_kl"], -math.log(1.5) / 3, atol=1e-6)
  # Without the dual clip the (4, -1) token keeps 4.
  loss, metrics = ppo_clip(old + np.log(ratio), old, adv, mask, clip_ratio_low=0.2,
                           clip_ratio_high=0.28, clip_ratio_c=None)
  np.testing.assert_allclose(loss[1, 1], 4.0, atol=1e-5)
  assert metrics["clip_frac_lower"] == 0


def test_value_loss_golden():
  # cliprange 0.5: v_clip = clip(v, old - .5, old + .5); loss = .5 max((v-R)^2, (v_clip-R)^2)
  #  v=1, old=.8, R=2:   v_clip = 1,   (1)^2, (1)^2         -> 0.5
  #  v=2, old=.5, R=1.5: v_clip = 1,   .25, .25             -> 0.125
  #  v=2, old=.5, R=0:   v_clip = 1,   4, 1                 -> 2.0
  #  v=0, old=1,  R=1:   v_clip = .5,  1, .25               -> 0.5
  #  v=3, old=1,  R=4:   v_clip = 1.5, 1, 6.25              -> 3.125  clipped term wins
  v = np.array([[1, 2, 2, 0, 3, 9.0]])
  old = np.array([[.8, .5, .5, 1, 1, 0.0]])
  ret = np.array([[2, 1.5, 0, 1, 4, 0.0]])
  mask = np.array([[1, 1, 1, 1, 1, 0]], bool)
  loss, metrics = jax.jit(losses.value_loss)(v, old, ret, mask, cliprange_value=0.5)
  np.testing.assert_allclose(loss, [[0.5, 0.125, 2.0, 0.5, 3.125, 0]], atol=1e-6)
  np.testing.assert_allclose(metrics["vf_clip_frac"], 1 / 5, atol=1e-6)


def _entropy(logits):
  """The entropy the update trains with, of the distribution at each position: [B, L, V] ->
  [B, L - 1] (the last position predicts no token of the row)."""
  tokens = jnp.zeros(logits.shape[:2], jnp.int32)
  return jax.jit(token_logprobs_and_entropy)(jnp.asarray(logits), tokens)[1][:, 1:]


def test_entropy_golden():
  logits = jnp.array([[[0.0, 0.0, 0.0, 0.0],            # uniform over 4: ln 4
                       [1000.0, 1000.0, -1000.0, -1000.0],  # huge logits: ln 2, no overflow
                       [math.log(3), 0.0, -1e4, -1e4],  # p = 3/4, 1/4
                       [0.0, 0.0, 0.0, 0.0]]])          # predicts nothing
  h34 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
  np.testing.assert_allclose(_entropy(logits), [[math.log(4), math.log(2), h34]], atol=1e-6)


def test_entropy_matches_reference():
  z = np.random.default_rng(0).normal(scale=3.0, size=(3, 5, 11))
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_allclose(_entropy(z.astype(np.float32)), -(p * np.log(p)).sum(-1)[:, :-1],
                             atol=1e-5)


def test_kl_golden():
  # logp = -1, ref = -2: k1 = 1, |k1| = 1, k2 = .5 * 1 = .5, k3: d = ref - logp = -1,
  # e^-1 - (-1) - 1 = e^-1.
  logp, ref = jnp.array([[-1.0]]), jnp.array([[-2.0]])
  want = {"k1": 1.0, "kl": 1.0, "abs": 1.0, "k2": 0.5, "mse": 0.5, "k3": math.exp(-1),
          "low_var_kl": math.exp(-1)}
  for kind, value in want.items():
    np.testing.assert_allclose(KL_ESTIMATORS[kind](logp, ref), [[value]], atol=1e-6)
  # Clamps: d = -30 -> -20: e^-20 + 20 - 1 ~ 19 -> 10; d = +30 -> 20: e^20 - 21 -> 10.
  np.testing.assert_allclose(KL_ESTIMATORS["low_var_kl"](jnp.array([0.0, -30.0]),
                                                         jnp.array([-30.0, 0.0])), [10, 10])


def test_kl_in_reward_golden():
  # beta = 0.5, k1 = logp - ref = [0.2, -0.4, 1.0(obs), 0.6]; obs token keeps its reward.
  rewards = np.array([[0.0, 0.0, 0.0, 1.0]])
  logp = np.array([[-1.0, -2.0, -3.0, -0.5]])
  ref = np.array([[-1.2, -1.6, -4.0, -1.1]])
  mask = np.array([[1, 1, 0, 1]], bool)
  new, kl = jax.jit(losses.kl_in_reward)(rewards, logp, ref, mask, beta=0.5)
  np.testing.assert_allclose(kl, [[0.2, -0.4, 0.0, 0.6]], atol=1e-6)
  np.testing.assert_allclose(new, [[-0.1, 0.2, 0.0, 1.0 - 0.3]], atol=1e-6)


AGG_LOSS = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, np.nan]], np.float32)
AGG_MASK = np.array([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], bool)   # row 2 has no agent token


@pytest.mark.parametrize("mode,want", [
    ("token-mean", (1 + 2 + 5 + 6 + 7) / 5),                 # 21 / 5 agent tokens = 4.2
    ("seq-mean-token-sum", (3 + 18) / 2),                   # row sums 3, 18 over 2 rows
    ("seq-mean-token-mean", (3 / 2 + 18 / 3) / 2),          # row means 1.5, 6 -> 3.75
    ("seq-mean-token-sum-norm", (3 / 4 + 18 / 4) / 2),      # row sums / L=4, mean over rows
])
def test_aggregate_golden(mode, want):
  # The empty row (with a NaN under the mask) neither counts nor poisons the result.
  np.testing.assert_allclose(losses.aggregate(AGG_LOSS, AGG_MASK, mode), want, atol=1e-6)


def test_aggregate_norm_override():
  den = losses.aggregation_denominator(AGG_MASK, "seq-mean-token-sum-norm", norm=10)
  np.testing.assert_allclose(den, 2 * 10)
  np.testing.assert_allclose(losses.aggregate(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm", den),
                             21 / 20, atol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_rows_of_one_sequence_aggregate_as_the_sequence(mode):
  # Row 1 of AGG_LOSS cut into two rows (its turns, as a history window trains them): with
  # seq_tokens, the agent tokens of their sequence, the loss is that of the whole rows.
  split_loss = np.array([[1, 2, 3, 4], [5, 6, 0, 0], [0, 0, 7, 8]], np.float32)
  split_mask = np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0]], bool)
  seq_tokens = np.array([2, 3, 3], np.float32)
  den = losses.aggregation_denominator(split_mask, mode, seq_tokens=seq_tokens)
  np.testing.assert_allclose(losses.aggregate(split_loss, split_mask, mode, den, seq_tokens),
                             losses.aggregate(AGG_LOSS, AGG_MASK, mode), atol=1e-6)


# ------------------------------------------------------------- parity with per-token loops


def test_ppo_clip_and_value_loss_match_loop():
  rng = np.random.default_rng(1)
  mask = random_mask(rng, 10, 30)
  old = rng.normal(-2, 1, size=mask.shape)
  logp = old + rng.normal(0, 0.5, size=mask.shape)
  adv = rng.normal(size=mask.shape)
  lo, hi, c = 0.2, 0.28, 3.0
  want = np.zeros(mask.shape)
  for b, t in zip(*np.nonzero(mask)):
    ratio = math.exp(logp[b, t] - old[b, t])
    loss = max(-adv[b, t] * ratio, -adv[b, t] * min(max(ratio, 1 - lo), 1 + hi))
    want[b, t] = min(loss, -adv[b, t] * c) if adv[b, t] < 0 else loss
  got, _ = jax.jit(losses.ppo_clip)(logp, old, adv, mask, clip_ratio_low=lo,
                                    clip_ratio_high=hi, clip_ratio_c=c)
  np.testing.assert_allclose(got, want, atol=1e-6)

  v, v_old, ret = (rng.normal(size=mask.shape) for _ in range(3))
  want = np.zeros(mask.shape)
  for b, t in zip(*np.nonzero(mask)):
    clipped = min(max(v[b, t], v_old[b, t] - 0.3), v_old[b, t] + 0.3)
    want[b, t] = 0.5 * max((v[b, t] - ret[b, t]) ** 2, (clipped - ret[b, t]) ** 2)
  got, _ = jax.jit(losses.value_loss)(v, v_old, ret, mask, cliprange_value=0.3)
  np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_matches_loop(mode):
  rng = np.random.default_rng(2)
  mask = random_mask(rng, 9, 17)
  loss = rng.normal(size=mask.shape)
  rows = [b for b in range(mask.shape[0]) if mask[b].any()]
  if mode == "token-mean":
    want = sum(loss[b, t] for b, t in zip(*np.nonzero(mask))) / mask.sum()
  elif mode == "seq-mean-token-mean":
    want = sum(loss[b][mask[b]].mean() for b in rows) / len(rows)
  else:
    norm = mask.shape[1] if mode == "seq-mean-token-sum-norm" else 1
    want = sum(loss[b][mask[b]].sum() / norm for b in rows) / len(rows)
  np.testing.assert_allclose(losses.aggregate(loss, mask, mode), want, atol=1e-6)


# -------------------------------------------------- exact micro-batching (values and gradients)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_sum_to_full_batch(mode, dtype):
  rng = np.random.default_rng(3)
  batch, length = 16, 24
  mask = random_mask(rng, batch, length)
  x, y = (rng.normal(size=(batch, length)).astype(dtype) for _ in range(2))
  theta = rng.normal(size=(length,)).astype(dtype)

  @jax.jit
  def loss_fn(theta, x, y, mask, den):
    return losses.aggregate(jnp.square(theta * x - y) + jnp.sin(theta) * x, mask, mode, den)

  # In float64 the identity is exact to rounding; in float32 only the summation order differs.
  tol = {"atol": 1e-6} if dtype == np.float64 else {"rtol": 1e-6, "atol": 1e-6}
  with jax.enable_x64(dtype == np.float64):
    den = losses.aggregation_denominator(mask, mode)
    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))
    full, full_grad = value_and_grad(theta, x, y, mask, den)
    parts = [value_and_grad(theta, x[k:k + 4], y[k:k + 4], mask[k:k + 4], den)
             for k in range(0, batch, 4)]
    np.testing.assert_allclose(sum(p[0] for p in parts), full, **tol)
    np.testing.assert_allclose(sum(p[1] for p in parts), full_grad, **tol)
    # The full batch without an explicit denominator is the same number.
    np.testing.assert_allclose(loss_fn(theta, x, y, mask, None), full, **tol)
    # Per-micro-batch denominators (the mean-of-means mistake) would not be exact.
    naive = sum(loss_fn(theta, x[k:k + 4], y[k:k + 4], mask[k:k + 4], None)
                for k in range(0, batch, 4)) / 4
    assert abs(float(naive) - float(full)) > 1e-3


# ------------------------------------------------------------------------------ jit hygiene


def test_no_recompile_when_values_change():
  traces = []

  @jax.jit
  def step(logp, old, adv, mask, v, v_old, ret, ref, low, high, c, cv, beta):
    traces.append(None)
    pg, metrics = POLICY_LOSSES["ppo_clip"](logp, old, adv, mask, clip_ratio_low=low,
                                            clip_ratio_high=high, clip_ratio_c=c)
    vf, _ = losses.value_loss(v, v_old, ret, mask, cliprange_value=cv)
    loss_mat = pg + vf + beta * losses.kl_penalty(logp, ref, mask, "low_var_kl")
    return [losses.aggregate(loss_mat, mask, mode) for mode in LOSS_AGG_MODES], metrics

  rng = np.random.default_rng(4)
  for k in range(3):
    mask = random_mask(rng, 6, 13)
    arrays = [rng.normal(size=mask.shape).astype(np.float32) for _ in range(7)]
    jax.block_until_ready(step(arrays[0], arrays[1], arrays[2], mask, *arrays[3:],
                               0.2 + k / 100, 0.28, 3.0 + k, 0.5, 0.01 * k))
  assert len(traces) == 1


# ------------------------------------------------------------------------------- bad input


def test_bad_input_errors():
  a = np.zeros((2, 5))
  with pytest.raises(ValueError, match="share one"):
    losses.ppo_clip(a, a, np.zeros((2, 4)), a)
  with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
    losses.ppo_clip(a, a, a, a, clip_ratio_c=0.5)
  with pytest.raises(ValueError, match="share one"):
    losses.value_loss(a, a, a, np.zeros((5,)))
  with pytest.raises(ValueError, match="unknown loss aggregation mode"):
    losses.aggregate(a, a, "token_mean")
  with pytest.raises(ValueError, match="unknown loss aggregation mode"):
    losses.aggregation_denominator(a, "seq-mean")
  with pytest.raises(ValueError, match="must share one"):
    losses.aggregate(a, np.zeros((2, 6)), "token-mean")
  with pytest.raises(KeyError, match="registered: .*low_var_kl"):
    losses.kl_penalty(a, a, a, "k4")
  with pytest.raises(KeyError, match="registered: .*ppo_clip"):
    POLICY_LOSSES["ppo"]  # pylint: disable=pointless-statement
  with pytest.raises(ValueError, match="share one"):
    jax.jit(lambda x, m: losses.kl_penalty(x, x, m))(jnp.zeros((2, 5)), jnp.zeros((2, 3)))


def test_all_masked_gives_zeros():
  rng = np.random.default_rng(5)
  a, b, c = (rng.normal(size=(3, 7)) for _ in range(3))
  mask = np.zeros((3, 7), bool)
  pg, metrics = jax.jit(losses.ppo_clip)(a, b, c, mask)
  vf, vf_metrics = jax.jit(losses.value_loss)(a, b, c, mask)
  np.testing.assert_array_equal(pg, 0)
  np.testing.assert_array_equal(vf, 0)
  for value in [*metrics.values(), *vf_metrics.values()]:
    assert value == 0
  for mode in LOSS_AGG_MODES:
    assert losses.aggregate(pg, mask, mode) == 0
    grad = jax.jit(jax.grad(lambda z, mode=mode: losses.aggregate(z, mask, mode)))(a)
    np.testing.assert_array_equal(grad, 0)
