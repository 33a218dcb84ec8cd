"""Multi-turn episode runner: B tasks x n samples against an environment pool, one KV cache.

Each episode is one row of a KV cache that lives for the whole rollout (padded to the next
power-of-two length when the longest row needs it). A turn is two compiled
calls for all active rows together: `extend` appends what is new since the row's last turn
(its previous reply's last token, the observation chunk, or the whole opening at turn 0), then
`decode` samples the reply. Nothing is ever re-encoded: the trajectory's tokens are the opening,
the sampled ids and the observation chunks, exactly as the model saw them.

History window (`history_turns = k > 0`, rollout/window.py): turn t sees the opening and turns
t-k..t-1 only. Once the window drops a turn, the row is rewound to its opening (its cache
length is reset; the opening's keys and values stay valid, as they are the same tokens at the
same positions) and the kept turns are extended again, the same ids as sampled: what the
model sees is exactly `window.context_tokens`, which the trainer's per-turn rows rebuild.

Episodes end when the environment terminates or truncates them, when the pool reports a fault
(the episode is then marked failed, see rollout/trajectory.py), at `max_turns`, or when the
next turn's context could overflow `max_context` (reply cap included; with a window, the
windowed context); the final observation is then not
appended (no later agent token would use it). Finished episodes leave the active set; when at
most half the rows are still running the cache is compacted to a batch half the size (a few
more compilations, then every decode step is cheaper).

Replicas: with `replicas=R` the episodes are split into R groups, each a batch of its own on
its own slice of the mesh's data axis (or on one local device each, without a mesh). The
groups' calls are dispatched back to back and run concurrently, and each decode loop stops
when ITS rows are done, with no synchronisation between the groups at every sampled token
(which one SPMD program over all devices needs to decide whether any row is still running).
On a multi-core CPU host expose the cores as devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=N`) and use `replicas=N`.

Randomness: episode e draws with key fold_in(fold_in(split(rng, B)[e], turn), step), so its
samples do not depend on which other episodes share the batch, on compaction or on replicas.
`rows` runs only some of the B episodes (a process's share of a multi-host batch, see
agentgym_jax/multihost.py); each keeps the key and group id it has among all B, so a batch's
samples do not depend either on how many processes share it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentgym_jax import sharding
from agentgym_jax.models import KVCache
from agentgym_jax.rollout import sampler, window
from agentgym_jax.rollout.sampler import SamplingConfig
from agentgym_jax.rollout.trajectory import Episode, Trajectory, anchor_id, build_trajectory
from agentgym_jax.tokenization import ChatTokenizer

DEFAULT_ACKNOWLEDGEMENT = "OK. I'll follow your instructions and try my best to solve the task."


def _as_key(rng: Any) -> jax.Array:
  if isinstance(rng, int):
    return jax.random.key(rng)
  if jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
    return rng
  return jax.random.wrap_key_data(jnp.asarray(rng, jnp.uint32))


@jax.jit
def _turn_keys(keys: jax.Array, turn: jax.Array) -> jax.Array:
  """[B] keys -> [B] keys folded with this turn's number."""
  return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, turn)


@jax.jit
def _rewind(lengths: jax.Array, rewound: jax.Array, to: jax.Array) -> jax.Array:
  """[B] cache lengths with rows `rewound` [B] bool set to `to` [B]."""
  return jnp.where(rewound, to, lengths)


@jax.jit
def _take_rows(tree: Any, rows: jax.Array) -> Any:
  """Gathers rows `rows` [B'] of every array in `tree` (compaction)."""
  return jax.tree.map(lambda x: x[rows], tree)


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


def _state_on(state: nnx.State, mesh: Mesh) -> nnx.State:
  """The parameters copied onto a replica's mesh, each with its own partition spec."""
  def put(x):
    spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
    return jax.device_put(x, NamedSharding(mesh, spec))
  return jax.tree.map(put, state)


