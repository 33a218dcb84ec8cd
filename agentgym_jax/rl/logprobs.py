"""Log-probabilities and entropies of sampled tokens, the inputs of every loss in rl/losses.py.

Alignment: logits at position t predict token t + 1, so the scores are shifted to sit on the
token they score: `logprobs[:, t] = log π(tokens[t] | tokens[<t])`, and the entropy at t is that
of the distribution token t was drawn from. Position 0 is never an agent token and gets 0.

Both come from one logsumexp over the logits with a closed-form gradient (`_logprob_entropy`):
passes over the [B, L, V] logits dominate the memory traffic of a small model's update, and
differentiating a log-softmax, a gather and an entropy pass would make several.
`head_logprobs_and_entropy` runs the LM head over blocks of positions, so the [B, L, V] logits
of a long row and a large vocabulary never exist at once, and given the positions the loss
reads (the agent tokens), over those only: the other positions of its [B, L] results are 0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

# Logits of one block of `head_logprobs_and_entropy`'s LM head: 2^24 float32 (64 MiB). The
# backward holds about three blocks at once (the recomputed logits, their exponentials and
# their gradient), so the block size, not the row's length, sets the head's share of the peak.
_LOGIT_BLOCK = 1 << 24


def shift_right(x: jax.Array) -> jax.Array:
  """[B, L-1] scores of tokens 1..L-1 (or values of states 0..L-2) -> [B, L] aligned with the
  tokens (0 at position 0)."""
  return jnp.pad(x, ((0, 0), (1, 0)))


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0
                   ) -> jax.Array:
  """log π(tokens[t] | tokens[<t]) at temperature: logits [B, L, V], tokens [B, L] -> [B, L].

  The log-prob half of `token_logprobs_and_entropy` (the unused entropy is compiled away).
  """
  return token_logprobs_and_entropy(logits, tokens, temperature)[0]


def token_logprobs_and_entropy(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0
                               ) -> tuple[jax.Array, jax.Array]:
  """`token_logprobs`, and the entropy of the distribution each token was drawn from, in one
  pass over the logits: logits [B, L, V], tokens [B, L] -> two [B, L] float32."""
  logp, entropy = _logprob_entropy(logits[:, :-1], tokens[:, 1:], temperature)
  return shift_right(logp), shift_right(entropy)


def head_logprobs_and_entropy(hidden: jax.Array, tokens: jax.Array,
                              head: Callable[[jax.Array], jax.Array], temperature: float = 1.0,
                              positions: jax.Array | None = None
                              ) -> tuple[jax.Array, jax.Array]:
  """`token_logprobs_and_entropy` of the logits `head(hidden)`, computed without the
  [B, L, V] logits existing at once when they are larger than `_LOGIT_BLOCK` elements, and
  with `positions` only at those positions.

  The LM head and the log-softmax then run over blocks of positions in a loop whose body is
  rematerialised, so the backward pass recomputes one block's logits at a time instead of
  keeping them all (one 12,288-token row of a 152k vocabulary has 7 GiB of float32 logits).
  With `positions` the head runs on P positions a row instead of L - 1: the loss reads the
  agent tokens only, often a tenth of a row, and the head is a fifth of a small model's
  matmuls. The scores of a position are the same ops on the same hidden state either way.

  Args:
    hidden: [B, L, D] the final hidden states of tokens [B, L].
    tokens: [B, L] int.
    head: [..., D] -> [..., V] logits (the decoder's `logits_from_hidden`).
    temperature: of the distribution the tokens were sampled from.
    positions: [B, P] int, the positions to score in each row (`train.update.scored_positions`:
      its agent tokens, padded with 0), or None for every position. Position 0 scores nothing
      (no logits precede it), and neither does an index outside [0, L).
  Returns:
    log-probs and entropies, two [B, L] float32, 0 at position 0 and, with `positions`, at
    every position not in them.
  """
  if positions is None:
    logp, entropy = _blocked_logprob_entropy(hidden[:, :-1], tokens[:, 1:], head, temperature)
    return shift_right(logp), shift_right(entropy)
  length = tokens.shape[1]
  scored = (positions > 0) & (positions < length)
  # The logits at t - 1 score the token at t; a slot that scores nothing reads position 0 and
  # writes past the row's end, which the scatter drops (so its gradient is 0 too).
  source = jnp.where(scored, positions, 0)
  target = jnp.where(scored, positions, length)
  gather = jax.vmap(lambda row, index: row[index])
  logp, entropy = _blocked_logprob_entropy(
      gather(hidden, jnp.maximum(source - 1, 0)), gather(tokens, source), head, temperature)
  place = jax.vmap(lambda x, index: jnp.zeros(length, x.dtype).at[index].add(x, mode="drop"))
  return place(logp, target), place(entropy, target)


def _blocked_logprob_entropy(hidden: jax.Array, targets: jax.Array,
                             head: Callable[[jax.Array], jax.Array], temperature: float
                             ) -> tuple[jax.Array, jax.Array]:
  """`_logprob_entropy` of `head(hidden)`: hidden [B, N, D], targets [B, N] -> two [B, N], the
  head run over rematerialised blocks of positions when its [B, N, V] logits are larger than
  `_LOGIT_BLOCK`."""
  b, n, d = hidden.shape
  vocab = jax.eval_shape(head, hidden[:1, :1]).shape[-1]
  blocks = -(-(b * n * vocab) // _LOGIT_BLOCK)
  if blocks <= 1:
    return _logprob_entropy(head(hidden), targets, temperature)
  size = -(-n // blocks)
  pad = blocks * size - n  # padded positions score token 0 and are cut off below
  hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, blocks, size, d)
  targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, blocks, size)

  @jax.checkpoint
  def block(h_t):
    return _logprob_entropy(head(h_t[0]), h_t[1], temperature)

  logp, entropy = jax.lax.map(block, (hidden.swapaxes(0, 1), targets.swapaxes(0, 1)))
  unblock = lambda x: x.swapaxes(0, 1).reshape(b, blocks * size)[:, :n]
  return unblock(logp), unblock(entropy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _logprob_entropy(logits: jax.Array, tokens: jax.Array, temperature: float
                     ) -> tuple[jax.Array, jax.Array]:
  """log p(token) and entropy H of p = softmax(logits / temperature): [..., V], [...] -> [...].

  The model's logits are finite, so 0 · log 0 never arises.
  """
  return _logprob_entropy_fwd(logits, tokens, temperature)[0]


def _logprob_entropy_fwd(logits, tokens, temperature):
  x = logits.astype(jnp.float32) / temperature
  # Shifted by the max (<= 0), so H = log Σ e - Σ e · shifted / Σ e loses no digits to
  # cancelling two large terms.
  top = jnp.max(x, axis=-1, keepdims=True)
  shifted = x - top
  e = jnp.exp(shifted)
  total = jnp.sum(e, axis=-1)
  log_total = jnp.log(total)
  entropy = log_total - jnp.sum(e * shifted, axis=-1) / total
  logp = jnp.take_along_axis(shifted, tokens[..., None], axis=-1)[..., 0] - log_total
  return (logp, entropy), (logits, tokens, top[..., 0] + log_total, entropy)


def _logprob_entropy_bwd(temperature, residuals, cotangents):
  # d logp / dx = onehot - p and dH / dx = -p (log p + H), for x = logits / temperature.
  logits, tokens, lse, entropy = residuals
  g_logp, g_entropy = cotangents
  log_p = logits.astype(jnp.float32) / temperature - lse[..., None]
  p = jnp.exp(log_p)
  onehot = tokens[..., None] == jnp.arange(logits.shape[-1])
  g_x = (g_logp[..., None] * (onehot - p)
         - g_entropy[..., None] * p * (log_p + entropy[..., None]))
  return (g_x / temperature).astype(logits.dtype), None


_logprob_entropy.defvjp(_logprob_entropy_fwd, _logprob_entropy_bwd)
