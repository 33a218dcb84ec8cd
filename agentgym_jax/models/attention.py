"""Attention of the decoder, behind one seam: a registry of kernels, one chosen per backend.

Every program calls one of three functions here, with `ModelConfig.attention` as `impl`:

* `self_attention`: the training forward (`Block.__call__`), causal over a right-padded chunk.
* `segment_attention`: the training forward over packed rows (`Segments`): several sequences
  back to back in one row, each seeing itself and the opening it continues (a group's shared
  first turn, stored once) only.
* `cache_attention`: `Backbone.extend`, a chunk's queries at positions starts[b] + t against
  the KV cache (prefill is extend on an empty cache; decode is extend with T = 1).

Kernels (`KERNELS`; a new one is one `register_kernel` call with its forms):

* "xla": einsums with a [T, S] score matrix per layer and row (`attention`,
  `causal_attention`, `cached_attention` below), tuned on XLA:CPU. Its memory grows with the
  square of the length; it stays as the reference the others are tested against.
* "blockwise": flash attention in plain JAX (`flash_attention`): query blocks against key
  blocks with an online softmax, the gradient recomputed block by block in a custom VJP
  (FlashAttention-2, arXiv 2307.08691, Algorithms 1 and 2), so no program holds more than one
  block of scores. Key blocks past a query block's last visible key (above the causal diagonal,
  or past every row's last valid key) are never visited; in packed rows neither are those
  between a query block's openings and its first segment (the other sequences' keys).
  Any backend.
* "cudnn": `jax.nn.dot_product_attention` with cuDNN's fused flash kernel for the training
  forward where its constraints hold (GPU, bf16/fp16, head_dim <= 128 and a multiple of 8),
  else "blockwise"; extend and packed rows are "blockwise".
* "pallas": splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`), a flash
  kernel for TPU; "pallas_interpret" runs the same kernel in the Pallas interpreter on any
  backend (tests on CPU; slow). Neither has a packed-rows form (ValueError).
* "auto": `AUTO[platform]`, resolved when a program is traced against
  `jax.default_backend()`; a program compiled ahead of time for another backend (the TPU plan)
  resolves it for its target first: `resolve_attention(cfg.attention, "tpu")`.

Decode (T = 1) runs the XLA form under every kernel: one query row per kv group would leave a
kernel's query block mostly padding, its scores are [B, H, S] (no T^2), and a decode step is
bound by reading the cache, which the XLA form does once.

How the splash kernel expresses the masks:

* Training: the static causal mask, plus segment ids = valid (0/1) for queries and keys. A
  valid query sees exactly the valid keys s <= t (as in XLA); a padded query sees the padded
  keys s <= t, itself included, so no row is empty (an empty row has no defined softmax).
  Padded queries' outputs differ from XLA's but are finite, and nothing reads them.
* Extend: per-row offsets are no static mask, so the keys are laid out as [the cache's S view
  slots; the chunk's own T keys]: old slots visible where s < starts[b] (segment ids), the
  chunk causal among itself (the static mask q + S >= kv). The chunk's keys are read back
  from the cache (where `KVCache.write` just put them), so their values are the ones XLA sees.
* Sequences are padded to a multiple of the kernel's blocks; padded keys carry segment id 0.
* Under a mesh (`jax.sharding.get_abstract_mesh()` not empty) the kernel runs in a
  `shard_map`: rows over the batch axes, kv heads over `tensor` where they divide (a Pallas
  call cannot be partitioned by GSPMD).

What the kernels save in memory, compiled for TPU and for this host's CPU, is in docs/tpu.md
and benchmarks/README.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from agentgym_jax import sharding

_NEG_INF = -1e30  # finite, so a row with no visible key gives a uniform softmax, not NaN


# ----- the registry ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Kernel:
  """One attention implementation: the forms the decoder calls.

  self_attention(q, k, v, valid) -> out: q [B, T, K, G, Dh], k and v [B, T, K, Dh], valid
    [B, T] bool (right-padded rows); query t sees the valid keys s <= t. out [B, T, K*G*Dh].
  cache_attention(q, k_cache, v_cache, starts) -> out: q [B, T, K, G, Dh] at positions
    starts[b] + t, k_cache [B, K, Dh, S], v_cache [B, K, S, Dh] holding the chunk's own keys
    at those slots; query t sees slots s <= starts[b] + t. out [B, T, K*G*Dh]. Called with
    T > 1 only (decode is the XLA form's, module docstring).
  segment_attention(q, k, v, valid, segments) -> out: packed rows (`Segments`), q, k, v, valid
    and out as in self_attention. None: the kernel has no such form.
  """

  self_attention: Callable[..., jax.Array]
  cache_attention: Callable[..., jax.Array]
  segment_attention: Callable[..., jax.Array] | None = None


KERNELS: dict[str, Kernel] = {}

# "auto" by backend (`jax.default_backend()` names GPUs "gpu"); any other backend: blockwise.
AUTO = {"tpu": "pallas", "gpu": "cudnn"}
_AUTO_ELSEWHERE = "blockwise"


def register_kernel(name: str, self_attention: Callable[..., jax.Array],
                    cache_attention: Callable[..., jax.Array],
                    segment_attention: Callable[..., jax.Array] | None = None) -> None:
  """Adds a kernel under `name` (a `ModelConfig.attention` value from then on); without
  `segment_attention` it cannot run packed rows."""
  if name in KERNELS or name == "auto":
    raise ValueError(f"attention kernel {name!r} is already registered.")
  KERNELS[name] = Kernel(self_attention, cache_attention, segment_attention)


def attention_names() -> tuple[str, ...]:
  """The values `ModelConfig.attention` accepts: "auto" and every registered kernel."""
  return ("auto", *KERNELS)


def check_attention(impl: str) -> str:
  """`impl` itself when it names a kernel or "auto"; else ValueError listing the names."""
  if impl not in attention_names():
    raise ValueError(f"attention {impl!r} is not one of {attention_names()}.")
  return impl


def resolve_attention(impl: str, platform: str | None = None) -> str:
  """The kernel `impl` names on `platform` (None: `jax.default_backend()`): "auto" ->
  `AUTO[platform]` ("pallas" on TPU, "cudnn" on GPU, else "blockwise"); a kernel's own name
  comes back unchanged. Pass the target's platform when compiling ahead of time for devices
  other than the host's."""
  if check_attention(impl) != "auto":
    return impl
  return AUTO.get(platform or jax.default_backend(), _AUTO_ELSEWHERE)


# ----- the seam -------------------------------------------------------------------------------

def self_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array, impl: str
                   ) -> jax.Array:
  """Causal self-attention of a right-padded chunk (the training forward).

  Args:
    q: [B, T, K, G, Dh] queries; k, v: [B, T, K, Dh] (as `Block.project_qkv` returns them).
    valid: [B, T] bool; query t sees the valid keys s <= t.
    impl: a `ModelConfig.attention` value.

  Returns:
    [B, T, K * G * Dh], heads ordered as transformers orders them (h = k * G + g). Outputs of
    padded queries are finite and depend on the kernel; nothing should read them.
  """
  return KERNELS[resolve_attention(impl)].self_attention(q, k, v, valid.astype(bool))


