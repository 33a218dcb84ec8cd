"""Multi-turn episode runner: B tasks x n samples against an environment pool, one KV cache.

Each episode is one row of a KV cache that lives for the whole rollout (padded to the next
length of 256, 384, 512, 768, ... when the longest row needs it). A turn is two compiled
calls for all active rows together: `extend` appends what is new since the row's last turn
(its previous reply's last token, the observation chunk, or the whole opening at turn 0, each
distinct opening and the prefix they all share prefilled once: rollout/batch.py), then
`decode` samples the reply. Nothing is ever re-encoded: the trajectory's tokens are the opening,
the sampled ids and the observation chunks, exactly as the model saw them.

History window (`history_turns = k > 0`, rollout/window.py): turn t sees the opening and turns
t-k..t-1 only. Once the window drops a turn, the row is rewound to its opening (its cache
length is reset; the opening's keys and values stay valid, as they are the same tokens at the
same positions) and the kept turns are extended again, the same ids as sampled: what the
model sees is exactly `window.context_tokens`, which the trainer's per-turn rows rebuild.

Two schedules (`overlap_env`):

* lock-step (default): every running episode of a batch samples its turn, then their
  environments step together, then the batch's next turn starts. Each turn waits for its
  slowest reply and its slowest environment. With replicas, each batch keeps its own lock-step:
  while one replica's replies are with the host and its environments, the others decode.
* overlapped: each replica's episodes are split into two cohorts, each a batch that runs its
  turns in lock-step, and the cohorts take turns on the device: while one cohort's replies are
  with the environments (`EnvPool.submit`), the other cohort extends and decodes, and a cohort
  starts its next turn as soon as its own observations are back (`EnvPool.collect`). The
  device is not idle while slow environments (a JVM, a browser, a remote server) step. It
  pays where the environments take about as long as a cohort's decoding, and costs a little
  where they are instant, since two half batches use the device worse than one, more so for
  larger models (benchmarks/README.md, Rollout). Samples are the same as in lock-step: a row's
  draws depend on its own key, turn and token index only.

Episodes end when the environment terminates or truncates them, when the pool reports a fault
(the episode is then marked failed, see rollout/trajectory.py), at `max_turns` (or its
environment's lower cap in a mixture: `info["turn_limit"]`), or when the
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

Partial rollouts (`weights`, asynchronous training: docs/async.md): before each turn a batch
may take newer weights; its rows are then emptied and the turn prefills each episode's whole
context with them, so no key or value computed by other weights is ever read. Each turn's
reply records the version that sampled it (`Episode.policy_versions`).

Randomness: episode e draws with key fold_in(fold_in(split(rng, B)[e], turn), step), so its
samples do not depend on which other episodes share the batch, on compaction or on replicas.
`rows` runs only some of the B episodes (a process's share of a multi-host batch, see
agentgym_jax/multihost.py); each keeps the key and group id it has among all B, so a batch's
samples do not depend either on how many processes share it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from agentgym_jax import freed_memory
from agentgym_jax import sharding
from agentgym_jax.rollout import window
from agentgym_jax.rollout.batch import DecodeBatch, replica_meshes, state_on
from agentgym_jax.rollout.envs import DEFAULT_ACKNOWLEDGEMENT
from agentgym_jax.rollout.settings import RolloutSettings
from agentgym_jax.rollout.trajectory import Episode, Trajectory, anchor_id, build_trajectory
from agentgym_jax.tokenization import ChatTokenizer


def _as_key(rng: Any) -> jax.Array:
  if isinstance(rng, int):
    return jax.random.key(rng)
  if jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
    return rng
  return jax.random.wrap_key_data(jnp.asarray(rng, jnp.uint32))


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
  """The conversation before the first agent turn: system, instruction, canned reply, task.

  The reset's `info` may name its own system prompt and acknowledgement (a mixture's pool
  gives each environment's: rollout/envs.py `MixedPool`), which then replace the run's."""
  messages = []
  system_prompt = info.get("system_prompt", system_prompt)
  if system_prompt is not None:
    messages.append({"role": "system", "content": system_prompt})
  instruction = info.get("instruction", "")
  if instruction:
    messages.append({"role": "user", "content": instruction})
    messages.append({"role": "assistant",
                     "content": info.get("acknowledgement", acknowledgement)})
  messages.append({"role": "user", "content": observation})
  return messages


class _Episodes:
  """The host side of a rollout: each episode's record, where its cache row stands, and the
  rules that end it. Both schedules drive the batches through these methods."""

  def __init__(self, episodes: list[Episode], tok: ChatTokenizer, settings: RolloutSettings,
               weights: Callable[[int], tuple[int, nnx.State] | None] | None = None):
    self.episodes, self.tok, self.settings, self.weights = episodes, tok, settings, weights
    self.cap = settings.sampling.max_reply_tokens
    self.end_ids = tuple(tok.end_of_turn_ids)
    num = len(episodes)
    self.running = np.zeros(num, bool)
    self.in_cache = np.zeros(num, np.int64)  # tokens of each episode's context in its row
    # Where the window held in each cache row starts in the episode's tokens (the first kept
    # turn's first token): when the next context starts elsewhere, the row is rewound.
    self.window_start = np.zeros(num, np.int64)
    self.ended_on_cap = np.zeros(num, bool)
    # Each episode's turn limit: the settings', or its environment's cap where lower (a
    # mixture's, from its reset's info["turn_limit"]).
    self.turn_limit = np.full(num, settings.max_turns, np.int64)
    self.sampled = 0

  def open(self, index: int, out: Any, system_prompt: str | None, acknowledgement: str) -> None:
    """Records episode `index`'s reset outcome; it runs unless it already ended."""
    e = self.episodes[index]
    e.messages = opening_messages(out.info, out.observation, system_prompt, acknowledgement)
    e.category = out.info.get("category")
    if out.info.get("turn_limit"):
      self.turn_limit[index] = min(self.settings.max_turns, int(out.info["turn_limit"]))
    e.append(self.tok.encode_opening(e.messages), turn=-1)
    if "error" in out.info:
      e.fail(out.info)
    elif out.terminated or out.truncated:
      e.finish("terminated", terminated=out.terminated, truncated=out.truncated)
    elif len(e.tokens) + self.cap > self.settings.max_context:
      e.finish("context", truncated=True)
    else:
      self.running[index] = True
      e.anchors.append(anchor_id(out.observation, out.info))

  def start_turns(self, batch: DecodeBatch, starting: np.ndarray) -> None:
    """Appends to rows `starting` [rows] bool what their episodes' next contexts add, and
    starts their turns."""
    row_eps = batch.episode_of_row
    held = np.where(row_eps >= 0, self.in_cache[row_eps], 0)  # tokens in each cache row
    keep, chunks = held.copy(), [[] for _ in row_eps]
    for row in np.flatnonzero(starting):
      ep = row_eps[row]
      keep[row], chunks[row], self.window_start[ep] = _next_chunk(
          self.episodes[ep], self.in_cache[ep], self.window_start[ep],
          self.settings.history_turns)
    if (keep < held).any():
      batch.rewind(keep < held, keep)
    batch.extend(chunks, keep, self.settings.max_chunk, self.tok.pad_id)
    for row in np.flatnonzero(starting):
      self.in_cache[row_eps[row]] = keep[row] + len(chunks[row])
    turn_numbers = np.asarray([self.episodes[ep].num_turns if ep >= 0 else 0
                               for ep in row_eps])
    batch.start(starting, turn_numbers)

  def decode(self, batch: DecodeBatch, sampling_rows: np.ndarray) -> None:
    """Dispatches the turns of rows `sampling_rows` [rows] bool."""
    reach = int(self.in_cache[batch.episode_of_row[sampling_rows]].max()) + self.cap
    batch.decode(reach, self.end_ids, self.settings.sampling)

  def begin_turn(self, batch: DecodeBatch, compact: bool) -> np.ndarray | None:
    """Dispatches the next turn of every live row of `batch`, halving the batch first while
    at most half its rows live (with `compact`). Returns those rows [rows] bool, or None when
    no row lives."""
    live = self.live_rows(batch)
    if not live.any():
      return None
    if compact and live.sum() * 2 <= batch.rows:
      _compact(batch, live)
      live = self.live_rows(batch)
    newer = self.weights(batch.version) if self.weights is not None else None
    if newer is not None:
      self.reload(batch, *newer)
    self.start_turns(batch, live)
    self.decode(batch, live)
    return live

  def reload(self, batch: DecodeBatch, version: int, state: nnx.State) -> None:
    """Puts version `version`'s weights in `batch`: every row is emptied, so the next turn
    prefills its whole context again with them. A cache computed by other weights is never
    read (docs/async.md: what reusing it would cost)."""
    batch.state = state if self.settings.replicas == 1 else state_on(state, batch.mesh)
    batch.version = version
    rows = batch.episode_of_row >= 0
    batch.rewind(rows, np.zeros(batch.rows, np.int64))
    self.in_cache[batch.episode_of_row[rows]] = 0
    self.window_start[batch.episode_of_row[rows]] = 0

  def take_replies(self, batch: DecodeBatch, live: np.ndarray, sampled: tuple[np.ndarray, ...]
                   ) -> tuple[list[int], list[str]]:
    """Records the turn rows `live` sampled (`sampled`: the batch's fetched turn tokens,
    log-probs and counts) and the version that sampled them; returns their episodes and reply
    texts."""
    tokens, logprobs, counts = sampled
    slots = [int(ep) for ep in batch.episode_of_row[live]]
    if batch.version is not None:
      for ep in slots:
        self.episodes[ep].policy_versions.append(batch.version)
    return slots, [self.take_reply(ep, tokens[row], logprobs[row], int(counts[row]))
                   for ep, row in zip(slots, np.flatnonzero(live))]

  def take_reply(self, ep: int, tokens: np.ndarray, logprobs: np.ndarray, count: int) -> str:
    """Records the `count` tokens episode `ep` sampled this turn; returns the reply's text."""
    e = self.episodes[ep]
    ids = tokens[:count].tolist()
    e.append(ids, turn=e.num_turns, logprobs=logprobs[:count])
    self.in_cache[ep] += count - 1  # the last sampled token is fed with the next chunk
    self.sampled += count
    self.ended_on_cap[ep] = ids[-1] not in self.end_ids
    text = self.tok.decode(ids if self.ended_on_cap[ep] else ids[:-1])
    e.messages.append({"role": "assistant", "content": text})
    return text

  def record_step(self, ep: int, out: Any) -> bool:
    """Applies the environment's answer to episode `ep`'s turn; True while it runs on."""
    e = self.episodes[ep]
    e.record_step(out.reward, out.info, self.settings.invalid_action_reward)
    e.messages.append({"role": "user", "content": out.observation})
    e.actions.append(out.info.get("action"))
    if "error" in out.info:
      e.fail(out.info)
    elif out.terminated or out.truncated:
      e.finish("terminated" if out.terminated else "env_truncated",
               terminated=out.terminated, truncated=out.truncated)
    elif e.num_turns >= self.turn_limit[ep]:
      e.finish("max_turns", truncated=True)
    else:
      # A reply cut off by the cap is closed with the end-of-turn token it never sampled
      # (loss_mask 0), so the next turn sees a well-formed conversation.
      chunk = (([self.tok.end_of_turn_ids[0]] if self.ended_on_cap[ep] else [])
               + self.tok.encode_observation(out.observation))
      reach = _next_context_length(e, len(chunk), self.settings.history_turns) + self.cap
      if reach > self.settings.max_context:
        e.finish("context", truncated=True)
      else:
        e.append(chunk, turn=e.num_turns - 1)
        e.anchors.append(anchor_id(out.observation, out.info))
    self.running[ep] = not e.stop_reason
    return bool(self.running[ep])

  def live_rows(self, batch: DecodeBatch) -> np.ndarray:
    """[rows] bool: rows holding an episode that has not ended."""
    row_eps = batch.episode_of_row
    return (row_eps >= 0) & self.running[np.maximum(row_eps, 0)]


