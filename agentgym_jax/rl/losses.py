"""Policy, value, entropy and KL terms as token matrices, and their aggregation to a scalar.

A loss is built in two steps, so that splitting a mini-batch into micro-batches is exact:

1. Token terms, each [B, L] and 0 where mask is 0: `POLICY_LOSSES[name](...)` (PPO clip, or
   the cross-entropy of behaviour cloning),
   `value_loss`, `KL_ESTIMATORS[kind]` / `kl_penalty`; the entropy comes with the log-probs
   (`rl.logprobs.token_logprobs_and_entropy`). The trainer combines them, e.g.
   `pg + kl_coef * kl - entropy_coef * entropy`.
2. `aggregate(loss_mat, mask, mode, denominator)`, with the denominator computed ONCE over the
   whole mini-batch by `aggregation_denominator(mask, mode)`. Every mode is a sum over rows of a
   per-row quantity divided by that denominator, so for micro-batches that partition the rows

     Σ_k aggregate(loss_k, mask_k, mode, den) == aggregate(loss, mask, mode, den)

   exactly, and so are the gradients (the trainer sums micro-batch gradients, no rescaling).

Shapes: B rows (episodes), L tokens, V vocabulary. `mask` [B, L] is 1 on agent tokens.

A "sequence" of the seq-* modes is an episode. Where one episode is cut into several rows
(the per-turn rows of a history window, rollout/window.py), `seq_tokens` [B] gives each row the
agent-token count of its episode: a row then counts as the share n_row / seq_tokens of a
sequence, and seq-mean-token-mean divides its token sum by seq_tokens, so the loss of an
episode's rows together is that of its packed row. Default: every row is a sequence of its own.
Semantics follow verl (`core_algos.py`: `compute_policy_loss_vanilla`, `compute_value_loss`,
`kl_penalty`, `agg_loss`); differences are stated where they occur.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentgym_jax.rl.advantages import masked_mean
from agentgym_jax.rl.registry import Registry

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")

# log-ratio clamp before exp (verl): keeps the ratio finite when the policy has moved far.
_LOG_RATIO_CLAMP = 20.0

# name -> fn(log_prob, old_log_prob, advantages, mask, **hparams) -> (loss [B, L], metrics).
POLICY_LOSSES: Registry = Registry("policy loss")
# name -> fn(log_prob [B, L], ref_log_prob [B, L]) -> per-token KL estimate [B, L].
KL_ESTIMATORS: Registry = Registry("KL estimator")


def _check_same_shape(name: str, **arrays) -> None:
  shapes = {k: jnp.shape(v) for k, v in arrays.items()}
  if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
    raise ValueError(f"{name}: all inputs must share one [B, L] shape, got {shapes}")


def _float(x) -> jax.Array:
  """As an array of at least float32 precision (bfloat16 -> float32, float64 stays)."""
  x = jnp.asarray(x)
  return x.astype(jnp.result_type(x.dtype, jnp.float32))


def _is_concrete(x) -> bool:
  return isinstance(x, (int, float))


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(log_prob: jax.Array, old_log_prob: jax.Array, advantages: jax.Array,
             mask: jax.Array, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
             clip_ratio_c: float | None = 3.0) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped PPO surrogate (Schulman et al. 2017) with asymmetric and dual clip (Ye et al. 2020).

    ρ = exp(clamp(logπ - logπ_old, ±20))
    l1 = -A ρ,   l2 = -A clip(ρ, 1 - clip_ratio_low, 1 + clip_ratio_high),   l = max(l1, l2)
    dual clip, for A < 0 only:   l = min(l, -A clip_ratio_c)

  Args:
    log_prob: [B, L] log-probabilities of the sampled tokens under the current policy.
    old_log_prob: [B, L] the same under the policy that sampled them (or the rollout sampler).
    advantages: [B, L] from `advantages.ESTIMATORS`.
    mask: [B, L] 1 on agent tokens.
    clip_ratio_low, clip_ratio_high: clip range [1 - low, 1 + high] (DAPO's clip-higher when
      high > low).
    clip_ratio_c: dual-clip bound (> 1) capping the loss of negative-advantage tokens whose
      ratio has exploded; None disables it.
  Returns:
    (loss [B, L] float32, 0 where mask is 0; metrics of masked means over this batch:
    `clip_frac` (tokens where the clipped term won), `clip_frac_lower` (dual clip active),
    `approx_kl` (mean of logπ_old - logπ, verl's ppo_kl)).
  """
  _check_same_shape("ppo_clip", log_prob=log_prob, old_log_prob=old_log_prob,
                    advantages=advantages, mask=mask)
  if _is_concrete(clip_ratio_c) and clip_ratio_c <= 1.0:
    raise ValueError(f"ppo_clip: clip_ratio_c must be > 1 (or None to disable the dual clip), "
                     f"got {clip_ratio_c}")
  mask = jnp.asarray(mask).astype(bool)
  # Gradients flow through log_prob only: advantages and the behaviour policy are data.
  advantages = jax.lax.stop_gradient(_float(advantages))
  old_log_prob = jax.lax.stop_gradient(old_log_prob)
  log_ratio = jnp.clip(_float(log_prob) - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
  ratio = jnp.exp(log_ratio)
  loss1 = -advantages * ratio
  loss2 = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
  loss = jnp.maximum(loss1, loss2)
  metrics = {"clip_frac": masked_mean(loss2 > loss1, mask),
             "approx_kl": masked_mean(-log_ratio, mask)}
  if clip_ratio_c is None:
    metrics["clip_frac_lower"] = jnp.zeros((), jnp.float32)
  else:
    loss3 = -advantages * clip_ratio_c
    dual = (advantages < 0) & (loss > loss3)
    metrics["clip_frac_lower"] = masked_mean(dual, mask)
    loss = jnp.where(advantages < 0, jnp.minimum(loss, loss3), loss)
  return jnp.where(mask, loss, 0.0), metrics


def tis_weights(old_log_prob: jax.Array, rollout_log_prob: jax.Array, mask: jax.Array,
                cap: float) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Truncated importance-sampling weights for the rollout/training mismatch (TIS).

    w_t = min(exp(logπ_old(t) - logπ_rollout(t)), C)

  π_old is the trainer's forward pass at the start of the update (the policy the surrogate's
  ratio is taken against), π_rollout the sampler's log-probs of the same tokens (another
  kernel, precision or cache: not the same numbers). Multiplying each token's policy-gradient
  loss by w_t (data, no gradient) corrects the expectation to the trainer's policy, and the cap
  C bounds the variance (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl; verl's
  `tis_imp_ratio_cap`, volcengine/verl PR #2953, applied after the clip and dual clip).

  Args:
    old_log_prob: [B, L] log-probs under the trainer at the start of the update.
    rollout_log_prob: [B, L] the sampler's log-probs of the same tokens.
    mask: [B, L] 1 on agent tokens.
    cap: C > 0.
  Returns:
    (weights [B, L] float32, 0 where mask is 0; metrics of masked means: `tis_weight`, the
    mean weight, and `tis_capped`, the fraction of tokens whose weight the cap set).
  """
  _check_same_shape("tis_weights", old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob,
                    mask=mask)
  if _is_concrete(cap) and cap <= 0:
    raise ValueError(f"tis_weights: cap must be > 0, got {cap}")
  mask = jnp.asarray(mask).astype(bool)
  log_ratio = jax.lax.stop_gradient(_float(old_log_prob) - _float(rollout_log_prob))
  log_cap = jnp.log(jnp.asarray(cap, log_ratio.dtype))
  # exp(min(x, log C)) = min(e^x, C) without overflowing for a large x.
  weights = jnp.where(mask, jnp.exp(jnp.minimum(log_ratio, log_cap)), 0.0)
  return weights, {"tis_weight": masked_mean(weights, mask),
                   "tis_capped": masked_mean(log_ratio >= log_cap, mask)}


@POLICY_LOSSES.register("cross_entropy")
def cross_entropy(log_prob: jax.Array, old_log_prob: jax.Array, advantages: jax.Array,
                  mask: jax.Array, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                  clip_ratio_c: float | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Behaviour cloning: the negative log-likelihood -logπ(token) of every agent token.

  The demonstrations' tokens are the targets, so the sampler's log-probs, the advantages and
  the clip range of `ppo_clip`'s signature play no part (they are accepted so that both losses
  are called alike).

  Args:
    log_prob: [B, L] log-probabilities of the demonstrated tokens under the current policy.
    old_log_prob, advantages: [B, L], unused.
    mask: [B, L] 1 on agent tokens (the expert's replies and their end-of-turn tokens).
  Returns:
    (loss [B, L] float32, 0 where mask is 0; metrics: `nll`, the masked mean of the loss, and
    `token_prob`, the masked mean probability of the demonstrated token).
  """
  del old_log_prob, advantages, clip_ratio_low, clip_ratio_high, clip_ratio_c
  mask = jnp.asarray(mask).astype(bool)
  nll = -_float(log_prob)
  metrics = {"nll": masked_mean(nll, mask), "token_prob": masked_mean(jnp.exp(-nll), mask)}
  return jnp.where(mask, nll, 0.0), metrics


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, mask: jax.Array, *,
               cliprange_value: float = 0.5) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped value loss (PPO; verl's `compute_value_loss`).

    v_clip = clip(v, v_old - c, v_old + c),   loss = 0.5 max((v - R)², (v_clip - R)²)

  Args:
    values: [B, L] current critic predictions.
    old_values: [B, L] critic predictions at rollout time (those GAE used).
    returns: [B, L] targets (`gae`'s returns).
    mask: [B, L] 1 on agent tokens.
    cliprange_value: c above.
  Returns:
    (loss [B, L] float32, 0 where mask is 0 — the 0.5 is inside, verl applies it after
    aggregation, same value; metrics {`vf_clip_frac`}: masked mean of tokens where the clipped
    term won).
  """
  _check_same_shape("value_loss", values=values, old_values=old_values, returns=returns,
                    mask=mask)
  mask = jnp.asarray(mask).astype(bool)
  values = _float(values)
  old_values, returns = jax.lax.stop_gradient((old_values, returns))
  clipped = jnp.clip(values, old_values - cliprange_value, old_values + cliprange_value)
  loss1 = jnp.square(values - returns)
  loss2 = jnp.square(clipped - returns)
  loss = 0.5 * jnp.maximum(loss1, loss2)
  return jnp.where(mask, loss, 0.0), {"vf_clip_frac": masked_mean(loss2 > loss1, mask)}


@KL_ESTIMATORS.register("k1", "kl")
def kl_k1(log_prob: jax.Array, ref_log_prob: jax.Array) -> jax.Array:
  """k1 = logπ - logπ_ref (unbiased for KL(π||π_ref) under samples of π; can be negative)."""
  return _float(log_prob) - ref_log_prob


@KL_ESTIMATORS.register("abs")
def kl_abs(log_prob: jax.Array, ref_log_prob: jax.Array) -> jax.Array:
  """|logπ - logπ_ref|."""
  return jnp.abs(kl_k1(log_prob, ref_log_prob))


@KL_ESTIMATORS.register("k2", "mse")
def kl_k2(log_prob: jax.Array, ref_log_prob: jax.Array) -> jax.Array:
  """k2 = ½ (logπ - logπ_ref)² (Schulman, "Approximating KL divergence", 2020)."""
  return 0.5 * jnp.square(kl_k1(log_prob, ref_log_prob))


@KL_ESTIMATORS.register("low_var_kl", "k3")
def kl_low_var(log_prob: jax.Array, ref_log_prob: jax.Array) -> jax.Array:
  """k3 = e^d - d - 1, d = logπ_ref - logπ clamped to ±20, result clamped to [-10, 10] (verl).

  Non-negative and unbiased for KL(π||π_ref); the clamps bound it where the policies disagree
  wildly (the lower clamp never binds since k3 >= 0; kept to mirror verl).
  """
  d = jnp.clip(_float(ref_log_prob) - log_prob, -20.0, 20.0)
  return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)


def kl_penalty(log_prob: jax.Array, ref_log_prob: jax.Array, mask: jax.Array,
               kind: str = "low_var_kl") -> jax.Array:
  """Per-token KL estimate to the reference policy, [B, L] float32, 0 where mask is 0.

  Use in the loss (`loss_mat += kl_coef * kl_penalty(log_prob, ref_log_prob, mask)`, then
  aggregate) or in the reward (`kl_in_reward`). `kind` names an entry of `KL_ESTIMATORS`.
  """
  _check_same_shape("kl_penalty", log_prob=log_prob, ref_log_prob=ref_log_prob, mask=mask)
  kl = KL_ESTIMATORS[kind](log_prob, jax.lax.stop_gradient(ref_log_prob))
  return jnp.where(jnp.asarray(mask).astype(bool), kl, 0.0)


def kl_in_reward(rewards: jax.Array, log_prob: jax.Array, ref_log_prob: jax.Array,
                 mask: jax.Array, *, beta: float, kind: str = "k1"
                 ) -> tuple[jax.Array, jax.Array]:
  """PPO-style in-reward KL: r_t - β KL_t on agent tokens (verl's `apply_kl_penalty`).

  Args:
    rewards: [B, L] token rewards (outcome on the last agent token).
    log_prob: [B, L] log-probabilities under the rollout policy (no gradient flows here).
    ref_log_prob: [B, L] the same under the reference policy.
    mask: [B, L] 1 on agent tokens.
    beta: KL coefficient.
    kind: entry of `KL_ESTIMATORS` (verl's `algorithm.kl_penalty`, default k1).
  Returns:
    (rewards [B, L] with the penalty subtracted on agent tokens, kl [B, L] for logging).
  """
  _check_same_shape("kl_in_reward", rewards=rewards, log_prob=log_prob,
                    ref_log_prob=ref_log_prob, mask=mask)
  kl = jax.lax.stop_gradient(kl_penalty(log_prob, ref_log_prob, mask, kind))
  return _float(rewards) - beta * kl, kl


def _check_mode(mode: str) -> None:
  """The guard of both aggregation functions (configs are checked by `algorithm.AlgorithmSpec`)."""
  if mode not in LOSS_AGG_MODES:
    raise ValueError(f"unknown loss aggregation mode {mode!r}; use one of {LOSS_AGG_MODES}")


def aggregation_denominator(mask: jax.Array, mode: str, *, norm: float | None = None,
                            seq_tokens: jax.Array | None = None) -> jax.Array:
  """The global denominator of `aggregate`, from the mask of the WHOLE mini-batch.

    token-mean               number of agent tokens
    seq-mean-token-sum       number of sequences: rows with at least one agent token
    seq-mean-token-mean      number of sequences
    seq-mean-token-sum-norm  number of sequences × norm

(with `seq_tokens`, the number of sequences is Σ_rows n_row / seq_tokens).

  Rows without agent tokens (padding rows, filtered episodes) are not counted, as in verl's
  global-batch accounting. Each count is at least 1, so an all-masked batch aggregates to 0.

  Args:
    mask: [B, L] 1 on agent tokens, the whole mini-batch (all micro-batches together).
    mode: one of `LOSS_AGG_MODES`.
    norm: the constant per-row token normaliser of `seq-mean-token-sum-norm` (Dr.GRPO's
      MAX_TOKENS); default L, the padded length. Ignored by the other modes.
    seq_tokens: [B] agent tokens of each row's sequence (see the module docstring); default
      each row's own.
  Returns:
    scalar float32.
  """
  _check_mode(mode)
  mask = jnp.asarray(mask).astype(bool)
  if mask.ndim != 2:
    raise ValueError(f"aggregation_denominator: mask must be [B, L], got shape {mask.shape}")
  if mode == "token-mean":
    count = jnp.sum(mask, dtype=jnp.float32)
  elif seq_tokens is None:
    count = jnp.sum(jnp.any(mask, axis=1), dtype=jnp.float32)
  else:
    count = jnp.sum(jnp.sum(mask, axis=1, dtype=jnp.float32) / jnp.maximum(seq_tokens, 1.0))
  count = jnp.maximum(count, 1.0)
  if mode == "seq-mean-token-sum-norm":
    count = count * (mask.shape[1] if norm is None else norm)
  return count


def aggregate(loss_mat: jax.Array, mask: jax.Array, mode: str,
              denominator: jax.Array | float | None = None,
              seq_tokens: jax.Array | None = None) -> jax.Array:
  """Reduces a token loss [B, L] to a scalar: (Σ_rows per-row term) / denominator.

    token-mean, seq-mean-token-sum, seq-mean-token-sum-norm:  per-row term = Σ_t m_t l_t
    seq-mean-token-mean:  per-row term = Σ_t m_t l_t / Σ_t m_t   (a row lies in one micro-batch;
                          with `seq_tokens`, / seq_tokens[row])

  With `denominator = aggregation_denominator(full_mask, mode)` the modes mean, over the mini-batch:
  token-mean = mean over agent tokens; seq-mean-token-sum = mean over rows of the token sum;
  seq-mean-token-mean = mean over rows of the row's token mean; seq-mean-token-sum-norm = mean over
  rows of the token sum / norm (Dr.GRPO, Liu et al. 2025: 1/G Σ_i 1/MAX_TOKENS Σ_t). verl's branch
  of that name omits the mean over rows, which ties the loss scale to the batch size; ours is
  verl's value divided by the row count.

  Args:
    loss_mat: [B, L] token losses; values where mask is 0 are ignored (even NaN).
    mask: [B, L] 1 on agent tokens of this (micro-)batch.
    mode: one of `LOSS_AGG_MODES`.
    denominator: from `aggregation_denominator` over the whole mini-batch; None computes it from
      `mask`, i.e. this batch is the whole mini-batch.
    seq_tokens: [B] agent tokens of each row's sequence; default each row's own.
  Returns:
    scalar float32.
  """
  _check_mode(mode)
  if jnp.shape(loss_mat) != jnp.shape(mask) or jnp.ndim(mask) != 2:
    raise ValueError(f"aggregate: loss_mat {jnp.shape(loss_mat)} and mask {jnp.shape(mask)} must "
                     "share one [B, L] shape")
  mask = jnp.asarray(mask).astype(bool)
  if denominator is None:
    denominator = aggregation_denominator(mask, mode, seq_tokens=seq_tokens)
  masked = jnp.where(mask, _float(loss_mat), 0.0)
  if mode == "seq-mean-token-mean":
    row_tokens = jnp.sum(mask, axis=1, dtype=masked.dtype) if seq_tokens is None else seq_tokens
    row_tokens = jnp.maximum(row_tokens.astype(masked.dtype), 1.0)
    total = jnp.sum(jnp.sum(masked, axis=1) / row_tokens)
  else:
    total = jnp.sum(masked)
  return total / denominator