@struct.dataclass
class Segments:
  """How the sequences of packed rows lie: segments back to back, each continuing the shared
  opening before it, if any.

  Query t of row b sees key s iff valid[b, s] and s <= t and (s >= starts[b, t] or
  shared_start[b, t] <= s < shared_end[b, t]). The row [p0..p4 | a0 a1 a2 | b0 b1] (an
  opening of 5, then two sequences continuing it) has starts = [0] * 5 + [5] * 3 + [8] * 2,
  shared_start = 0 and shared_end = [0] * 5 + [5] * 5 (the opening itself continues nothing)
  and positions = [0..4, 5, 6, 7, 5, 6]: b's tokens see the opening and b, at the positions
  they would have in their own row. A row may hold several openings, each with the segments
  that continue it (a batch's groups); shared_start = shared_end is plain packing.

  Attributes:
    positions: [B, T] int32, each token's RoPE position.
    starts: [B, T] int32, the index in the row of the first token of the token's segment (an
      opening is a segment of its own).
    shared_start, shared_end: [B, T] int32, the opening the token's segment continues, as
      [start, end) indices in the row (equal: none).
  """

  positions: jax.Array
  starts: jax.Array
  shared_start: jax.Array
  shared_end: jax.Array


def _segment_visible(s: jax.Array, starts: jax.Array, shared_start: jax.Array,
                     shared_end: jax.Array) -> jax.Array:
  """The packed rows' part of `Segments`'s rule (the rest is valid[b, s] and s <= t): key
  indices s against the queries' starts and shared openings, all broadcast."""
  return (s >= starts) | ((s >= shared_start) & (s < shared_end))


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
                      segments: Segments, impl: str) -> jax.Array:
  """Self-attention of packed rows (the training forward over `Segments`).

  Args:
    q: [B, T, K, G, Dh] queries; k, v: [B, T, K, Dh] (as `Block.project_qkv` returns them).
    valid: [B, T] bool; query t sees the keys `Segments` allows.
    segments: `Segments` of the rows.
    impl: a `ModelConfig.attention` value; its kernel must have a packed form ("blockwise",
      "cudnn" (which runs blockwise) or "xla").

  Returns:
    [B, T, K * G * Dh] (h = k * G + g). Outputs of padded queries are finite and depend on
    the kernel; nothing should read them.
  """
  name = resolve_attention(impl)
  form = KERNELS[name].segment_attention
  if form is None:
    raise ValueError(f"attention kernel {name!r} cannot run packed rows (Segments); set "
                     f"model.attention=blockwise or xla.")
  return form(q, k, v, valid.astype(bool), segments)


