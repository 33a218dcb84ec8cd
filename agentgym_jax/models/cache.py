"""Per-row key/value cache for multi-turn decoding, laid out for fast decode steps.

One buffer per layer rather than one stacked [layers, ...] array: inside a decode loop XLA:CPU
copied a whole layer slice out of a stacked buffer for every attention call, while separate
buffers are updated in place and read without copies (2-4x faster decode steps on the rollout
benchmark's model, B 32, S 256-2048). Keys are stored transposed, slots last, so a decode step's
scores q . k are a matmul that writes along contiguous slots: 2.8x faster on XLA:CPU than keys
stored slots first (B 32, 4 kv heads, head_dim 32, 768 slots: 0.53 vs 1.51 ms per layer).

Rows fill independently: `lengths[b]` is how many slots of row b hold real tokens, so episodes
whose turns differ in length share one batch.

Attention reads the first `live` slots only (a static bound the caller sets from the longest
row it is about to reach, see `with_live`): decoding a small model is bound by reading the
cache, so rows of 300 tokens in a cache of 4096 slots should read 512 of them, not 4096. A
loop of decode steps runs on those slots copied out once (`head`, then `with_head`), since
attention over a slice copies it at every step on XLA:CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding

from agentgym_jax import sharding
from agentgym_jax.models.config import ModelConfig

# Logical axis names of one layer's buffers, for the sharding rules.
_K_AXES = ("batch", "kv_heads", "head_dim", "length")
_V_AXES = ("batch", "kv_heads", "length", "head_dim")


@struct.dataclass
class KVCache:
  """Keys/values of every layer plus each row's fill level.

  Attributes:
    k: tuple of num_layers arrays [B, num_kv_heads, head_dim, S] (RoPE applied).
    v: tuple of num_layers arrays [B, num_kv_heads, S, head_dim].
    lengths: [B] int32, slots 0..lengths[b]-1 of row b hold real tokens.
    live: static; attention reads slots 0..live-1 only (0: all S). Every row must stay
      within it: lengths[b] plus what the next calls append <= live.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  lengths: jax.Array
  live: int = struct.field(pytree_node=False, default=0)

  @classmethod
  def init(cls, cfg: ModelConfig, batch_size: int, max_len: int,
           dtype: jnp.dtype = jnp.float32) -> KVCache:
    """An empty cache of `max_len` slots per row.

    Every buffer is its own allocation, so a jitted step may donate the cache without any
    two aliasing.
    """
    k_shape = (batch_size, cfg.num_kv_heads, cfg.head_dim, max_len)
    v_shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
    return cls(k=tuple(jnp.zeros(k_shape, dtype) for _ in range(cfg.num_layers)),
               v=tuple(jnp.zeros(v_shape, dtype) for _ in range(cfg.num_layers)),
               lengths=jnp.zeros((batch_size,), jnp.int32))

  @property
  def max_len(self) -> int:
    """Slots per row (S)."""
    return self.v[0].shape[2]

  @property
  def view_len(self) -> int:
    """Slots attention reads (the `live` bound, or all S)."""
    return self.live or self.max_len

  def with_live(self, live: int) -> KVCache:
    """The same buffers, attention bounded to the first `live` slots (1..S)."""
    if not 0 < live <= self.max_len:
      raise ValueError(f"live={live} slots is outside 1..{self.max_len}, the cache's length.")
    return self.replace(live=live)

  def head(self) -> KVCache:
    """The first `view_len` slots as buffers of their own (live 0), to work on and write back.

    Attention over a slice of longer buffers copies the slice on XLA:CPU, at every step: a
    decode step of the rollout benchmark's 4M model at 768 of 1,152 slots took 15.4 ms, at 768
    of 768 slots 9.8 ms. A loop copies the slots once instead (`with_head` writes them back).
    """
    if self.view_len == self.max_len:
      return self
    n = self.view_len
    return KVCache(k=tuple(x[..., :n] for x in self.k), v=tuple(x[:, :, :n] for x in self.v),
                   lengths=self.lengths)

  def with_head(self, head: KVCache) -> KVCache:
    """This cache with `head` (from `head()`, then advanced) written over its first slots."""
    if head.max_len == self.max_len:
      return head.replace(live=self.live)
    put = lambda x, h, axis: jax.lax.dynamic_update_slice_in_dim(x, h, 0, axis=axis)
    return KVCache(k=tuple(put(x, h, 3) for x, h in zip(self.k, head.k)),
                   v=tuple(put(x, h, 2) for x, h in zip(self.v, head.v)),
                   lengths=head.lengths, live=self.live)

  def grow(self, max_len: int) -> KVCache:
    """The same cache with `max_len` slots per row (a copy; zero-padded)."""
    return _grow(self, max_len)

  def write(self, layer: int, k: jax.Array, v: jax.Array, starts: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
    """Layer `layer`'s buffers with k, v [B, T, K, Dh] written at slots starts[b] + t.

    A scatter rather than a per-row dynamic_update_slice: slots past S are dropped instead of
    the write being clamped backwards over real tokens.
    """
    b, t = k.shape[:2]
    rows = jnp.arange(b)[:, None]
    slots = starts[:, None] + jnp.arange(t)[None, :]
    # Both indexed updates take their values as [B, T, K, Dh], whichever axis holds the slots.
    k_buf = self.k[layer].at[rows, :, :, slots].set(k.astype(self.k[layer].dtype), mode="drop")
    v_buf = self.v[layer].at[rows, :, slots].set(v.astype(self.v[layer].dtype), mode="drop")
    return k_buf, v_buf

  def shardings(self, mesh: Mesh) -> KVCache:
    """A KVCache of NamedShardings: rows over the batch axes, kv heads over `tensor`."""
    spec = lambda names, x: NamedSharding(mesh, sharding.logical_to_spec(names, x.shape, mesh))
    return KVCache(k=tuple(spec(_K_AXES, x) for x in self.k),
                   v=tuple(spec(_V_AXES, x) for x in self.v),
                   lengths=spec(("batch",), self.lengths), live=self.live)


@functools.partial(jax.jit, static_argnames=("max_len",))
def _grow(cache: KVCache, max_len: int) -> KVCache:
  extra = max_len - cache.max_len
  pad_k = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, extra)))
  pad_v = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, extra), (0, 0)))
  return KVCache(k=tuple(map(pad_k, cache.k)), v=tuple(map(pad_v, cache.v)),
                 lengths=cache.lengths, live=cache.live)
