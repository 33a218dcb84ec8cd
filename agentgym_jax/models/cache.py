"""Per-row key/value cache for multi-turn decoding, laid out for fast decode steps.

One buffer per layer rather than one stacked [layers, ...] array: inside a decode loop XLA:CPU
copied a whole layer slice out of a stacked buffer for every attention call, while separate
buffers are updated in place and read without copies. Keys are stored transposed, slots last,
so a decode step's scores q . k are a matmul that writes along contiguous slots, faster on
XLA:CPU than keys stored slots first (benchmarks/README.md, Rollout, has both measurements).

Rows fill independently: `lengths[b]` is how many slots of row b hold real tokens, so episodes
whose turns differ in length share one batch.

Attention reads the first `live` slots only (a static bound the caller sets from the longest
row it is about to reach, see `with_live`): decoding a small model is bound by reading the
cache, so rows of 300 tokens in a cache of 4096 slots should read 512 of them, not 4096. A
loop of decode steps runs on those slots copied out once (`head`, then `with_head`), since
attention over a slice copies it at every step on XLA:CPU.

Two storage layouts, chosen by the platform the cache lives on (`KVCache.init`); attention sees
the same [B, K, Dh, S] keys and [B, K, S, Dh] values from both (`attention_view`):

* heads (XLA:CPU and GPU): k [B, K, Dh, S], v [B, K, S, Dh], as above.
* slots (TPU): k and v [B, S, K * Dh]. XLA:TPU tiles an array's two minor dimensions, and a
  write at a per-row slot inside a tiled dimension made it lay the decode loop's cache out
  slots-major instead: the program converted the whole donated cache into that layout on entry
  and back on exit, a second cache in temporaries (docs/tpu.md has the 7B figures). Stored
  slots-major with
  heads flattened into a lane-aligned last axis, the entry layout is the loop's, and nothing is
  converted. Rows of the flattened axis hold whole kv heads, so `tensor` still splits heads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding

from agentgym_jax import sharding
from agentgym_jax.models.config import ModelConfig

# Logical axis names of one layer's buffers, for the sharding rules (heads / slots layout).
_K_AXES = ("batch", "kv_heads", "head_dim", "length")
_V_AXES = ("batch", "kv_heads", "length", "head_dim")
_SLOTS_AXES = ("batch", "length", "kv_heads")


def slots_major(platform: str) -> bool:
  """Whether a cache on `platform` ("cpu", "gpu", "tpu") is stored slots-major (module doc)."""
  return platform == "tpu"


@struct.dataclass
class KVCache:
  """Keys/values of every layer plus each row's fill level.

  Attributes:
    k: tuple of num_layers arrays [B, num_kv_heads, head_dim, S] (RoPE applied), or
      [B, S, num_kv_heads * head_dim] in the slots layout (module docstring).
    v: tuple of num_layers arrays [B, num_kv_heads, S, head_dim], or [B, S, K * Dh] likewise.
    lengths: [B] int32, slots 0..lengths[b]-1 of row b hold real tokens.
    live: static; attention reads slots 0..live-1 only (0: all S). Every row must stay
      within it: lengths[b] plus what the next calls append <= live.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  lengths: jax.Array
  live: int = struct.field(pytree_node=False, default=0)

  @classmethod
  def init(cls, cfg: ModelConfig, batch_size: int, max_len: int, platform: str | None = None
           ) -> KVCache:
    """An empty cache of `max_len` slots per row, in the model's dtype (`cfg.dtype`).

    `platform` (None: `jax.default_backend()`) picks the storage layout; a program compiled
    ahead of time for TPU on a CPU host passes "tpu". Every buffer is its own allocation, so a
    jitted step may donate the cache without any two aliasing.
    """
    kh, dh, dtype = cfg.num_kv_heads, cfg.head_dim, cfg.dtype
    if slots_major(platform or jax.default_backend()):
      k_shape = v_shape = (batch_size, max_len, kh * dh)
    else:
      k_shape, v_shape = (batch_size, kh, dh, max_len), (batch_size, kh, max_len, dh)
    return cls(k=tuple(jnp.zeros(k_shape, dtype) for _ in range(cfg.num_layers)),
               v=tuple(jnp.zeros(v_shape, dtype) for _ in range(cfg.num_layers)),
               lengths=jnp.zeros((batch_size,), jnp.int32))

  @property
  def slots_major(self) -> bool:
    """Stored [B, S, K * Dh] (the slots layout) rather than heads first."""
    return self.v[0].ndim == 3

  @property
  def max_len(self) -> int:
    """Slots per row (S)."""
    return self.v[0].shape[self.slot_axes[1]]

  @property
  def slot_axes(self) -> tuple[int, int]:
    """The slot axis of the key and of the value buffers."""
    return (1, 1) if self.slots_major else (3, 2)

  @property
  def nbytes(self) -> int:
    """Bytes of every layer's key and value buffers on this process's devices (lengths left
    out)."""
    return sum(shard.data.nbytes for x in (*self.k, *self.v) for shard in x.addressable_shards)

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

    Attention over a slice of longer buffers copies the slice on XLA:CPU, at every step
    (benchmarks/README.md, Rollout). A loop copies the slots once instead (`with_head` writes
    them back).
    The slots layout (TPU) reads a prefix of its slots in place: no copy there.
    """
    if self.view_len == self.max_len or self.slots_major:
      return self
    n = self.view_len
    return self.replace(k=tuple(x[..., :n] for x in self.k),
                        v=tuple(x[:, :, :n] for x in self.v), live=0)

  def with_head(self, head: KVCache) -> KVCache:
    """This cache with `head` (from `head()`, then advanced) written over its first slots."""
    if head.max_len == self.max_len:
      return head.replace(live=self.live)
    ka, va = self.slot_axes
    put = lambda x, h, axis: jax.lax.dynamic_update_slice_in_dim(x, h, 0, axis=axis)
    return self.replace(k=tuple(put(x, h, ka) for x, h in zip(self.k, head.k)),
                        v=tuple(put(x, h, va) for x, h in zip(self.v, head.v)),
                        lengths=head.lengths)

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
    k_buf, v_buf = self.k[layer], self.v[layer]
    k, v = k.astype(k_buf.dtype), v.astype(v_buf.dtype)
    if self.slots_major:
      return (k_buf.at[rows, slots].set(k.reshape(b, t, -1), mode="drop"),
              v_buf.at[rows, slots].set(v.reshape(b, t, -1), mode="drop"))
    # Both indexed updates take their values as [B, T, K, Dh], whichever axis holds the slots.
    return (k_buf.at[rows, :, :, slots].set(k, mode="drop"),
            v_buf.at[rows, :, slots].set(v, mode="drop"))

  def attention_view(self, k_buf: jax.Array, v_buf: jax.Array, q: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """A layer's buffers (this cache's layout) as attention reads them against queries q
    [B, T, K, G, Dh]: the first `view_len` slots, keys [B, K, Dh, view] and values
    [B, K, view, Dh], in q's dtype.

    In the slots layout the transposes become the layouts XLA picks for the reads, not copies.
    """
    n = self.view_len
    if not self.slots_major:
      return k_buf[..., :n].astype(q.dtype), v_buf[:, :, :n].astype(q.dtype)
    heads = lambda x: x[:, :n].reshape(x.shape[0], n, q.shape[2], q.shape[4]).astype(q.dtype)
    return heads(k_buf).transpose(0, 2, 3, 1), heads(v_buf).transpose(0, 2, 1, 3)

  def shardings(self, mesh: Mesh) -> KVCache:
    """A KVCache of NamedShardings: rows over the batch axes, kv heads over `tensor`."""
    spec = lambda names, x: NamedSharding(mesh, sharding.logical_to_spec(names, x.shape, mesh))
    k_axes, v_axes = (_SLOTS_AXES, _SLOTS_AXES) if self.slots_major else (_K_AXES, _V_AXES)
    return self.replace(k=tuple(spec(k_axes, x) for x in self.k),
                        v=tuple(spec(v_axes, x) for x in self.v),
                        lengths=spec(("batch",), self.lengths))


@functools.partial(jax.jit, static_argnames=("max_len",))
def _grow(cache: KVCache, max_len: int) -> KVCache:
  ka, va = cache.slot_axes
  def pad(axis):
    return lambda x: jnp.pad(x, [(0, max_len - cache.max_len if a == axis else 0)
                                 for a in range(x.ndim)])
  return cache.replace(k=tuple(map(pad(ka), cache.k)), v=tuple(map(pad(va), cache.v)))