def cache_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, starts: jax.Array,
                    impl: str) -> jax.Array:
  """A chunk's attention over the KV cache it was just written into (extend and decode).

  Args:
    q: [B, T, K, G, Dh] queries of row b at positions starts[b] + t.
    k_cache: [B, K, Dh, S] keys (the cache's layout), the chunk's at slots starts[b] + t.
    v_cache: [B, K, S, Dh] values, likewise.
    starts: [B] int32, the rows' lengths before the chunk.
    impl: a `ModelConfig.attention` value.

  Returns:
    [B, T, K * G * Dh].
  """
  impl = resolve_attention(impl)
  if q.shape[1] == 1:  # decode stays on XLA (module docstring)
    return _xla_cache(q, k_cache, v_cache, starts)
  return KERNELS[impl].cache_attention(q, k_cache, v_cache, starts)


# ----- XLA ------------------------------------------------------------------------------------

def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Grouped-query attention as two batched matmuls per kv head.

  The G query heads sharing a kv head are folded into the query-row axis (G * T rows), so a
  few queries still make a matmul rather than a matrix-vector product per head (at T = 1 this
  was faster on XLA:CPU than keeping G as a separate einsum axis: benchmarks/README.md, Model
  forward+backward).

  Args:
    q: [B, T, K, G, Dh] queries (K kv heads, G query heads each).
    k: [B, K, Dh, S] keys, slots last (the cache's layout, see `models.cache`).
    v: [B, K, S, Dh] values.
    mask: [B, T, S] bool, True where query t may see key s.

  Returns:
    [B, T, K * G * Dh], heads ordered as transformers orders them (h = k * G + g).
  """
  b, t, kh, g, dh = q.shape
  s = k.shape[3]
  rows = q.transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, dh)
  scores = jnp.einsum("bkqd,bkds->bkqs", rows, k, preferred_element_type=jnp.float32)
  mask = jnp.broadcast_to(mask[:, None, None], (b, 1, g, t, s)).reshape(b, 1, g * t, s)
  scores = jnp.where(mask, scores * (dh ** -0.5), _NEG_INF)
  # Softmax normalised after the value matmul: a divide per [.., Dh] output instead of per
  # [.., S] score row, forward and backward. The max is a shift that cancels: no gradient.
  weights = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
  out = jnp.einsum("bkqs,bksd->bkqd", weights.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  out = (out / jnp.sum(weights, axis=-1, keepdims=True)).astype(v.dtype)
  out = out.reshape(b, kh, g, t, dh)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, kh * g * dh)


# Query blocks of the full-sequence forward: block i scores the keys of blocks 0..i only, so
# 4 blocks compute 10/16 of the [T, T] scores (the rest lie above the diagonal, all masked).
_CAUSAL_BLOCKS = 4


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """`attention` of a chunk over its own keys (S = T) under a causal mask, in query blocks.

  Same arguments and result as `attention`, but `mask` [B, T, T] must be False wherever s > t:
  the keys past a query block's end are left out, not masked.
  """
  t = q.shape[1]
  n = min(_CAUSAL_BLOCKS, t)
  ends = [t * (i + 1) // n for i in range(n)]
  outs = [attention(q[:, start:end], k[..., :end], v[:, :, :end], mask[:, start:end, :end])
          for start, end in zip([0] + ends[:-1], ends)]
  return jnp.concatenate(outs, axis=1)


# Elements of one block of attention scores: 16 MB of float32. One [B, H, T, S] score tensor
# for a whole observation chunk is tens of MB, and splitting it so that each block's scores
# stay near the cache made an extend faster on XLA:CPU. Blocks take whole rows first and split
# a row's queries only when one row's scores do not fit: rows keep the matmuls G * T queries
# tall, which is faster than blocks of a few queries of every row (benchmarks/README.md,
# Rollout).
_SCORE_BLOCK = 1 << 22


def _largest_power_of_two_block(n: int, fits) -> int:
  """The largest power of two dividing n for which fits(block) holds (at least 1)."""
  block = 1
  while n % (block * 2) == 0 and fits(block * 2):
    block *= 2
  return block


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     score_block: int = _SCORE_BLOCK) -> jax.Array:
  """`attention` for queries against a cache of S slots, arranged for speed.

  Same arguments and result as `attention`, in blocks of rows (and, when one row's scores
  exceed `score_block` elements, of that row's queries) of at most `score_block` scores each.
  A decode step (T = 1) is plain `attention` over all rows at once: its G query heads per kv
  head make the matmul rows. A row's queries split into equal blocks, the last padded where
  they do not divide evenly (padded queries see no key and are dropped): 1,400 queries in 5
  blocks of 280, where blocks dividing 1,400 by a power of two would be 175 tiny blocks of 8.
  A multiply-and-reduce over the transposed keys, with the values summed in groups of 64
  slots, cost about the same as this from 256 to 1,024 slots but fell off a cliff past ~1,500
  on an AVX-512 CPU. benchmarks/README.md, Rollout, has the measurements of both.
  """
  b, t, kh, g, dh = q.shape
  per_query = kh * g * k.shape[3]  # scores of one query of one row
  if per_query * t <= score_block:
    blocks = 1
    rows = b if per_query * t * b <= score_block else _largest_power_of_two_block(
        b, lambda n: per_query * t * n <= score_block)
  else:  # a row's scores alone overflow the block: one row at a time, its queries in blocks
    rows = 1
    blocks = -(-t // max(score_block // per_query, 1))
  queries = -(-t // blocks)

  def row_block(qkvm):
    q, k, v, mask = qkvm
    if blocks == 1:
      return attention(q, k, v, mask)
    pad = ((0, 0), (0, blocks * queries - t))
    q_blocks = jnp.pad(q, pad + ((0, 0),) * 3).reshape(rows, blocks, queries, kh, g, dh)
    mask_blocks = jnp.pad(mask, pad + ((0, 0),)).reshape(rows, blocks, queries, -1)
    out = jax.lax.map(lambda qm: attention(qm[0], k, v, qm[1]),
                      (q_blocks.swapaxes(0, 1), mask_blocks.swapaxes(0, 1)))
    return out.swapaxes(0, 1).reshape(rows, blocks * queries, kh * g * dh)[:, :t]

  if rows == b:
    return row_block((q, k, v, mask))
  split = lambda x: x.reshape((b // rows, rows) + x.shape[1:])
  out = jax.lax.map(row_block, tuple(map(split, (q, k, v, mask))))
  return out.reshape(b, t, kh * g * dh)


def _positions(starts: jax.Array, t: int) -> jax.Array:
  """[B, T] int32: the positions starts[b] + t of a chunk's queries."""
  return starts.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]


def _xla_self(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array) -> jax.Array:
  t = q.shape[1]
  mask = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]
  return causal_attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask)


