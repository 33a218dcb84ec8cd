"""Jitted sampling against a live KV cache: extend (prefill) and a per-turn decode loop.

The two compiled programs of a rollout:

* `extend(graphdef, state, cache, logits, tokens, num_new)` appends a right-padded chunk
  [B, T] to every row of the cache at that row's own fill level (prefill of the opening, or
  the observation that follows a turn) and returns the next-token logits of each row.
* `decode(graphdef, state, cache, logits, turn, caps, end_ids, sampling)` samples the running
  rows' turns inside ONE `lax.while_loop`: sample, feed the token back, repeat until every row
  has produced an end-of-turn token or reached its cap.

`decode` takes and returns a `Turn`, each row's progress through its turn: which rows sample,
with which keys, and what they have sampled.

Both run the model's own cached forward (`Decoder.extend`) on its `models.KVCache`: the
sampler adds sampling and stopping, no attention or cache code of its own.

Static shapes: the caller splits chunks into bucketed lengths T (`chunk_pieces`) and the cache
length (`cache_bucket`: 256, 512, 1024, ..., `KVCache.grow` pads the cache to the next
one when the rows need it; a cache allocated at the context limit is bounded to that bucket
instead, `KVCache.with_live`), so a run compiles each program a handful of times. Decoding a
small model is bound by reading the cache: rows holding 300 tokens should not read a 4096-slot
buffer at every step.

Both donate the cache, so XLA updates it in place.

The last token a row samples (its end-of-turn token, or the token that hit the cap) is NOT fed
to the cache by `decode`: it becomes the first token of the row's next `extend` chunk. That
saves one forward step per turn and keeps "what is in the cache" equal to "what precedes the
next chunk".

Log-probabilities: `sample_logprobs` is the log-probability of the sampled token under the
distribution the sampler drew it from (`sampling_logprobs`): softmax(logits / T) with top-k /
top-p applied and renormalised over the kept tokens (under softmax(logits) when greedy at
T = 0). With top-k / top-p off and T = 1 it equals the log-prob a plain forward pass gives the
same token.

Why the filtered distribution, while the trainer (`train.update`) scores the full softmax:
the sampler's log-probs describe the behaviour policy q, the trainer's the policy p it updates.
For a kept token q = p / Z, Z the kept mass, so the importance weight p / q = Z that truncated
importance sampling (`algo.tis_cap`) applies to each token is exactly the correction for
sampling from the filtered policy, and the logged mismatch |logp_rollout - logp_update| shows
how much filtering moved it (-log Z). The other choice, filtering the trainer's softmax too,
would sort or top-k the vocabulary for every trained token and put a non-differentiable cut
into the loss; full-softmax log-probs here would hide the mismatch (weights of 1 while the
samples come from q).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from agentgym_jax.models import KVCache

_NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How an agent turn is sampled (hashable: a static argument of the decode program).

  Attributes:
    temperature: softmax temperature; 0 means greedy (argmax).
    top_p: nucleus sampling; keep the smallest set of most likely tokens whose probability
      reaches top_p (1.0 = off).
    top_k: keep the k most likely tokens (0 = off).
    max_reply_tokens: per-turn cap on sampled tokens (the end-of-turn token included).
  """

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_reply_tokens: int = 256

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}.")
    if self.max_reply_tokens < 1:
      raise ValueError(f"max_reply_tokens must be >= 1, got {self.max_reply_tokens}.")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0 or self.top_k == 1


# Extend widths: 16 * 4^k (16, 64, 256, ...), and the call's cap itself when it is not one.
_MIN_CHUNK = 16


def chunk_pieces(n: int, max_piece: int = 512) -> list[tuple[int, int]]:
  """How to append `n` tokens in extend calls: (tokens, width) per call.

  Widths are 16 * 4^k below `max_piece`, and `max_piece`: each call takes the widest that its
  remaining tokens fill, and only the last (fewer than 16 tokens) is padded, to 16. A run then
  compiles extend for three or four widths per cache length (67 tokens: 64 + 3 padded to 16;
  a 1.5x ladder of widths compiled eleven, each a program of the whole model held in memory,
  freed_memory.py), and an extra call costs little next to the padding it saves: a call's
  work is its width's, and reading the weights once more is cheap beside it.
  """
  if max_piece < _MIN_CHUNK:
    raise ValueError(f"chunk_pieces: max_piece must be >= {_MIN_CHUNK}, got {max_piece}.")
  ladder = [_MIN_CHUNK]  # 16 * 4^k below max_piece
  while ladder[-1] * 4 < max_piece:
    ladder.append(ladder[-1] * 4)
  widths = [max_piece, *reversed(ladder)]  # widest first
  pieces = []
  while n > 0:
    width = next((w for w in widths if w <= n), _MIN_CHUNK)
    take = min(n, width)
    pieces.append((take, width))
    n -= take
  return pieces