def _shards(mesh: Mesh | None) -> int:
  """How many ways a batch on `mesh` splits its rows (row counts are kept a multiple)."""
  return 1 if mesh is None else math.prod(mesh.shape.get(a, 1) for a in sharding.BATCH_AXES)


class _Batch:
  """The device-side state: KV cache rows, their episodes and the pending logits."""

  def __init__(self, graphdef, state, rows: int, limit: int, grow: bool, mesh: Mesh | None,
               cache_dtype):
    cfg = nnx.merge(graphdef, state).cfg
    self.graphdef, self.state, self.mesh, self.limit = graphdef, state, mesh, limit
    length = sampler.cache_bucket(0, limit) if grow else limit
    self.cache = self._put(KVCache.init(cfg, rows, length, cache_dtype))
    self.logits = self._put(jnp.zeros((rows, cfg.vocab_size), jnp.float32))
    self.episode_of_row = np.full((rows,), -1, np.int64)
    self.keys = None

  def assign(self, episodes: np.ndarray, keys: jax.Array) -> None:
    """Puts `episodes` in the first rows, with their PRNG keys (`keys[e]` for episode e).

    The keys live with the rows: each turn's keys are then derived on this batch's own
    devices, never queued behind another replica's work on the default device.
    """
    self.episode_of_row[:len(episodes)] = episodes
    # Rows without an episode take episode 0's key; they are inactive and sample nothing.
    self.keys = self._put(keys[np.maximum(self.episode_of_row, 0)])

  @property
  def rows(self) -> int:
    return self.episode_of_row.shape[0]

  @property
  def shards(self) -> int:
    return _shards(self.mesh)

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
      self.cache = self._put(self.cache.grow(bucket))
    if bucket != self.cache.view_len:
      self.cache = self.cache.with_live(bucket)

  def extend(self, chunks: list[list[int]], starts: np.ndarray, max_chunk: int, pad_id: int
             ) -> None:
    """Appends chunks[row] to every row, in calls of `sampler.chunk_pieces` widths.

    `starts[row]` is how many tokens the row holds before (known on the host).
    """
    offset = 0
    for count, width in sampler.chunk_pieces(max(len(c) for c in chunks), max_chunk):
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

  def decode(self, active: np.ndarray, keys: jax.Array, caps: np.ndarray, reach: int,
             end_ids: tuple[int, ...], sampling: SamplingConfig):
    """Starts sampling a turn for the active rows; `reach` bounds every row's length after.

    Returns (tokens, logprobs, counts) as device arrays, still being computed: the caller
    fetches them once every replica's turn has been dispatched.
    """
    self._fit(reach)
    with self._mesh_context():
      self.cache, tokens, logprobs, counts = sampler.decode(
          self.graphdef, self.state, self.cache, self.logits, self._put(active),
          self._put(keys), self._put(caps), end_ids, sampling)
    return tokens, logprobs, counts

  def compact(self, keep: np.ndarray, rows: int) -> None:
    """Keeps rows `keep` (in order) in a batch of `rows` rows."""
    order = np.concatenate([keep, np.setdiff1d(np.arange(self.rows), keep)])[:rows]
    state = _take_rows((self.cache, self.logits, self.keys), self._put(order))
    self.cache, self.logits, self.keys = self._put(state)
    self.episode_of_row = np.where(np.arange(rows) < len(keep), self.episode_of_row[order], -1)


def _next_chunk(e: Episode, cached: int, cached_start: int, history_turns: int
                ) -> tuple[int, list[int], int]:
  """What a row must append before episode `e` samples its next turn.

  `cached` tokens of the context are in the row, holding the window that starts at token
  `cached_start` of the episode. Returns (tokens of the row to keep, the chunk to append after
  them, where the new window starts): everything is kept while the window starts at the same
  turn (always when history_turns is 0), only the opening once it has moved on.
  """
  opening, start, end = window.context_span(e.turn_index, e.num_turns, history_turns)
  keep = cached if start == cached_start else min(cached, opening)
  context = e.tokens[:opening] + e.tokens[start:end]
  return keep, context[keep:], start