def _xla_segments(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
                  segments: Segments) -> jax.Array:
  """The reference: the full [B, T, T] mask of `Segments`'s rule."""
  t = q.shape[1]
  s = jnp.arange(t)[None, None, :]
  mask = (jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]
          & _segment_visible(s, segments.starts[:, :, None], segments.shared_start[:, :, None],
                             segments.shared_end[:, :, None]))
  return causal_attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask)


def _xla_cache(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, starts: jax.Array
               ) -> jax.Array:
  mask = (jnp.arange(v_cache.shape[2])[None, None, :]
          <= _positions(starts, q.shape[1])[:, :, None])
  return cached_attention(q, k_cache, v_cache, mask)


# ----- blockwise (flash attention in plain JAX) -----------------------------------------------

# Largest query and key block of `flash_attention`: one block's scores are K * G * 512 * 512
# floats per row (9 MiB for SmolLM2's 9 heads), large enough for fast matmuls on a CPU.
_FLASH_BLOCK = 512


def _flash_block(n: int, largest: int = _FLASH_BLOCK) -> int:
  """Block size for a sequence of n: n split into ceil(n / largest) near-equal blocks, so
  padding stays under one row per block (600 tokens: 2 blocks of 300, not 2 of 512)."""
  return -(-n // -(-n // largest))


@functools.partial(jax.jit, static_argnames=("block_q", "block_k"))
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                    kv_valid: jax.Array, block_q: int | None = None,
                    block_k: int | None = None, *,
                    segments: tuple[jax.Array, jax.Array, jax.Array] | None = None
                    ) -> jax.Array:
  """Attention without a [T, S] score matrix: query t of row b sees key s where
  kv_valid[b, s] and s <= q_pos[b, t], and in packed rows (`segments`) where
  s >= starts[b, t] or shared_start[b, t] <= s < shared_end[b, t] as well (`Segments`'s
  rule).

  Args:
    q: [B, T, K, G, Dh] queries (K kv heads, G query heads each).
    k, v: [B, K, S, Dh] keys and values, heads first.
    q_pos: [B, T] int32 positions of the queries (a query at -1 sees nothing).
    kv_valid: [B, S] bool.
    block_q, block_k: block sizes (default `_flash_block` of T and S).
    segments: (starts, shared_start, shared_end), each [B, T] int32, or None (no segments).
      A query block visits the key blocks of its openings and those from the one holding its
      smallest start on, so give a padded query a start and an empty opening at its own
      index or later.

  Returns:
    [B, T, K * G * Dh] in q's dtype (h = k * G + g); 0 for a query that sees no key.
  """
  b, t, kh, g, dh = q.shape
  s = k.shape[2]
  block_q = block_q or _flash_block(t)
  block_k = block_k or _flash_block(s)
  nq, nk = -(-t // block_q), -(-s // block_k)
  # Queries as [nq, B, K, R, Dh], R = block_q * G rows (query t_local * G + g), each with its
  # position; keys padded to nk whole blocks, the padding invalid.
  q = jnp.pad(q, ((0, 0), (0, nq * block_q - t), (0, 0), (0, 0), (0, 0)))
  q = q.reshape(b, nq, block_q, kh, g, dh).transpose(1, 0, 3, 2, 4, 5)
  q = q.reshape(nq, b, kh, block_q * g, dh)
  q_pos = jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, nq * block_q - t)), constant_values=-1)
  q_pos = jnp.repeat(q_pos.reshape(b, nq, block_q).transpose(1, 0, 2), g, axis=2)
  pad_k = ((0, 0), (0, 0), (0, nk * block_k - s), (0, 0))
  kv_valid = jnp.pad(kv_valid.astype(bool), ((0, 0), (0, nk * block_k - s)))
  seg = None
  if segments is not None:  # laid out as q_pos; padded queries start past every key
    lay_out = lambda x: jnp.repeat(jnp.pad(
        x.astype(jnp.int32), ((0, 0), (0, nq * block_q - t)), constant_values=nk * block_k
    ).reshape(b, nq, block_q).transpose(1, 0, 2), g, axis=2)
    seg = tuple(map(lay_out, segments))
  out = _flash(q, jnp.pad(k, pad_k), jnp.pad(v, pad_k), q_pos, kv_valid, seg, block_k)
  out = out.reshape(nq, b, kh, block_q, g, dh).transpose(1, 0, 3, 2, 4, 5)
  return out.reshape(b, nq * block_q, kh * g * dh)[:, :t].astype(v.dtype)