def cache_bucket(n: int, max_len: int, minimum: int = 256) -> int:
  """Static cache length holding `n` tokens: a power of two from `minimum` (256, 512, 1024,
  ...), capped at `max_len` (the context limit).

  Steps of 2x: each cache length is another program of every extend width and of decode, each
  holding a whole model's code in memory; decode steps then read at most twice the slots the
  rows fill.
  """
  size = minimum
  while size < n:
    size *= 2
  return min(size, max_len)


def filter_logits(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """Temperature-scaled logits with everything outside top-k / top-p set to -1e30.

  Args:
    logits: [B, V] float32.

  Returns:
    [B, V] float32; ties at the cut-off are kept.
  """
  scaled = logits / sampling.temperature
  if sampling.top_k > 0:
    kth = jax.lax.top_k(scaled, sampling.top_k)[0][:, -1:]
    scaled = jnp.where(scaled >= kth, scaled, _NEG_INF)
  if sampling.top_p < 1.0:
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    # Probability mass strictly before each token in sorted order: keep a token while that
    # mass is below top_p, so the most likely token always survives.
    before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.sum(before < sampling.top_p, axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(ordered, kept - 1, axis=-1)
    scaled = jnp.where(scaled >= cutoff, scaled, _NEG_INF)
  return scaled


def sampling_logprobs(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """Log-probs of the distribution `sample_tokens` draws from (module docstring).

  Args:
    logits: [B, V] float32 next-token logits.

  Returns:
    [B, V] float32: log softmax(filter_logits(logits)), about -1e30 outside top-k / top-p;
    log softmax(logits) when greedy at temperature 0 (no distribution is sampled).
  """
  if sampling.temperature == 0.0:
    return jax.nn.log_softmax(logits, axis=-1)
  return jax.nn.log_softmax(filter_logits(logits, sampling), axis=-1)


def sample_tokens(logits: jax.Array, keys: jax.Array, sampling: SamplingConfig
                  ) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row.

  Args:
    logits: [B, V] float32 next-token logits.
    keys: [B] typed PRNG keys, one stream per row.
    sampling: the SamplingConfig.

  Returns:
    tokens [B] int32 and their log-probs [B] float32 under `sampling_logprobs` (the filtered,
    renormalised distribution they were drawn from).
  """
  if sampling.greedy:
    tokens = jnp.argmax(logits, axis=-1)
  else:
    # Inverse-CDF sampling: one uniform number per row instead of Gumbel noise for every
    # vocabulary entry (4.8M random numbers per step for 32 rows of a 151k vocabulary).
    probs = jax.nn.softmax(filter_logits(logits, sampling), axis=-1)
    cdf = jnp.cumsum(probs, axis=-1)
    # u in (0, total]: u = 0 would select index 0 even where it has zero mass.
    u = (1.0 - jax.vmap(jax.random.uniform)(keys)) * cdf[:, -1]
    # The first index whose cumulative mass reaches u; entries of zero mass are never it.
    tokens = jnp.minimum(jnp.sum(cdf < u[:, None], axis=-1), logits.shape[-1] - 1)
  tokens = tokens.astype(jnp.int32)
  logprobs = sampling_logprobs(logits, sampling)  # XLA computes the shared filter once
  return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def _last_logits(model, tokens: jax.Array, num_new: jax.Array, cache: KVCache
                 ) -> tuple[jax.Array, KVCache]:
  """`Decoder.extend`, with logits [B, V] at each row's last new token only (only that row of
  hidden states goes through the LM head, which matters for 150k vocabularies)."""
  hidden, cache = model.backbone.extend(tokens, num_new, cache)
  last = jnp.maximum(num_new - 1, 0)
  h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
  return model.logits_from_hidden(h)[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache", "logits"))
def extend(graphdef: nnx.GraphDef, state: nnx.State, cache: KVCache, logits: jax.Array,
           tokens: jax.Array, num_new: jax.Array) -> tuple[KVCache, jax.Array]:
  """Appends a chunk to each row of the cache.

  Args:
    graphdef, state: `nnx.split(decoder)`.
    cache: KVCache with B rows (donated).
    logits: [B, V] float32, each row's current next-token logits (donated); kept for rows
      with num_new == 0, so a long chunk can be appended in several calls.
    tokens: [B, T] int32, right-padded; row b's first num_new[b] tokens are real.
    num_new: [B] int32 in 0..T (0: the row does not advance).

  Returns:
    The cache (lengths += num_new) and logits [B, V] float32 after each row's last token.
  """
  model = nnx.merge(graphdef, state)
  new_logits, cache = _last_logits(model, tokens, num_new, cache)
  return cache, jnp.where((num_new > 0)[:, None], new_logits, logits)


@struct.dataclass
class Turn:
  """Where each row stands in its current agent turn (device arrays, B rows).

  Attributes:
    keys: [B] typed PRNG keys of the row's turn; its i-th token is drawn with
      fold_in(keys[b], i).
    tokens: [B, N] int32, the turn's sampled tokens (0 past counts[b]); N = max_reply_tokens.
    logprobs: [B, N] float32, their sampling log-probs (0 past counts[b]).
    counts: [B] int32, tokens sampled in this turn so far.
    running: [B] bool, rows still sampling this turn.
  """

  keys: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  counts: jax.Array
  running: jax.Array

  @classmethod
  def idle(cls, keys: jax.Array, max_reply_tokens: int) -> Turn:
    """No row sampling; `keys` [B] only give the shape."""
    b = keys.shape[0]
    return cls(keys=keys, tokens=jnp.zeros((b, max_reply_tokens), jnp.int32),
               logprobs=jnp.zeros((b, max_reply_tokens), jnp.float32),
               counts=jnp.zeros((b,), jnp.int32), running=jnp.zeros((b,), bool))


@jax.jit
def start_turns(turn: Turn, starting: jax.Array, episode_keys: jax.Array,
                turn_numbers: jax.Array) -> Turn:
  """Rows `starting` [B] bool begin a turn: key fold_in(episode_keys[b], turn_numbers[b]),
  nothing sampled yet. Other rows are left as they are (mid-turn, finished or idle)."""
  keys = jax.vmap(jax.random.fold_in)(episode_keys, turn_numbers)
  fresh = starting[:, None]
  return Turn(keys=jnp.where(starting, keys, turn.keys),
              tokens=jnp.where(fresh, 0, turn.tokens),
              logprobs=jnp.where(fresh, 0.0, turn.logprobs),
              counts=jnp.where(starting, 0, turn.counts),
              running=starting | turn.running)


@functools.partial(jax.jit, static_argnames=("graphdef", "end_ids", "sampling"),
                   donate_argnames=("cache", "logits", "turn"))
def decode(graphdef: nnx.GraphDef, state: nnx.State, cache: KVCache, logits: jax.Array,
           turn: Turn, caps: jax.Array, end_ids: tuple[int, ...], sampling: SamplingConfig
           ) -> tuple[KVCache, jax.Array, Turn]:
  """Samples the rest of every running row's turn, in one while loop.

  A step draws the next token of every running row from its current logits (the row's i-th
  token of the turn with key fold_in(turn.keys[b], i)); a row stops on any `end_ids` token or
  after caps[b] tokens; the rows still running are then fed their token (extend with T = 1;
  the others do not advance). The loop ends when no row runs.

  Args:
    graphdef, state: `nnx.split(decoder)`.
    cache: KVCache holding everything before `logits` (donated).
    logits: [B, V] float32, each running row's next-token logits (donated).
    turn: the rows' Turn (donated); see `start_turns`.
    caps: [B] int32, per-row token cap, 1..sampling.max_reply_tokens.
    end_ids: end-of-turn token ids.
    sampling: the SamplingConfig (static).

  Returns:
    cache (a row's last sampled token of its turn is not in it), logits [B, V] and the Turn
    with every row stopped. A cache bounded to its first `live` slots decodes on a copy of
    them, written back at the end (`KVCache.head`).
  """
  model = nnx.merge(graphdef, state)
  n = turn.tokens.shape[1]
  ends = jnp.asarray(end_ids, jnp.int32)
  caps = jnp.minimum(caps, n)
  column = jnp.arange(n)[None, :]

  def draw(step_logits, turn):
    keys = jax.vmap(jax.random.fold_in)(turn.keys, turn.counts)
    tok, lp = sample_tokens(step_logits, keys, sampling)
    here = turn.running[:, None] & (column == turn.counts[:, None])
    counts = turn.counts + turn.running.astype(jnp.int32)
    stop = jnp.any(tok[:, None] == ends[None, :], axis=-1) | (counts >= caps)
    return tok, turn.replace(tokens=jnp.where(here, tok[:, None], turn.tokens),
                             logprobs=jnp.where(here, lp[:, None], turn.logprobs),
                             counts=counts, running=turn.running & ~stop)

  def feed(tok, running, cache, step_logits):
    new_logits, cache = _last_logits(model, tok[:, None], running.astype(jnp.int32), cache)
    return cache, jnp.where(running[:, None], new_logits, step_logits)

  def cond(carry):
    i, _, _, turn = carry
    return (i < n) & jnp.any(turn.running)

  def body(carry):
    i, cache, step_logits, turn = carry
    tok, turn = draw(step_logits, turn)
    # No forward once every row has stopped (the end of every turn).
    cache, step_logits = jax.lax.cond(
        jnp.any(turn.running), feed, lambda tok, running, cache, lg: (cache, lg),
        tok, turn.running, cache, step_logits)
    return i + 1, cache, step_logits, turn

  _, head, logits, turn = jax.lax.while_loop(cond, body,
                                             (jnp.int32(0), cache.head(), logits, turn))
  return cache.with_head(head), logits, turn