def _compact(batch: DecodeBatch, live: np.ndarray) -> None:
  """Halves the batch (repeatedly) while at most half its rows are `live`."""
  target = batch.rows
  while target % 2 == 0 and (target // 2) % batch.shards == 0 and live.sum() * 2 <= target:
    target //= 2
  if target < batch.rows:
    batch.compact(np.flatnonzero(live), target)


class _BlockingSubmit:
  """`submit` / `collect` over a pool that only steps synchronously: a submitted step runs
  when it is collected."""

  def __init__(self, pool: Any):
    self.pool, self.queue = pool, []

  def submit(self, slots: list[int], responses: list[str]) -> None:
    self.queue.append((slots, responses))

  def collect(self, timeout_s: float | None = None) -> list[tuple[int, Any]]:
    del timeout_s  # the steps run now
    done = [pair for slots, responses in self.queue
            for pair in zip(slots, self.pool.step(slots, responses))]
    self.queue = []
    return done


def _lockstep(host: _Episodes, batches: list[DecodeBatch], pool: Any, compact: bool,
              on_ended: Callable[[int], None] | None) -> tuple[list[float], float]:
  """Turn after turn: a batch's running episodes sample, then their environments step.

  Each batch (replica) keeps its own lock-step: its replies are fetched in dispatch order, its
  environments step and its next turn is dispatched while the other batches still decode, so
  no device sits idle through another replica's replies, environment steps and next chunks
  (with one batch this is the plain loop).

  Returns the wall time of each turn (until every batch has finished it) and the seconds spent
  stepping environments.
  """
  start = time.perf_counter()
  finished_at: dict[int, float] = {}  # turn -> when the last batch finished it
  env_seconds = 0.0
  queue = collections.deque((batch, live, 0) for batch in batches
                            if (live := host.begin_turn(batch, compact)) is not None)
  while queue:
    batch, live, turn = queue.popleft()
    num_running = int(host.running.sum())
    sampled = jax.device_get((batch.turn.tokens, batch.turn.logprobs, batch.turn.counts))
    slots, responses = host.take_replies(batch, live, sampled)
    env_start = time.perf_counter()
    outcomes = pool.step(slots, responses)
    env_seconds += time.perf_counter() - env_start
    for ep, out in zip(slots, outcomes):
      host.record_step(ep, out)
    finished_at[turn] = time.perf_counter()
    if on_ended is not None:
      on_ended(num_running - int(host.running.sum()))
    if not queue:
      # No batch decodes now (one replica, between its turns): the next turn's chunk widths
      # and cache lengths are new shapes, and what the finished turns built may go
      # (freed_memory.ProgramBudget).
      freed_memory.release_if_over_budget()
    if (live := host.begin_turn(batch, compact)) is not None:
      queue.append((batch, live, turn + 1))
  ends = [start] + [finished_at[turn] for turn in sorted(finished_at)]
  return [b - a for a, b in zip(ends, ends[1:])], env_seconds


def _overlapped(host: _Episodes, batches: list[DecodeBatch], pool: Any, compact: bool,
                on_ended: Callable[[int], None] | None) -> float:
  """Cohorts take turns: a batch decodes while the others' environments step.

  Returns the seconds the host waited for the environments with no batch left to decode.
  """
  if not hasattr(pool, "submit"):
    pool = _BlockingSubmit(pool)
  ready = list(range(len(batches)))  # batches whose next turn can start
  decoding: collections.deque[tuple[int, np.ndarray]] = collections.deque()  # oldest first
  owed = [0] * len(batches)  # environment steps a batch waits for
  batch_of = {}  # episode -> its batch
  env_seconds = 0.0
  while host.running.any():
    for index in ready:
      if (live := host.begin_turn(batches[index], compact)) is not None:
        decoding.append((index, live))
    ready = []
    if decoding:
      # The oldest batch's replies go to the environments while the next batch decodes.
      index, live = decoding.popleft()
      batch = batches[index]
      sampled = jax.device_get((batch.turn.tokens, batch.turn.logprobs, batch.turn.counts))
      slots, responses = host.take_replies(batch, live, sampled)
      pool.submit(slots, responses)
      owed[index] = len(slots)
      batch_of.update((ep, index) for ep in slots)
    # Poll while a batch decodes; otherwise wait for the first answer.
    wait_start = time.perf_counter()
    answered = pool.collect(0.0 if decoding else None)
    if not decoding:
      env_seconds += time.perf_counter() - wait_start
    ended = 0
    for ep, out in answered:
      ended += not host.record_step(ep, out)
      index = batch_of.pop(ep)
      owed[index] -= 1
      if owed[index] == 0:
        ready.append(index)
    if ended and on_ended is not None:
      on_ended(ended)
  return env_seconds


def run_episodes(policy: tuple[nnx.GraphDef, nnx.State], tok: ChatTokenizer, pool: Any,
                 task_ids: Sequence[int], settings: RolloutSettings, *, rng: Any = 0,
                 mesh: Mesh | None = None, rows: Sequence[int] | None = None,
                 on_ended: Callable[[int], None] | None = None, version: int | None = None,
                 weights: Callable[[int], tuple[int, nnx.State] | None] | None = None
                 ) -> tuple[Trajectory, dict[str, Any]]:
  """Runs len(task_ids) * settings.group_size episodes to the end; returns them as a Trajectory.

  Args:
    policy: `nnx.split(decoder)`, (graphdef, state); the state may be sharded on `mesh`.
    tok: the ChatTokenizer of the model.
    pool: an `environments.workers.EnvPool`, or anything with its `reset(task_ids)` /
      `step(slots, responses)` interface returning outcomes with observation, reward,
      terminated, truncated, info (and `submit` / `collect` for `overlap_env`; without them
      a submitted step runs when it is collected). Slots 0..B-1 are (re)started here.
    task_ids: tasks; each runs `settings.group_size` times.
    settings: sampling, group size, turn and context limits and the rest
      (rollout/settings.py).
    rng: PRNG key (typed or raw) or int seed.
    mesh: shard the batch over its (data, fsdp) axes.
    rows: which of the len(task_ids) * group_size episodes to run, in order (default all); the
      trajectory then holds these rows only, with their group ids and random keys of the whole
      batch.
    on_ended: called after the openings and whenever episodes end, with their number (e.g. a
      progress bar's `update`).
    version: the policy version of `policy` (updates its weights had), recorded per turn in
      each episode's `policy_versions` (None: nothing recorded, e.g. in evaluation).
    weights: partial rollouts (asynchronous training; needs `version`): called with a
      batch's version before each of its turns; newer weights it returns, (version, state)
      placed as `policy`'s state, sample from that turn on, each row's context prefilled
      again with them (never a cache computed by other weights).

  Returns:
    The Trajectory [B, L] (B = len(task_ids) * group_size) and stats: rollout throughput,
    "rollout/env_seconds" (time the host waited for the environments), "turn_seconds" (wall
    time of each lock-step turn; empty when overlapped) and "episodes" (the host-side
    `Episode` records, with stop reasons and the conversation as text).
  """
  graphdef, state = policy
  s = settings
  start = time.perf_counter()
  key = _as_key(rng)
  episodes = [Episode(task_id=int(t), group_id=g)
              for g, t in enumerate(task_ids) for _ in range(s.group_size)]
  total = len(episodes)
  rows = np.arange(total) if rows is None else np.asarray(rows, np.int64)
  if rows.size and (rows.min() < 0 or rows.max() >= total):
    raise ValueError(f"rows must lie in [0, {total}) for {len(task_ids)} tasks x "
                     f"{s.group_size} samples, got {rows.min()}..{rows.max()}.")
  episodes = [episodes[r] for r in rows]
  num = len(episodes)
  if num == 0:
    raise ValueError("run_episodes needs at least one task id (and one row).")
  if weights is not None and version is None:
    raise ValueError("run_episodes: `weights` (partial rollouts) needs the policy's `version`.")
  acknowledgement = s.acknowledgement
  if acknowledgement is None:
    acknowledgement = getattr(getattr(pool, "env_cls", None), "acknowledgement",
                              DEFAULT_ACKNOWLEDGEMENT)
  host = _Episodes(episodes, tok, s, weights)
  for i, out in enumerate(pool.reset([e.task_id for e in episodes])):
    host.open(i, out, s.system_prompt, acknowledgement)
  if on_ended is not None:
    on_ended(num - int(host.running.sum()))

  limit = -(-s.max_context // 128) * 128
  episode_keys = jax.random.split(key, total)[rows]
  batches = []
  for replica_mesh, members in zip(replica_meshes(mesh, s.replicas),
                                   np.array_split(np.arange(num), s.replicas)):
    replica_state = state if s.replicas == 1 else state_on(state, replica_mesh)
    shards = sharding.data_parallel_size(replica_mesh)
    for cohort in np.array_split(members, 2 if s.overlap_env else 1):
      if len(cohort) == 0:
        continue
      batch = DecodeBatch(graphdef, replica_state, -(-len(cohort) // shards) * shards, limit,
                          s.grow_cache, replica_mesh, s.sampling.max_reply_tokens)
      batch.assign(cohort, episode_keys)
      batch.version = version
      batches.append(batch)

  if s.overlap_env:
    turn_seconds, env_seconds = [], _overlapped(host, batches, pool, s.compact, on_ended)
  else:
    turn_seconds, env_seconds = _lockstep(host, batches, pool, s.compact, on_ended)

  traj = build_trajectory(episodes, tok.pad_id)
  # Outcome statistics of the episodes come from `train.metrics.episode_metrics`.
  stats: dict[str, Any] = {
      "rollout/sampled_tokens": host.sampled,
      "rollout/seconds": time.perf_counter() - start,
      "rollout/env_seconds": env_seconds,
      "turn_seconds": turn_seconds,
      "episodes": episodes,
  }
  return traj, stats