def _key_blocks(q_pos: jax.Array, kv_valid: jax.Array, block_k: int) -> jax.Array:
  """How many key blocks a query block visits: up to its last query's position and no
  further than the last valid key of any row (int32 scalar, 0 when it sees nothing)."""
  last_valid = jnp.max(jnp.where(kv_valid, jnp.arange(kv_valid.shape[1]), -1))
  last = jnp.minimum(jnp.max(q_pos), last_valid)
  return jnp.maximum(last // block_k + 1, 0)


def _key_ranges(q_pos: jax.Array, kv_valid: jax.Array, block_k: int, seg
                ) -> list[tuple[jax.Array | int, jax.Array]]:
  """The key blocks a query block visits, as disjoint [lo, hi) ranges (lo >= hi: none).

  Without segments (seg None) blocks 0 .. `_key_blocks`; with them (seg = starts,
  shared_start, shared_end [B, R]) the blocks of the block's openings, then those from the one
  holding its smallest start on: the blocks between hold only other segments' keys. The first
  range stops where the second begins, so no block counts twice.
  """
  end = _key_blocks(q_pos, kv_valid, block_k)
  if seg is None:
    return [(0, end)]
  starts, shared_start, shared_end = seg
  some = shared_start < shared_end
  first = jnp.minimum(jnp.min(jnp.where(some, shared_start, jnp.iinfo(jnp.int32).max))
                      // block_k, end)
  last = jnp.minimum(-(-jnp.max(jnp.where(some, shared_end, 0)) // block_k), end)
  own = jnp.minimum(jnp.min(starts) // block_k, end)
  return [(first, jnp.minimum(last, own)), (own, end)]


def _block_scores(q: jax.Array, k: jax.Array, q_pos: jax.Array, kv_valid: jax.Array, seg,
                  j: jax.Array, block_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Scores of query rows q [B, K, R, Dh] against key block j of k [B, K, S, Dh], with
  segments seg (starts, shared_start, shared_end [B, R]) or None: (scores [B, K, R, bk]
  float32 with the masked ones at -inf, mask [B, 1, R, bk], the block's keys)."""
  kj = jax.lax.dynamic_slice_in_dim(k, j * block_k, block_k, axis=2)
  valid = jax.lax.dynamic_slice_in_dim(kv_valid, j * block_k, block_k, axis=1)
  slots = j * block_k + jnp.arange(block_k)
  mask = valid[:, None, None, :] & (slots[None, None, None, :] <= q_pos[:, None, :, None])
  if seg is not None:
    mask &= _segment_visible(slots[None, None, None, :],
                             *(x[:, None, :, None] for x in seg))
  scores = jnp.einsum("bkrd,bksd->bkrs", q, kj, preferred_element_type=jnp.float32)
  scores = jnp.where(mask, scores * (q.shape[-1] ** -0.5), _NEG_INF)
  return scores, mask, kj


def after(first, tree):
  """`tree`, unchanged in value, but computed only once every array of `first` exists.

  x + 0 * s, with s the max of each of `first`'s arrays: XLA does not fold a float
  multiplication by zero (it would change NaN and inf), so the dependency survives, where
  XLA:CPU drops `lax.optimization_barrier` before scheduling. A max needs every element
  (one element would not: XLA computes a slice of a matmul from slices of its operands).
  """
  s = sum(jnp.max(a).astype(jnp.float32) for a in jax.tree.leaves(first))
  return jax.tree.map(lambda a: a + (0 * s).astype(a.dtype), tree)


def _zeros_after(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """float32 zeros of `shape`, made only once x exists (`after`).

  A plain `jnp.zeros` is one constant that XLA shares between every layer's loop and copies
  into each loop's buffer; XLA:CPU schedules those copies at the start of the program, so
  every layer's accumulators would be live at once.
  """
  return after(x, jnp.zeros(shape, jnp.float32))


def _query_block_segments(seg, i):
  """Query block i's segments (three [B, R]) from seg (three [nq, B, R]), or None."""
  return None if seg is None else tuple(x[i] for x in seg)


def _flash_forward(q, k, v, q_pos, kv_valid, seg, block_k):
  """Output [nq, B, K, R, Dh] float32 and log-sum-exp [nq, B, K, R] of query blocks q
  [nq, B, K, R, Dh] (`flash_attention`'s layout); a row that sees no key gets 0 and a
  log-sum-exp of +1e30, so that its recomputed probabilities are 0."""

  def query_block(i, outputs):
    qi, pos, seg_i = q[i], q_pos[i], _query_block_segments(seg, i)
    rows = qi.shape[:3]

    def key_block(j, carry):
      peak, total, acc = carry
      scores, mask, _ = _block_scores(qi, k, pos, kv_valid, seg_i, j, block_k)
      vj = jax.lax.dynamic_slice_in_dim(v, j * block_k, block_k, axis=2)
      new_peak = jnp.maximum(peak, jnp.max(scores, axis=-1))
      p = jnp.where(mask, jnp.exp(scores - new_peak[..., None]), 0.0)
      shrink = jnp.exp(peak - new_peak)
      acc = acc * shrink[..., None] + jnp.einsum("bkrs,bksd->bkrd", p.astype(v.dtype), vj,
                                                 preferred_element_type=jnp.float32)
      return new_peak, total * shrink + jnp.sum(p, axis=-1), acc

    carry = (jnp.full(rows, _NEG_INF, jnp.float32), jnp.zeros(rows, jnp.float32),
             jnp.zeros(rows + (qi.shape[-1],), jnp.float32))
    for lo, hi in _key_ranges(pos, kv_valid, block_k, seg_i):
      carry = jax.lax.fori_loop(lo, hi, key_block, carry)
    peak, total, acc = carry
    seen = total > 0
    out = acc / jnp.where(seen, total, 1.0)[..., None]
    lse = jnp.where(seen, peak + jnp.log(jnp.where(seen, total, 1.0)), -_NEG_INF)
    return outputs[0].at[i].set(out), outputs[1].at[i].set(lse)

  # The outputs are buffers of the loop (not a `lax.map`'s stacked outputs, whose zeros XLA
  # shares between layers: `_zeros_after`).
  outputs = (_zeros_after(q, q.shape[:-1] + v.shape[-1:]), _zeros_after(q, q.shape[:-1]))
  return jax.lax.fori_loop(0, q.shape[0], query_block, outputs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, q_pos, kv_valid, seg, block_k):
  return _flash_forward(q, k, v, q_pos, kv_valid, seg, block_k)[0]


def _flash_fwd(q, k, v, q_pos, kv_valid, seg, block_k):
  out, lse = _flash_forward(q, k, v, q_pos, kv_valid, seg, block_k)
  return out, (q, k, v, q_pos, kv_valid, seg, out, lse)


def _flash_bwd(block_k, residuals, d_out):
  """FlashAttention-2's backward (arXiv 2307.08691, Algorithm 2): per query block, the key
  blocks it visited again, probabilities recomputed from the saved log-sum-exp."""
  q, k, v, q_pos, kv_valid, seg, out, lse = residuals
  scale = q.shape[-1] ** -0.5
  d_out = d_out.astype(jnp.float32)
  delta = jnp.sum(d_out * out, axis=-1)  # [nq, B, K, R]: rowsum(dO * O)

  def query_block(i, carry):
    dq_all, dk, dv = carry
    qi, pos, do, lse_i, delta_i = q[i], q_pos[i], d_out[i], lse[i], delta[i]
    seg_i = _query_block_segments(seg, i)

    def key_block(j, carry):
      dq, dk, dv = carry
      scores, mask, kj = _block_scores(qi, k, pos, kv_valid, seg_i, j, block_k)
      vj = jax.lax.dynamic_slice_in_dim(v, j * block_k, block_k, axis=2)
      p = jnp.where(mask, jnp.exp(scores - lse_i[..., None]), 0.0)
      dp = jnp.einsum("bkrd,bksd->bkrs", do, vj, preferred_element_type=jnp.float32)
      ds = p * (dp - delta_i[..., None]) * scale
      dq = dq + jnp.einsum("bkrs,bksd->bkrd", ds, kj, preferred_element_type=jnp.float32)
      add = lambda acc, x: jax.lax.dynamic_update_slice_in_dim(
          acc, jax.lax.dynamic_slice_in_dim(acc, j * block_k, block_k, axis=2) + x,
          j * block_k, axis=2)
      dk = add(dk, jnp.einsum("bkrs,bkrd->bksd", ds, qi, preferred_element_type=jnp.float32))
      dv = add(dv, jnp.einsum("bkrs,bkrd->bksd", p, do, preferred_element_type=jnp.float32))
      return dq, dk, dv

    ranges = _key_ranges(pos, kv_valid, block_k, seg_i)  # the forward's blocks
    carry = (jnp.zeros(qi.shape, jnp.float32), dk, dv)
    for lo, hi in ranges:
      carry = jax.lax.fori_loop(lo, hi, key_block, carry)
    dq, dk, dv = carry
    return dq_all.at[i].set(dq), dk, dv

  dq, dk, dv = jax.lax.fori_loop(0, q.shape[0], query_block, (
      _zeros_after(d_out, q.shape), _zeros_after(d_out, k.shape), _zeros_after(d_out, k.shape)))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _blockwise_self(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array) -> jax.Array:
  positions = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), valid.shape)
  return flash_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), positions, valid)


# Largest block of the packed rows' blockwise form: a query block skips only the key blocks
# that hold none of its segments' keys and none of the opening's, so blocks much longer than a
# segment would skip nothing.
_SEGMENT_BLOCK = 64


def _blockwise_segments(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
                        segments: Segments) -> jax.Array:
  t = q.shape[1]
  index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), valid.shape)
  # Padded queries see nothing (output 0) and start past every key: whatever the caller put
  # in their starts, they pull no key block into their query block's loops.
  block = _flash_block(t, _SEGMENT_BLOCK)
  past = lambda x: jnp.where(valid, x, t)
  return flash_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                         jnp.where(valid, index, -1), valid, block, block,
                         segments=(past(segments.starts), past(segments.shared_start),
                                   past(segments.shared_end)))


def _blockwise_cache(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, starts: jax.Array
                     ) -> jax.Array:
  every_slot = jnp.ones((q.shape[0], v_cache.shape[2]), bool)
  return flash_attention(q, k_cache.swapaxes(2, 3), v_cache, _positions(starts, q.shape[1]),
                         every_slot)


# ----- cuDNN (GPU) ----------------------------------------------------------------------------

def cudnn_supports(q: jax.Array) -> bool:
  """Whether cuDNN's fused attention takes these queries: half precision, head_dim <= 128 and
  a multiple of 8 (`jax.nn.dot_product_attention`'s cuDNN constraints)."""
  dh = q.shape[-1]
  return q.dtype in (jnp.bfloat16, jnp.float16) and dh <= 128 and dh % 8 == 0


def dot_product_self(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
                     implementation: str | None = "cudnn") -> jax.Array:
  """Causal self-attention of right-padded rows by `jax.nn.dot_product_attention`: the causal
  mask and each row's valid length (`key_value_seq_lengths`), no mask array. `implementation`
  "xla" runs the same call on any backend (tests)."""
  b, t, kh, g, dh = q.shape
  lengths = jnp.maximum(jnp.sum(valid, axis=1, dtype=jnp.int32), 1)
  out = jax.nn.dot_product_attention(q.reshape(b, t, kh * g, dh), k, v, is_causal=True,
                                     key_value_seq_lengths=lengths,
                                     implementation=implementation)
  return out.reshape(b, t, kh * g * dh)


def _cudnn_self(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array) -> jax.Array:
  if cudnn_supports(q):
    return dot_product_self(q, k, v, valid)
  return _blockwise_self(q, k, v, valid)


# ----- Pallas (splash attention) --------------------------------------------------------------

# Largest kernel block along queries and keys (MaxText's default). Blocks are multiples of
# 128, the TPU's lane width, which the kernel requires along the keys.
_MAX_BLOCK = 512
_LANES = 128


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _block(n: int) -> int:
  """Kernel block for a sequence of n: 128-aligned, at most `_MAX_BLOCK`."""
  return min(_MAX_BLOCK, _round_up(n, _LANES))


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, q_len: int, kv_len: int, offset: int, block_q: int, block_kv: int,
            keys_seq_minor: bool, interpret: bool):
  """A splash kernel for one row: q [heads, q_len, Dh] against kv [K, kv_len, Dh], causal with
  query i seeing keys j <= i + offset (and equal segment ids). Cached: building one walks the
  mask's blocks in numpy."""
  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  mask = sm.MultiHeadMask([sm.CausalMask((q_len, kv_len), offset=offset)] * heads)
  layout = sk.QKVLayout.SEQ_MINOR if keys_seq_minor else sk.QKVLayout.HEAD_DIM_MINOR
  sizes = sk.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                        block_q_dkv=block_q, block_kv_dkv=block_kv,
                        block_kv_dkv_compute=block_kv, block_q_dq=block_q,
                        block_kv_dq=block_kv, k_layout=layout)
  # Concrete mask tables even when first built inside a trace: the cache outlives the trace.
  with jax.ensure_compile_time_eval():
    return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              interpret=interpret)


