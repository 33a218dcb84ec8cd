"""The device side of a rollout: batches of KV-cache rows, one per replica.

A `DecodeBatch` holds the cache rows of some episodes, each row's next-token logits and its
progress through the current turn (`sampler.Turn`), and runs `sampler.extend` /
`sampler.decode` on them. `rollout.episodes` decides what each row appends and when it
samples. Replicas (`replica_meshes`) are independent batches, each on its own slice of the
mesh's data axis, or on one local device each without a mesh.

Openings are prefilled once per distinct text, and the part every opening shares once in all:
the samples of a group (GRPO, RLOO) open identically, and every episode of an environment
starts with the same instruction (most of an opening's tokens: benchmarks/README.md, Rollout).
The rows then copy those keys and values (`_copy_rows`) instead of computing them again: the
same numbers as a prefill of every row, for a fraction of the work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentgym_jax import freed_memory, sharding
from agentgym_jax.models import KVCache
from agentgym_jax.rollout import sampler
from agentgym_jax.rollout.sampler import SamplingConfig


@jax.jit
def _rewind(lengths: jax.Array, rewound: jax.Array, to: jax.Array) -> jax.Array:
  """[B] cache lengths with rows `rewound` [B] bool set to `to` [B]."""
  return jnp.where(rewound, to, lengths)


@jax.jit
def _take_rows(tree: Any, rows: jax.Array) -> Any:
  """Gathers rows `rows` [B'] of every array in `tree` (compaction)."""
  return jax.tree.map(lambda x: x[rows], tree)


@functools.partial(jax.jit, donate_argnames=("cache", "logits"))
def _copy_rows(cache: KVCache, logits: jax.Array, source: KVCache, source_logits: jax.Array,
               rows: jax.Array, source_rows: jax.Array) -> tuple[KVCache, jax.Array]:
  """Rows `rows` [B] bool of `cache` and `logits` [B, V] become rows `source_rows` [B] of
  `source` (a cache of B' rows and S' <= S slots) and `source_logits` [B', V]: their keys,
  values, lengths and next-token logits. Slots past S' keep what they held (unread: a row
  attends to its first `lengths[b]` slots only)."""
  head = cache.with_live(source.max_len).head()

  def pick(mine, theirs):
    mask = rows.reshape((-1,) + (1,) * (mine.ndim - 1))
    return jnp.where(mask, theirs[source_rows].astype(mine.dtype), mine)

  head = head.replace(k=tuple(map(pick, head.k, source.k)),
                      v=tuple(map(pick, head.v, source.v)),
                      lengths=pick(head.lengths, source.lengths))
  return cache.with_head(head), pick(logits, source_logits)


# Shortest prefix that all openings of a batch must share for it to be prefilled once.
_MIN_SHARED_PREFIX = 32


def replica_meshes(mesh: Mesh | None, replicas: int) -> list[Mesh | None]:
  """The device groups of `replicas` independent batches: slices of the mesh's data axis.

  Raises ValueError when `replicas` is below 1 or does not divide the data axis (or, without
  a mesh, exceeds the local devices).
  """
  if replicas < 1:
    raise ValueError(f"replicas must be >= 1, got {replicas}.")
  if replicas == 1:
    return [mesh]
  if mesh is None:
    devices = jax.local_devices()
    if len(devices) < replicas:
      raise ValueError(
          f"replicas={replicas} needs as many local devices, found {len(devices)}. On a CPU "
          f"host, XLA_FLAGS=--xla_force_host_platform_device_count={replicas} (set before jax "
          "is imported) exposes the cores as devices.")
    mesh = sharding.make_mesh([("data", replicas), ("fsdp", 1), ("tensor", 1)],
                              devices[:replicas])
  axis = mesh.axis_names.index("data") if "data" in mesh.axis_names else -1
  if axis < 0 or mesh.devices.shape[axis] % replicas:
    raise ValueError(f"replicas={replicas} must divide the mesh's data axis, got mesh "
                     f"{dict(mesh.shape)}.")
  return [Mesh(part, mesh.axis_names, axis_types=mesh.axis_types)
          for part in np.split(mesh.devices, replicas, axis=axis)]


def state_on(state: nnx.State, mesh: Mesh) -> nnx.State:
  """The parameters copied onto a replica's mesh, each with its own partition spec."""
  def put(x):
    spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
    return jax.device_put(x, NamedSharding(mesh, spec))
  return jax.tree.map(put, state)


class DecodeBatch:
  """The device-side state: KV cache rows, their episodes and the pending logits."""

  def __init__(self, graphdef, state, rows: int, limit: int, grow: bool, mesh: Mesh | None,
               max_reply_tokens: int):
    # The cache takes the dtype of the weights it is computed with (a bf16 copy of float32
    # weights when the run computes in bf16, `model.compute_dtype`), and the layout of the
    # platform it lives on.
    weights = jnp.dtype(jax.tree.leaves(state)[0].dtype).name
    self.cfg = dataclasses.replace(nnx.merge(graphdef, state).cfg, param_dtype=weights)
    self.graphdef, self.state, self.mesh, self.limit = graphdef, state, mesh, limit
    # The policy version of `state` (`run_episodes`' `version`, `weights`); None: unknown.
    self.version: int | None = None
    self.max_reply_tokens = max_reply_tokens
    length = sampler.cache_bucket(0, limit) if grow else limit
    platform = None if mesh is None else mesh.devices.flat[0].platform
    self.cache = self._put(KVCache.init(self.cfg, rows, length, platform))
    self.logits = self._put(jnp.zeros((rows, self.cfg.vocab_size), jnp.float32))
    self.episode_of_row = np.full((rows,), -1, np.int64)
    self.keys = self.turn = None

  def assign(self, episodes: np.ndarray, keys: jax.Array) -> None:
    """Puts `episodes` in the first rows, with their PRNG keys (`keys[e]` for episode e).

    The keys live with the rows: each turn's keys are then derived on this batch's own
    devices, never queued behind another replica's work on the default device.
    """
    self.episode_of_row[:len(episodes)] = episodes
    # Rows without an episode take episode 0's key; they are inactive and sample nothing.
    self.keys = self._put(keys[np.maximum(self.episode_of_row, 0)])
    self.turn = self._put(sampler.Turn.idle(self.keys, self.max_reply_tokens))

  @property
  def rows(self) -> int:
    return self.episode_of_row.shape[0]

  @property
  def shards(self) -> int:
    return sharding.data_parallel_size(self.mesh)

  def _put(self, tree):
    # Every array here has the batch first: split it over the mesh's (data, fsdp) axes.
    return tree if self.mesh is None else sharding.shard_batch(tree, self.mesh)

  def _mesh_context(self):
    # Under the mesh the model pins its activations to the data-parallel plan.
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  def _fit(self, reach: int) -> None:
    """Makes the cache hold `reach` tokens per row: a grown cache grows to the bucket that
    holds them, and attention reads that bucket's slots only (a cache of `limit` slots
    compiles once per bucket instead of reading every slot at every step)."""
    bucket = sampler.cache_bucket(reach, self.limit)
    if bucket > self.cache.max_len:
      # The grown copy lives beside the old cache while it is made: a safe point that counts it.
      freed_memory.release_if_over_budget(self.cache.nbytes * bucket // self.cache.max_len)
      self.cache = self._put(self.cache.grow(bucket))
    if bucket != self.cache.view_len:
      self.cache = self.cache.with_live(bucket)

  def extend(self, chunks: list[list[int]], starts: np.ndarray, max_chunk: int, pad_id: int
             ) -> None:
    """Appends chunks[row] to every row, in calls of `sampler.chunk_pieces` widths.

    `starts[row]` is how many tokens the row holds before (known on the host). Rows that
    start empty (openings) are prefilled once per distinct chunk, and the prefix all of them
    share once (see the module docstring).
    """
    chunks, starts = list(chunks), np.asarray(starts)
    opening = [row for row, c in enumerate(chunks) if c and starts[row] == 0]
    if len(opening) > 1:
      distinct = list(dict.fromkeys(tuple(chunks[row]) for row in opening))
      if len(distinct) < len(opening):
        self._open_distinct(opening, [chunks[row] for row in opening], distinct, max_chunk,
                            pad_id)
        for row in opening:
          chunks[row] = []
      else:
        # Every row keeps at least its last token, whose logits it needs.
        shared = min(len(os.path.commonprefix(distinct)), min(map(len, distinct)) - 1)
        if shared >= _MIN_SHARED_PREFIX:
          self._open_shared(opening, list(distinct[0][:shared]), max_chunk, pad_id)
          starts = starts.copy()
          for row in opening:
            chunks[row], starts[row] = chunks[row][shared:], shared
    self._append(chunks, starts, max_chunk, pad_id)

  def _open_distinct(self, rows: list[int], openings: list[list[int]],
                     distinct: list[tuple[int, ...]], max_chunk: int, pad_id: int) -> None:
    """Prefills each of the `distinct` openings in a batch of their own, then copies them
    into rows `rows` (which open with `openings`, in the same order)."""
    source = self._sub_batch(len(distinct), max(map(len, distinct)))
    source.extend([list(d) for d in distinct] + [[]] * (source.rows - len(distinct)),
                  np.zeros(source.rows, np.int64), max_chunk, pad_id)
    index = {d: i for i, d in enumerate(distinct)}
    source_rows = np.zeros(self.rows, np.int32)
    source_rows[rows] = [index[tuple(o)] for o in openings]
    self._copy_from(source, rows, source_rows, max(map(len, distinct)))

  def _open_shared(self, rows: list[int], prefix: list[int], max_chunk: int, pad_id: int
                   ) -> None:
    """Prefills `prefix` once, then copies it into rows `rows`."""
    source = self._sub_batch(1, len(prefix))
    source.extend([prefix] + [[]] * (source.rows - 1), np.zeros(source.rows, np.int64),
                  max_chunk, pad_id)
    self._copy_from(source, rows, np.zeros(self.rows, np.int32), len(prefix))

  def _sub_batch(self, rows: int, tokens: int) -> DecodeBatch:
    """A batch of `rows` rows (a multiple of the shards) holding `tokens` tokens each, on the
    same devices, for the openings it prefills and `_copy_from` copies."""
    rows = -(-rows // self.shards) * self.shards
    return DecodeBatch(self.graphdef, self.state, rows, sampler.cache_bucket(tokens, self.limit),
                       False, self.mesh, self.max_reply_tokens)

  def _copy_from(self, source: DecodeBatch, rows: list[int], source_rows: np.ndarray,
                 tokens: int) -> None:
    """Rows `rows` take rows `source_rows[row]` of `source`, which hold `tokens` tokens at
    most (see `_copy_rows`)."""
    self._fit(tokens)
    copied = np.zeros(self.rows, bool)
    copied[rows] = True
    self.cache, self.logits = _copy_rows(self.cache, self.logits, source.cache, source.logits,
                                         self._put(copied), self._put(source_rows))

  def _append(self, chunks: list[list[int]], starts: np.ndarray, max_chunk: int, pad_id: int
              ) -> None:
    """`extend` without sharing: every row appends its own chunk."""
    offset = 0
    for count, width in sampler.chunk_pieces(max(map(len, chunks)), max_chunk):
      pieces = [c[offset:offset + count] for c in chunks]
      tokens = np.full((self.rows, width), pad_id, np.int32)
      for row, piece in enumerate(pieces):
        tokens[row, :len(piece)] = piece
      num_new = np.asarray([len(p) for p in pieces], np.int32)
      # Real tokens must fit; padding past the end of the cache is dropped.
      self._fit(int(np.max(np.where(num_new > 0, starts + offset + num_new, 0))))
      with self._mesh_context():
        self.cache, self.logits = sampler.extend(
            self.graphdef, self.state, self.cache, self.logits, self._put(tokens),
            self._put(num_new))
      offset += count

  def rewind(self, rewound: np.ndarray, lengths: np.ndarray) -> None:
    """Shortens rows `rewound` [rows] bool to `lengths` [rows] tokens; later slots are
    overwritten by the next extend (attention never reads past a row's length)."""
    self.cache = self.cache.replace(lengths=_rewind(
        self.cache.lengths, self._put(rewound), self._put(lengths.astype(np.int32))))

  def start(self, starting: np.ndarray, turn_numbers: np.ndarray) -> None:
    """Rows `starting` [rows] bool begin turn `turn_numbers[row]` of their episode."""
    self.turn = sampler.start_turns(self.turn, self._put(starting), self.keys,
                                    self._put(turn_numbers.astype(np.int32)))

  def decode(self, reach: int, end_ids: tuple[int, ...], sampling: SamplingConfig) -> None:
    """Samples the running rows' turns; `reach` bounds every running row's length until its
    turn ends. Dispatched, not waited for: `self.turn` holds the result once computed."""
    self._fit(reach)
    caps = np.full(self.rows, sampling.max_reply_tokens, np.int32)
    with self._mesh_context():
      self.cache, self.logits, self.turn = sampler.decode(
          self.graphdef, self.state, self.cache, self.logits, self.turn, self._put(caps),
          end_ids, sampling)

  def compact(self, keep: np.ndarray, rows: int) -> None:
    """Keeps rows `keep` (in order) in a batch of `rows` rows."""
    order = np.concatenate([keep, np.setdiff1d(np.arange(self.rows), keep)])[:rows]
    state = _take_rows((self.cache, self.logits, self.keys, self.turn), self._put(order))
    self.cache, self.logits, self.keys, self.turn = self._put(state)
    self.episode_of_row = np.where(np.arange(rows) < len(keep), self.episode_of_row[order], -1)