def _next_context_length(e: Episode, chunk: int, history_turns: int) -> int:
  """Tokens of episode `e`'s next context once a chunk of `chunk` tokens is appended."""
  opening, start, end = window.context_span(e.turn_index, e.num_turns, history_turns)
  return opening + end - start + chunk


def opening_messages(info: dict[str, Any], observation: str, system_prompt: str | None,
                     acknowledgement: str) -> list[dict[str, str]]:
  """The conversation before the first agent turn: system, instruction, canned reply, task."""
  messages = []
  if system_prompt is not None:
    messages.append({"role": "system", "content": system_prompt})
  instruction = info.get("instruction", "")
  if instruction:
    messages.append({"role": "user", "content": instruction})
    messages.append({"role": "assistant",
                     "content": info.get("acknowledgement", acknowledgement)})
  messages.append({"role": "user", "content": observation})
  return messages


def run_episodes(graphdef: nnx.GraphDef, state: nnx.State, tok: ChatTokenizer, pool: Any,
                 task_ids: Sequence[int], group_size: int = 1, max_turns: int = 10,
                 sampling: SamplingConfig = SamplingConfig(), max_context: int = 4096,
                 rng: Any = 0, system_prompt: str | None = None, mesh: Mesh | None = None,
                 acknowledgement: str | None = None, max_chunk: int = 512,
                 compact: bool = True, grow_cache: bool = True, cache_dtype=jnp.float32,
                 replicas: int = 1, rows: Sequence[int] | None = None,
                 on_ended: Callable[[int], None] | None = None, history_turns: int = 0,
                 invalid_action_reward: float = 0.0) -> tuple[Trajectory, dict[str, Any]]:
  """Runs len(task_ids) * group_size episodes to the end and returns them as a Trajectory.

  Args:
    graphdef, state: `nnx.split(decoder)` (state may be sharded on `mesh`).
    tok: the ChatTokenizer of the model.
    pool: an `environments.workers.EnvPool`, or anything with its `reset(task_ids)` /
      `step(slots, responses)` interface returning outcomes with observation, reward,
      terminated, truncated, info. Slots 0..B-1 are (re)started here.
    task_ids: tasks; each runs `group_size` times (rows i*n .. i*n+n-1 share group_id i).
    max_turns: agent turns per episode at most (the horizon).
    sampling: temperature / top-p / top-k / per-turn token cap.
    max_context: tokens per episode at most; a turn starts only if its reply fits.
    rng: PRNG key (typed or raw) or int seed.
    system_prompt: system message; None leaves it to the chat template (Qwen2.5 then inserts
      its default system line).
    mesh: shard the batch over its (data, fsdp) axes.
    acknowledgement: the agent's canned reply to the instruction; default: the environment's
      (`info["acknowledgement"]`, else the pool's env class attribute, else AgentGym's).
    max_chunk: most tokens of a chunk appended in one extend call (longer ones are split).
    compact: shrink the batch when at most half the rows are still running.
    grow_cache: start the KV cache at 256 slots and double it as rows need (fastest: a decode
      step reads the whole cache); False allocates `max_context` slots at once (one cache
      length, so fewer compilations, e.g. where compiling is slow).
    cache_dtype: KV cache dtype.
    replicas: independent batches the episodes are split into, each on its own slice of the
      mesh's data axis (without a mesh: one local device each); see the module docstring.
    rows: which of the len(task_ids) * group_size episodes to run, in order (default all); the
      trajectory then holds these rows only, with their group ids and random keys of the whole
      batch.
    on_ended: called after the openings and after every turn with the number of episodes
      that ended there (e.g. a progress bar's `update`).
    history_turns: k, the turns a turn's context keeps after the opening (rollout/window.py);
      0 keeps them all. The trajectory still holds each episode whole.
    invalid_action_reward: added to the reward of each turn whose action the environment
      refused (`info["invalid_action"]`); success and score are the environment's.

  Returns:
    The Trajectory [B, L] (B = len(task_ids) * group_size) and stats: rollout throughput, plus
    "turn_seconds" (wall time of each turn) and "episodes" (the host-side `Episode` records,
    with stop reasons and the conversation as text).
  """
  if group_size < 1 or max_turns < 1:
    raise ValueError(f"group_size and max_turns must be >= 1, got {group_size}, {max_turns}.")
  if history_turns < 0:
    raise ValueError(f"history_turns must be >= 0 (0 keeps every turn), got {history_turns}.")
  start = time.perf_counter()
  key = _as_key(rng)
  episodes = [Episode(task_id=int(t), group_id=g)
              for g, t in enumerate(task_ids) for _ in range(group_size)]
  total = len(episodes)
  rows = np.arange(total) if rows is None else np.asarray(rows, np.int64)
  if rows.size and (rows.min() < 0 or rows.max() >= total):
    raise ValueError(f"rows must lie in [0, {total}) for {len(task_ids)} tasks x {group_size} "
                     f"samples, got {rows.min()}..{rows.max()}.")
  episodes = [episodes[r] for r in rows]
  num = len(episodes)
  if num == 0:
    raise ValueError("run_episodes needs at least one task id (and one row).")
  if acknowledgement is None:
    acknowledgement = getattr(getattr(pool, "env_cls", None), "acknowledgement",
                              DEFAULT_ACKNOWLEDGEMENT)
  cap = sampling.max_reply_tokens
  eot = tok.end_of_turn_ids[0]
  end_ids = tuple(tok.end_of_turn_ids)

  # ----- reset and openings -------------------------------------------------------------
  outcomes = pool.reset([e.task_id for e in episodes])
  running = np.zeros(num, bool)
  for i, (e, out) in enumerate(zip(episodes, outcomes)):
    e.messages = opening_messages(out.info, out.observation, system_prompt, acknowledgement)
    e.category = out.info.get("category")
    e.append(tok.encode_opening(e.messages), turn=-1)
    if "error" in out.info:
      e.fail(out.info)
    elif out.terminated or out.truncated:
      e.finish("terminated", terminated=out.terminated, truncated=out.truncated)
    elif len(e.tokens) + cap > max_context:
      e.finish("context", truncated=True)
    else:
      running[i] = True
      e.anchors.append(anchor_id(out.observation, out.info))
  if on_ended is not None:
    on_ended(num - int(running.sum()))

  limit = -(-max_context // 128) * 128
  episode_keys = jax.random.split(key, total)[rows]
  batches = []
  for replica_mesh, members in zip(replica_meshes(mesh, replicas),
                                   np.array_split(np.arange(num), replicas)):
    if len(members) == 0:
      continue
    replica_state = state if replicas == 1 else _state_on(state, replica_mesh)
    shards = _shards(replica_mesh)
    batch = _Batch(graphdef, replica_state, -(-len(members) // shards) * shards, limit,
                   grow_cache, replica_mesh, cache_dtype)
    batch.assign(members, episode_keys)
    batches.append(batch)
  in_cache = np.zeros(num, np.int64)  # tokens of each episode's context in its cache row
  # Where the window held in each cache row starts in the episode's tokens (the first kept
  # turn's first token): when the next context starts elsewhere, the row is rewound.
  window_start = np.zeros(num, np.int64)
  ended_on_cap = np.zeros(num, bool)
  turn_seconds, env_seconds, sampled = [], 0.0, 0

  for turn in range(max_turns):
    if not running.any():
      break
    turn_start = time.perf_counter()
    num_running = int(running.sum())
    # Dispatch every replica's extend and decode first; they run while the next is queued.
    turns = []
    for batch in batches:
      live = np.asarray([ep >= 0 and running[ep] for ep in batch.episode_of_row])
      if not live.any():
        continue
      if compact and live.sum() * 2 <= batch.rows:
        target = batch.rows
        while (target % 2 == 0 and (target // 2) % batch.shards == 0
               and live.sum() * 2 <= target):
          target //= 2
        if target < batch.rows:
          batch.compact(np.flatnonzero(live), target)
      row_eps = batch.episode_of_row
      active = np.asarray([ep >= 0 and running[ep] for ep in row_eps])
      held = np.where(row_eps >= 0, in_cache[row_eps], 0)  # tokens in each cache row
      keep, chunks = held.copy(), [[] for _ in row_eps]
      for row, ep in enumerate(row_eps):
        if active[row]:
          keep[row], chunks[row], window_start[ep] = _next_chunk(
              episodes[ep], in_cache[ep], window_start[ep], history_turns)
      if (keep < held).any():
        batch.rewind(keep < held, keep)
      batch.extend(chunks, keep, max_chunk, tok.pad_id)
      for row, ep in enumerate(row_eps):
        if active[row]:
          in_cache[ep] = keep[row] + len(chunks[row])
      keys = _turn_keys(batch.keys, np.int32(turn))
      reach = int(max(in_cache[ep] for ep, act in zip(row_eps, active) if act)) + cap
      turns.append((row_eps, active, batch.decode(
          active, keys, np.full(batch.rows, cap, np.int32), reach, end_ids, sampling)))

    slots, responses = [], []
    samples = jax.device_get([sample for _, _, sample in turns])
    for (row_eps, active, _), (tokens, logprobs, counts) in zip(turns, samples):
      for row, ep in enumerate(row_eps):
        if not active[row]:
          continue
        e, n = episodes[ep], int(counts[row])
        ids = tokens[row, :n].tolist()
        e.append(ids, turn=turn, logprobs=logprobs[row, :n])
        in_cache[ep] += n - 1  # the last sampled token is fed with the next chunk
        sampled += n
        ended_on_cap[ep] = ids[-1] not in end_ids
        reply = ids if ended_on_cap[ep] else ids[:-1]
        text = tok.decode(reply)
        e.messages.append({"role": "assistant", "content": text})
        slots.append(ep)
        responses.append(text)
    env_start = time.perf_counter()
    outcomes = pool.step(slots, responses)
    env_seconds += time.perf_counter() - env_start

    for ep, out in zip(slots, outcomes):
      e = episodes[ep]
      e.record_step(out.reward, out.info, invalid_action_reward)
      e.messages.append({"role": "user", "content": out.observation})
      e.actions.append(out.info.get("action"))
      if "error" in out.info:
        e.fail(out.info)
      elif out.terminated or out.truncated:
        e.finish("terminated" if out.terminated else "env_truncated",
                 terminated=out.terminated, truncated=out.truncated)
      elif e.num_turns >= max_turns:
        e.finish("max_turns", truncated=True)
      else:
        # A reply cut off by the cap is closed with the end-of-turn token it never sampled
        # (loss_mask 0), so the next turn sees a well-formed conversation.
        chunk = ([eot] if ended_on_cap[ep] else []) + tok.encode_observation(out.observation)
        if _next_context_length(e, len(chunk), history_turns) + cap > max_context:
          e.finish("context", truncated=True)
        else:
          e.append(chunk, turn=turn)
          e.anchors.append(anchor_id(out.observation, out.info))
      running[ep] = not e.stop_reason
    turn_seconds.append(time.perf_counter() - turn_start)
    if on_ended is not None:
      on_ended(num_running - int(running.sum()))

  traj = build_trajectory(episodes, tok.pad_id)
  # Outcome statistics of the episodes come from `train.metrics.episode_metrics`.
  stats: dict[str, Any] = {
      "rollout/sampled_tokens": sampled,
      "rollout/seconds": time.perf_counter() - start,
      "rollout/env_seconds": env_seconds,
      "turn_seconds": turn_seconds,
      "episodes": episodes,
  }
  return traj, stats