def _run_kernel(kernel, q: jax.Array, k: jax.Array, v: jax.Array, q_seg: jax.Array,
                kv_seg: jax.Array) -> jax.Array:
  """kernel over rows: q [B, H, Tq, Dh], k, v [B, K, S, Dh], segment ids [B, Tq], [B, S]."""
  from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds  # pylint: disable=import-outside-toplevel
  one_row = lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=SegmentIds(q=qs, kv=ks))
  return jax.vmap(one_row)(q, k, v, q_seg, kv_seg)


def _heads_first(q: jax.Array, rows: int) -> jax.Array:
  """q [B, T, K, G, Dh] -> [B, K * G, rows, Dh], scaled by Dh^-1/2, zero-padded to `rows`."""
  b, t, kh, g, dh = q.shape
  q = (q * (dh ** -0.5)).astype(q.dtype).transpose(0, 2, 3, 1, 4).reshape(b, kh * g, t, dh)
  return jnp.pad(q, ((0, 0), (0, 0), (0, rows - t), (0, 0)))


def _heads_last(out: jax.Array, t: int) -> jax.Array:
  """Kernel output [B, H, rows, Dh] -> [B, t, H * Dh] (h = k * G + g, as `attention`)."""
  b, h, _, dh = out.shape
  return out[:, :, :t].transpose(0, 2, 1, 3).reshape(b, t, h * dh)


