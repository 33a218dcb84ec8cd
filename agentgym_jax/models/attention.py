"""Attention of the decoder, behind one seam: XLA einsums or a Pallas TPU kernel.

Every program calls one of two functions here, with `ModelConfig.attention` as `impl`:

* `self_attention`: the training forward (`Block.__call__`), causal over a right-padded chunk.
* `cache_attention`: `Backbone.extend`, a chunk's queries at positions lengths[b] + t against
  the KV cache (prefill is extend on an empty cache; decode is extend with T = 1).

Implementations (`impl`, see `resolve_attention`):

* "xla": `causal_attention` / `cached_attention` below, the einsum forms tuned on XLA:CPU.
* "pallas": splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`), a flash
  kernel that never holds a [T, S] score matrix; TPU only. The training forward and extend
  with T > 1 (prefill, observation chunks) use it; decode (T = 1) stays on XLA, since a
  kernel's query block of one row would be mostly padding and a decode step is bound by
  reading the cache, which the XLA form already does once.
* "pallas_interpret": the same kernel run by the Pallas interpreter, on any backend (for
  tests on CPU; slow).
* "auto": "pallas" when compiling for TPU, else "xla". It is resolved when a program is
  traced, against `jax.default_backend()`. A program compiled ahead of time for TPU on a CPU
  host (the TPU plan) must resolve it for the target first:
  `dataclasses.replace(cfg, attention=resolve_attention(cfg.attention, "tpu"))`.

How the kernel expresses the masks:

* Training: the static causal mask, plus segment ids = valid (0/1) for queries and keys. A
  valid query sees exactly the valid keys s <= t (as in XLA); a padded query sees the padded
  keys s <= t, itself included, so no row is empty (an empty row has no defined softmax).
  Padded queries' outputs differ from XLA's but are finite, and nothing reads them.
* Extend: per-row offsets are no static mask, so the keys are laid out as [the cache's S view
  slots; the chunk's own T keys]: old slots visible where s < lengths[b] (segment ids), the
  chunk causal among itself (the static mask q + S >= kv). The chunk's keys are read back
  from the cache (where `KVCache.write` just put them), so their values are the ones XLA sees.
* Sequences are padded to a multiple of the kernel's blocks; padded keys carry segment id 0.
* Under a mesh (`jax.sharding.get_abstract_mesh()` not empty) the kernel runs in a
  `shard_map`: rows over the batch axes, kv heads over `tensor` where they divide (a Pallas
  call cannot be partitioned by GSPMD).

What the kernel saves in HBM at 12,288 tokens, compiled ahead of time for TPU, is in
docs/tpu.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from agentgym_jax import sharding
from agentgym_jax.models.config import ATTENTION_IMPLS

_NEG_INF = -1e30  # finite, so a row with no visible key gives a uniform softmax, not NaN


def resolve_attention(impl: str, platform: str | None = None) -> str:
  """The implementation `impl` names on `platform`: "auto" -> "pallas" on "tpu", else "xla".

  `platform` None is `jax.default_backend()`; pass the target's ("tpu") when compiling ahead
  of time for devices other than the host's. Other values come back unchanged.
  """
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention {impl!r} is not one of {ATTENTION_IMPLS}.")
  if impl != "auto":
    return impl
  return "pallas" if (platform or jax.default_backend()) == "tpu" else "xla"


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


# ----- the seam -------------------------------------------------------------------------------

def self_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, impl: str
                   ) -> jax.Array:
  """Causal self-attention of a right-padded chunk (the training forward).

  Args:
    q: [B, T, K, G, Dh] queries; k, v: [B, T, K, Dh] (as `Block.project_qkv` returns them).
    mask: [B, T, T] bool, causal & valid[b, s] (query t sees valid keys s <= t), or `valid`
      [B, T] itself. The kernel needs only `valid` (a [B, T, T] mask's last row), and given
      `valid` no [B, T, T] mask is built for it (T^2 bytes per row: 151 MB at 12,288 tokens).
    impl: a `ModelConfig.attention` value.

  Returns:
    [B, T, K * G * Dh].
  """
  impl = resolve_attention(impl)
  if impl == "xla":
    if mask.ndim == 2:
      mask = jnp.tril(jnp.ones((q.shape[1],) * 2, bool))[None] & mask[:, None, :].astype(bool)
    return causal_attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask)
  valid = mask if mask.ndim == 2 else mask[:, -1, :]
  return _sharded(_splash_self, impl == "pallas_interpret",
                  (q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), valid),
                  ("batch", None, "kv_heads", None, None))


def cache_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, starts: jax.Array,
                    mask: jax.Array, impl: str) -> jax.Array:
  """A chunk's attention over the KV cache it was just written into (extend and decode).

  Args:
    q: [B, T, K, G, Dh] queries of row b at positions starts[b] + t.
    k_cache: [B, K, Dh, S] keys (the cache's layout), the chunk's at slots starts[b] + t.
    v_cache: [B, K, S, Dh] values, likewise.
    starts: [B] int32, the rows' lengths before the chunk.
    mask: [B, T, S] bool, s <= starts[b] + t (read by the XLA form only).
    impl: a `ModelConfig.attention` value.

  Returns:
    [B, T, K * G * Dh].
  """
  impl = resolve_attention(impl)
  if impl == "xla" or q.shape[1] == 1:  # decode stays on XLA (module docstring)
    return cached_attention(q, k_cache, v_cache, mask)
  return _sharded(_splash_extend, impl == "pallas_interpret", (q, k_cache, v_cache, starts),
                  ("batch", None, "kv_heads", None, None))


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