def _splash_self(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
                 interpret: bool) -> jax.Array:
  """Training forward on one shard: q [B, T, K, G, Dh], k, v [B, K, T, Dh], valid [B, T]."""
  b, t, kh, g, _ = q.shape
  block = _block(t)
  n = _round_up(t, block)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, n - t), (0, 0)))
  seg = jnp.pad(valid.astype(jnp.int32), ((0, 0), (0, n - t)))
  kernel = _kernel(kh * g, n, n, 0, block, block, False, interpret)
  return _heads_last(_run_kernel(kernel, _heads_first(q, n), pad(k), pad(v), seg, seg), t)


def _splash_extend(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, starts: jax.Array,
                   interpret: bool) -> jax.Array:
  """Extend on one shard: q [B, T, K, G, Dh], k_cache [B, K, Dh, S], v_cache [B, K, S, Dh].

  Keys [S cache slots; T chunk keys; padding]: slot s visible where s < starts[b], the chunk
  causal (static mask q + S >= kv), padding never.
  """
  b, t, kh, g, _ = q.shape
  s = v_cache.shape[2]
  slots = jnp.minimum(starts[:, None] + jnp.arange(t)[None], s - 1)  # [B, T]
  k_new = jnp.take_along_axis(k_cache, slots[:, None, None, :], axis=3)  # [B, K, Dh, T]
  v_new = jnp.take_along_axis(v_cache, slots[:, None, :, None], axis=2)  # [B, K, T, Dh]
  block_q, block_kv = _block(t), _block(s + t)
  rows, keys = _round_up(t, block_q), _round_up(s + t, block_kv)
  extra = keys - s - t
  # Keys go in as [B, K, Dh, S] (seq-minor, the cache's layout) so the kernel reads the cache
  # without a transpose; its logical interface is [.., S, Dh], hence the swapaxes it undoes.
  k_all = jnp.concatenate([k_cache, k_new, jnp.zeros(k_new.shape[:3] + (extra,), k_new.dtype)],
                          axis=3)
  v_all = jnp.concatenate([v_cache, v_new, jnp.zeros(v_new.shape[:2] + (extra,) + v_new.shape[3:],
                                                     v_new.dtype)], axis=2)
  kv_seg = jnp.concatenate([jnp.arange(s)[None] < starts[:, None], jnp.ones((b, t), bool),
                            jnp.zeros((b, extra), bool)], axis=1).astype(jnp.int32)
  q_seg = jnp.ones((b, rows), jnp.int32)
  kernel = _kernel(kh * g, rows, keys, s, block_q, block_kv, True, interpret)
  out = _run_kernel(kernel, _heads_first(q, rows), k_all.swapaxes(-1, -2), v_all, q_seg,
                    kv_seg)
  return _heads_last(out, t)


def _sharded(fn, interpret: bool, args: tuple[jax.Array, ...],
             q_names: tuple[str | None, ...]) -> jax.Array:
  """fn(*args, interpret) per shard under the current mesh (a plain call without one).

  Rows split over the batch axes and kv heads over `tensor`, where they divide; every arg
  has rows first and, if it has heads, kv heads second (q: third, after T).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(*args, interpret=interpret)
  q = args[0]
  q_spec = sharding.logical_to_spec(q_names, q.shape, mesh)
  batch, heads = q_spec[0], q_spec[2]
  def spec(x):
    return P(batch, heads, *([None] * (x.ndim - 2))) if x.ndim >= 4 else P(batch)
  in_specs = tuple(spec(x) for x in args[1:])
  out_heads = heads  # [B, T, H * Dh]: H * Dh splits like K when K does
  body = functools.partial(fn, interpret=interpret)
  return jax.shard_map(body, in_specs=(q_spec,) + in_specs, out_specs=P(batch, None, out_heads),
                       check_vma=False)(*args)


def _pallas(interpret: bool) -> tuple[Callable[..., jax.Array], Callable[..., jax.Array]]:
  """The splash kernel's two forms (`Kernel`), run by Mosaic or by the Pallas interpreter."""
  names = ("batch", None, "kv_heads", None, None)

  def self_form(q, k, v, valid):
    return _sharded(_splash_self, interpret,
                    (q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), valid), names)

  def cache_form(q, k_cache, v_cache, starts):
    return _sharded(_splash_extend, interpret, (q, k_cache, v_cache, starts), names)

  return self_form, cache_form


register_kernel("xla", _xla_self, _xla_cache, _xla_segments)
register_kernel("blockwise", _blockwise_self, _blockwise_cache, _blockwise_segments)
register_kernel("cudnn", _cudnn_self, _blockwise_cache, _blockwise_segments)
register_kernel("pallas", *_pallas(interpret=False))
register_kernel("pallas_interpret", *_pallas(interpret=True))
