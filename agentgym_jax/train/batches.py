"""A training step's batch, one function per mode: `rl_batch` (rollout, scoring, advantages)
and `bc_batch` (the expert's demonstrations). The trainer picks one per run and calls it every
step; each returns a `StepBatch`: the update's batch and what the step logs and saves of it.

Layouts: the update trains one packed row per episode, or with a history window
(`rollout.history_turns`) one row per turn holding the context the model saw
(rollout/window.py). Advantages are computed on the packed episodes either way, every estimator
(group, turn-level and critic ones) included: log-probs and values scored on the per-turn rows
are moved to their tokens in the episodes' rows, and the advantages and returns back. A
group's episodes, a turn's place in its episode and the critic's successive states (each the
context a turn was sampled in) are then what the estimator sees, and each episode counts once.

Log-probs (scored and the update's) are computed at the update rows' agent tokens only, the
positions every reader of them reads (`update.scored_positions`, from the host's loss mask).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentgym_jax import freed_memory, multihost
from agentgym_jax import sharding as sharding_lib
from agentgym_jax.rl import advantages as advantages_lib, algorithm
from agentgym_jax.rl import dynamic_sampling, overlong as overlong_lib
from agentgym_jax.rl import schedule as schedule_lib
from agentgym_jax.rollout import RolloutSettings, build_trajectory, envs, run_episodes, window
from agentgym_jax.rollout.batch import replica_meshes
from agentgym_jax.train import metrics as metrics_lib, packing, provenance
from agentgym_jax.train import state as state_lib
from agentgym_jax.train import update as update_lib
from agentgym_jax.train.data import TaskStream

@dataclasses.dataclass(frozen=True)
class StepInputs:
  """What a run's step batches are made from: built once, before the first step.

  rollout, env, schedule: the run's typed settings (`agentgym_jax.settings`; env this
  process's); scorers: `update.make_scorers`' (log-probs, values or None); advantages: the
  jitted estimator of `algorithm.make_advantage_fn` (None in behaviour cloning); demos: the
  expert's episodes (behaviour cloning; the task stream then runs over their indices).
  """

  config: ml_collections.ConfigDict
  update: update_lib.UpdateConfig
  tok: Any
  pool: Any
  stream: TaskStream
  mesh: Mesh
  share: multihost.ProcessShare
  policy_def: nnx.GraphDef
  rollout: RolloutSettings
  env: envs.EnvSettings
  schedule: schedule_lib.Schedule
  scorers: tuple[Callable, Callable | None] | None = None
  advantages: Callable | None = None
  demos: Sequence[Any] = ()

  @property
  def spec(self) -> algorithm.AlgorithmSpec:
    return self.update.algo

  @property
  def rows(self) -> int:
    return self.config.data.batch_tasks * self.config.data.group_size

  def put(self, x: Any) -> jax.Array:
    """A host array as a global array, rows over the mesh's batch axes."""
    return sharding_lib.put_global(np.asarray(x),
                                   NamedSharding(self.mesh, P(sharding_lib.BATCH_AXES)))


@dataclasses.dataclass
class StepBatch:
  """One step's batch and what is logged and saved of it.

  batch: the update's (`update.Batch`), global arrays.
  host: the packed episodes (`Trajectory` [B, L]) as host arrays.
  episodes: their records (`Episode`), rows in order.
  cursor: the task stream's position after this step's draws.
  trained_tokens: the valid tokens of the update's rows (per epoch).
  metrics: episode statistics, rollout throughput, diagnostics and `time/` of the phases
    before the update.
  per_token: [B, L] arrays saved with the step's trajectories (advantages, values).
  replay: what regenerates the step's episodes (`provenance.step_provenance`), when saved.
  """

  batch: update_lib.Batch
  host: Any
  episodes: list[Any]
  cursor: int
  trained_tokens: int
  metrics: dict[str, float]
  per_token: dict[str, Any] = dataclasses.field(default_factory=dict)
  replay: dict[str, Any] | None = None


def row_multiple(config: ml_collections.ConfigDict, mesh: Mesh) -> int:
  """What the update's row count must be a multiple of: minibatches x microbatches x
  data-parallel devices (per-turn rows are padded to one), times the rows of a packed row."""
  return (config.algo.minibatches * config.algo.microbatches
          * sharding_lib.data_parallel_size(mesh) * config.algo.pack_rows)


def check_layout(config: ml_collections.ConfigDict, mesh: Mesh,
                 rollout_mesh: Mesh | None = None) -> None:
  """Fails early, with the numbers, when the rows of a step cannot be split as configured:
  over the update's `mesh`, and into `rollout.replicas` on the rollout's mesh (`rollout_mesh`,
  by default the same)."""
  rows = config.data.batch_tasks * config.data.group_size
  if rows % row_multiple(config, mesh):
    raise ValueError(
        f"data.batch_tasks x data.group_size = {rows} rows per step must be divisible by "
        f"algo.minibatches x algo.microbatches x data-parallel devices x algo.pack_rows = "
        f"{config.algo.minibatches} x {config.algo.microbatches} x "
        f"{sharding_lib.data_parallel_size(mesh)} x {config.algo.pack_rows}; change one of "
        "them.")
  if config.algo.pack_rows > 1 and config.rollout.history_turns:
    raise ValueError("algo.pack_rows packs whole episodes; with a history window "
                     "(rollout.history_turns) set algo.pack_rows=1.")
  try:
    replica_meshes(mesh if rollout_mesh is None else rollout_mesh, config.rollout.replicas)
  except ValueError as exc:
    raise ValueError(f"rollout.replicas: {exc}") from exc


def _layouts(rows: window.TurnRows | None, put: Callable, shape: tuple[int, int]
             ) -> tuple[Callable, Callable]:
  """(to the packed episodes [B, L], to the update's rows): how per-token arrays move between
  the layouts; identities when the update trains the packed rows (`rows` None)."""
  if rows is None:
    return (lambda x: x), (lambda x: x)
  episode, source = put(rows.episode), put(rows.source)
  return (lambda x: window.to_packed(x, episode, source, shape),
          lambda x: window.to_rows(x, episode, source))


def _trained_rows(inputs: StepInputs, host: Any) -> tuple[Any, window.TurnRows | None]:
  """The update's rows: the packed episodes, or with a history window one row per turn, its
  context as the model saw it (rollout/window.py)."""
  history = inputs.config.rollout.history_turns
  if not history:
    return host, None
  turn_rows = window.build_turn_rows(host, history, inputs.tok.pad_id,
                                     row_multiple(inputs.config, inputs.mesh))
  return turn_rows, turn_rows


def _scored_positions(put: Callable, loss_mask: np.ndarray) -> jax.Array | None:
  """`update.scored_positions` of the update rows' host loss mask, as a global array."""
  positions = update_lib.scored_positions(loss_mask)
  return None if positions is None else put(positions)


def _packed(inputs: StepInputs, rows: Any) -> dict[str, Any] | None:
  """The update rows' packed rows (`update.packed_fields`), or None when `algo.pack_rows` is
  1 (rows as they are). A group's samples share their opening; without groups (behaviour
  cloning's demonstrations) a packed row's rows share theirs (the system prompt)."""
  k, group = inputs.update.pack_rows, inputs.config.data.group_size
  if k == 1:
    return None
  return update_lib.packed_fields(
      packing.pack_rows(rows.tokens, rows.valid, k, min(group, k) if group > 1 else k,
                        inputs.tok.pad_id), inputs.put)


def _forward_positions(tokens: Any, packed: dict[str, Any] | None) -> dict[str, float]:
  """`batch/forward_positions`: the positions each forward of the update computes, R x L of
  the rows or G x Lp of their packed rows."""
  shape = (tokens if packed is None else packed["packed"]["tokens"]).shape
  return {"batch/forward_positions": float(np.prod(shape))}


def bc_batch(inputs: StepInputs, state: state_lib.TrainState, step: int, cursor: int,
             max_turns: int, saving: bool) -> StepBatch:
  """The next `rows` demonstrations of the shuffled stream, trained with cross-entropy (no
  log-probs, advantages or rollout). `step`, `max_turns` and `saving` are unused: the
  demonstrations were played once, to the schedule's longest horizon."""
  del state, step, max_turns, saving
  start = time.perf_counter()
  chosen = [inputs.demos[i] for i in inputs.stream.take(cursor, inputs.rows)]
  host = jax.device_get(build_trajectory(chosen, inputs.tok.pad_id))
  trained, turn_rows = _trained_rows(inputs, host)
  put = inputs.put
  packed = _packed(inputs, trained)
  batch = update_lib.build_batch(
      inputs.spec, tokens=put(trained.tokens), valid=put(trained.valid),
      loss_mask=put(trained.loss_mask),
      seq_tokens=None if turn_rows is None else put(turn_rows.episode_tokens),
      scored_positions=_scored_positions(put, trained.loss_mask),
      packed=packed)
  # The batch is the expert's, not the policy's: its statistics are logged apart.
  logged = {k.replace("episodes/", "demos/"): v
            for k, v in metrics_lib.episode_metrics(host, chosen).items()}
  logged.update(_forward_positions(batch["tokens"], packed))
  logged.update({"rollout/tokens_per_s": 0.0, "rollout/env_seconds": 0.0,
                 "time/rollout": time.perf_counter() - start, "time/score": 0.0,
                 "time/advantages": 0.0})
  return StepBatch(batch=batch, host=host, episodes=chosen, cursor=cursor + inputs.rows,
                   trained_tokens=int(np.sum(trained.valid)), metrics=logged)


def _sample(inputs: StepInputs, params: Any, task_ids: list[int], max_turns: int,
            key: jax.Array, version: int, weights: Callable | None
            ) -> tuple[Any, dict[str, Any]]:
  """This process's rows of a batch rolled out on its devices, gathered on every process."""
  settings = dataclasses.replace(inputs.rollout, max_turns=max_turns)
  mine = inputs.share.rows(inputs.rows)  # this process's rows (None: all of them)
  # The mesh the weights are on (`rollout_params`' rollout mesh, or the asynchronous
  # rollout's devices): the rows are sharded there too.
  traj, stats = run_episodes((inputs.policy_def, params), inputs.tok, inputs.pool, task_ids,
                             settings, rng=key, mesh=sharding_lib.mesh_of(params), rows=mine,
                             version=version, weights=weights)
  traj, stats["episodes"] = multihost.gather_trajectory(traj, stats["episodes"], mine,
                                                        inputs.tok.pad_id)
  return traj, stats


@dataclasses.dataclass
class Sampled:
  """One step's rollouts before scoring: what `sample_step` drew and the update needs of it.

  step: the step (0-based) whose batch this is; cursor: the task stream's position after its
  draws; version: the policy version that sampled it (updates completed by those weights,
  `state.step`); traj/episodes: the episodes (`Trajectory` [B, L], device or host arrays, and
  their records); task_ids/key/max_turns: the first round's tasks, sampler key and turn
  limit (a replay regenerates round 1 only); drawn: rounds of tasks drawn (dynamic sampling);
  devices: the rollout mesh's device count; metrics: dynamic sampling's and the rollout's
  throughput and `time/rollout`.
  """

  step: int
  cursor: int
  version: int
  traj: Any
  episodes: list[Any]
  task_ids: list[int]
  key: jax.Array
  max_turns: int
  drawn: int
  devices: int
  metrics: dict[str, float]


def rollout_params(inputs: StepInputs, policy: Any) -> Any:
  """The weights the rollout samples with: this process's copy of `policy`, in the update's
  compute dtype (a bf16 copy of float32 weights when the run is mixed precision: half the
  per-host copy and KV cache), laid out on the process's rollout mesh (`state.rollout_layout`:
  heads and MLP split over the chips FSDP shards them over, so that no decoded token gathers
  weights)."""
  local = inputs.share.local(update_lib.as_compute(policy, inputs.update.compute_dtype))
  mesh, shardings = state_lib.rollout_layout(inputs.policy_def, local, inputs.share.mesh)
  return local if mesh is inputs.share.mesh else jax.device_put(local, shardings)


def sample_step(inputs: StepInputs, params: Any, *, rng: Any, step: int, cursor: int,
                max_turns: int, version: int, weights: Callable | None = None) -> Sampled:
  """The policy's rollouts of the step's tasks from `cursor` (more rounds with dynamic
  sampling), sampled with `params` (`rollout_params`, of policy `version`) on `inputs`' mesh;
  `rng` is the run's raw key data (`state.rng`); `weights`: newer weights episodes take up
  between turns (partial rollouts, `run_episodes`). `version` is that of the first turns: the
  oldest weights of the batch."""
  config, spec = inputs.config, inputs.spec
  tasks = config.data.batch_tasks
  start = time.perf_counter()
  task_ids = inputs.stream.take(cursor, tasks)
  key = state_lib.step_key(jax.device_get(rng), step, state_lib.ROLLOUT_STREAM)
  traj, stats = _sample(inputs, params, task_ids, max_turns, key, version, weights)
  drawn, logged = 1, {}
  if spec.dynamic_sampling:  # DAPO: more rounds of tasks until the groups carry signal
    draw = lambda r: _sample(inputs, params, inputs.stream.take(cursor + r * tasks, tasks),
                             max_turns, jax.random.fold_in(key, r), version, weights)
    traj, stats, drawn, logged = dynamic_sampling.sample_until_full(
        (traj, stats), draw, batch_tasks=tasks,
        group_size=config.data.group_size, max_extra_rounds=spec.dynamic_sampling_max_rounds,
        rewards_of=lambda t: overlong_lib.apply(t, spec.overlong, spec.overlong_penalty)[0],
        build=lambda episodes: build_trajectory(episodes, inputs.tok.pad_id))
  seconds = time.perf_counter() - start
  logged.update({
      "rollout/tokens_per_s": stats["rollout/sampled_tokens"] / max(seconds, 1e-9),
      "rollout/env_seconds": float(stats["rollout/env_seconds"]), "time/rollout": seconds})
  return Sampled(step=step, cursor=cursor + drawn * tasks, version=version, traj=traj,
                 episodes=stats["episodes"], task_ids=task_ids, key=key,
                 max_turns=max_turns, drawn=drawn,
                 devices=inputs.mesh.size, metrics=logged)


def rl_batch(inputs: StepInputs, state: state_lib.TrainState, step: int, cursor: int,
             max_turns: int, saving: bool) -> StepBatch:
  """The policy's rollouts of the next tasks, sampled by the state's own weights and scored
  (`scored_batch`): the synchronous step."""
  sampled = sample_step(inputs, rollout_params(inputs, state.policy), rng=state.rng,
                        step=step, cursor=cursor, max_turns=max_turns,
                        version=int(jax.device_get(state.step)))
  return scored_batch(inputs, state, sampled, saving=saving)


def scored_batch(inputs: StepInputs, state: state_lib.TrainState, sampled: Sampled, *,
                 saving: bool) -> StepBatch:
  """A step's rollouts scored by the policy, the reference and the critic, with the
  estimator's advantages: the update's batch. The stages, each a function of its own:
  `update_rows` (the episodes and the update's rows, built once) -> `score` (log-probs and
  values) -> `advantages` -> `update_batch`, and `diagnostics` of them all.

  Episodes sampled by older weights than the state's (asynchronous rollout,
  train/asynchronous.py) are scored the same way: the state's policy is the proximal one, and
  truncated importance sampling (`algo.tis_cap`) weighs each token by it over the sampler's
  log-probs."""
  # A replay regenerates round 1 of a step sampled by the checkpoint of the step before.
  on_policy = sampled.version == int(jax.device_get(state.step))
  replay = provenance.step_provenance(
      inputs.config, sampled.step + 1, sampled.task_ids, sampled.key, sampled.max_turns,
      provenance.policy_checksum(state.policy), sampled.devices
  ) if saving and on_policy and sampled.drawn == 1 else None
  rolled = time.perf_counter()
  rows = update_rows(inputs, sampled.traj)
  # The reference's and the critic's forwards: a peak of their own (compile.max_resident_gib).
  with freed_memory.ahead_of("score"):
    scores = jax.block_until_ready(score(inputs, state, rows))
  scored = time.perf_counter()
  estimated = advantages(inputs, rows, scores)
  advantaged = time.perf_counter()
  batch = update_batch(inputs, rows, scores, estimated)
  logged, per_token = diagnostics(inputs, rows, estimated, sampled.episodes,
                                  saving=saving)
  logged = {**sampled.metrics, **logged, **_forward_positions(rows.tokens, rows.packed),
            "time/score": scored - rolled, "time/advantages": advantaged - scored}
  return StepBatch(batch=batch, host=rows.episodes, episodes=sampled.episodes,
                   cursor=sampled.cursor, trained_tokens=int(np.sum(rows.host.valid)),
                   metrics=logged, per_token=per_token, replay=replay)


@dataclasses.dataclass(frozen=True)
class UpdateRows:
  """A batch's episodes and the rows the update trains, built once.

  episodes: the packed episodes (`Trajectory` [B, L], host arrays, on every process).
  host: the update's rows as host arrays: `episodes` itself, or with a history window one row
    per turn (`window.TurnRows`, then also `turns`).
  tokens, valid, loss_mask: [R, L'] the update's rows on the mesh; positions: their agent
    tokens, where log-probs are computed (`update.scored_positions`; None: every position);
    packed: their packed rows (`update.packed_fields`; None without `algo.pack_rows`).
  to_episodes / to_rows: move a per-token array between the two layouts (identities
    without a window).
  """

  episodes: Any
  host: Any
  turns: window.TurnRows | None
  tokens: jax.Array
  valid: jax.Array
  loss_mask: jax.Array
  positions: jax.Array | None
  packed: dict[str, Any] | None
  to_episodes: Callable
  to_rows: Callable

  def forward_inputs(self) -> dict[str, Any]:
    """What the scorers read of the rows (`update.make_scorers`)."""
    rows = {"tokens": self.tokens, "valid": self.valid}
    if self.positions is not None:
      rows["scored_positions"] = self.positions
    return rows | (self.packed or {})


def update_rows(inputs: StepInputs, traj: Any) -> UpdateRows:
  """The episodes `traj` (device or host arrays) and the update's rows of them."""
  put = inputs.put
  episodes = jax.device_get(traj)  # the whole batch, on every process
  host, turns = _trained_rows(inputs, episodes)
  to_episodes, to_rows = _layouts(turns, put, episodes.tokens.shape)
  # The log-probs' readers (the loss, the in-reward KL, the diagnostics; on the packed rows
  # through `to_episodes`) read these rows' agent tokens only; the overlong filter drops some.
  return UpdateRows(episodes=episodes, host=host, turns=turns, tokens=put(host.tokens),
                    valid=put(host.valid), loss_mask=put(host.loss_mask),
                    positions=_scored_positions(put, host.loss_mask),
                    packed=_packed(inputs, host), to_episodes=to_episodes, to_rows=to_rows)


@dataclasses.dataclass(frozen=True)
class Scores:
  """[R, L'] on the update's rows: old log-probs (zeros when the update's own forward gives
  them, `AlgorithmSpec.old_logprobs_from_update`), the reference's (zeros without one) and the
  critic's values (zeros without one)."""

  old_logprobs: jax.Array
  ref_logprobs: jax.Array
  values: jax.Array


def score(inputs: StepInputs, state: state_lib.TrainState, rows: UpdateRows) -> Scores:
  """The scoring passes over the update's rows; returns once they are computed."""
  score_logprobs, score_values = inputs.scorers
  forward = rows.forward_inputs()
  zeros = jnp.zeros(rows.tokens.shape, jnp.float32, device=rows.tokens.sharding)
  old_logprobs = (zeros if inputs.spec.old_logprobs_from_update
                  else score_logprobs(state.policy, forward))
  reference = state_lib.reference_params(state)  # with LoRA: the policy, its adapters off
  ref_logprobs = (score_logprobs(reference, forward) if reference is not None else zeros)
  values = score_values(state.critic, forward) if score_values is not None else zeros
  jax.block_until_ready((old_logprobs, ref_logprobs, values))
  return Scores(old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, values=values)


@dataclasses.dataclass(frozen=True)
class Advantages:
  """The estimator's inputs and outputs on the packed episodes [B, L]: the scores it read
  (old log-probs, values), its advantages, returns and in-reward KL, and which episodes ran
  over the length limit ([B] bool, `rl.overlong`)."""

  old_logprobs: jax.Array
  values: jax.Array
  advantages: jax.Array
  returns: jax.Array
  reward_kl: jax.Array
  overlong: np.ndarray


def advantages(inputs: StepInputs, rows: UpdateRows, scores: Scores) -> Advantages:
  """The estimator over the packed episodes: every agent token sits once in its episode's
  row, so each estimator sees the episodes (groups, turns, its critic's successive states)
  whatever the update's rows. Returns once they are computed."""
  spec, put, episodes = inputs.spec, inputs.put, rows.episodes
  rewards, turn_rewards, overlong = overlong_lib.apply(episodes, spec.overlong,
                                                       spec.overlong_penalty)
  turns = (advantages_lib.Turns(index=put(episodes.turn_index), rewards=put(turn_rewards),
                                anchors=put(episodes.turn_anchors))
           if spec.uses_turns else None)
  old_lp, ref_lp, values = map(rows.to_episodes, (scores.old_logprobs, scores.ref_logprobs,
                                                  scores.values))
  adv, returns, reward_kl = inputs.advantages(
      rewards=put(rewards),
      mask=rows.loss_mask if rows.turns is None else put(episodes.loss_mask),
      group_ids=put(episodes.group_id), old_logprobs=old_lp, ref_logprobs=ref_lp,
      values=values, turns=turns)
  return Advantages(old_logprobs=old_lp, values=values, advantages=jax.block_until_ready(adv),
                    returns=returns, reward_kl=reward_kl, overlong=overlong)


def update_batch(inputs: StepInputs, rows: UpdateRows, scores: Scores, adv: Advantages
                 ) -> update_lib.Batch:
  """The update's batch: the rows, their scores and advantages (`update.build_batch`)."""
  spec, put = inputs.spec, inputs.put
  mask = rows.loss_mask
  if spec.overlong == "filter":  # out of the loss, still in their group's baseline (DAPO)
    mask = put(overlong_lib.mask_rows(rows.host.loss_mask, adv.overlong,
                                      None if rows.turns is None else rows.turns.episode))
  return update_lib.build_batch(
      spec, tokens=rows.tokens, valid=rows.valid, loss_mask=mask,
      old_logprobs=scores.old_logprobs, advantages=rows.to_rows(adv.advantages),
      ref_logprobs=scores.ref_logprobs, returns=rows.to_rows(adv.returns),
      values=scores.values,
      seq_tokens=None if rows.turns is None else put(rows.turns.episode_tokens),
      rollout_logprobs=(put(rows.host.sample_logprobs) if spec.trains_with_rollout_logprobs
                        else None),
      scored_positions=rows.positions, packed=rows.packed)


def diagnostics(inputs: StepInputs, rows: UpdateRows, adv: Advantages,
                episodes: list[Any], *, saving: bool
                ) -> tuple[dict[str, float], dict[str, np.ndarray]]:
  """The step's episode statistics and batch diagnostics (`_batch_diagnostics`), and the
  per-token arrays a saved step keeps (advantages; values with a critic; empty unless
  `saving`), from one copy to the host."""
  spec = inputs.spec
  fetched = multihost.fetch(
      {"adv": adv.advantages}
      | ({} if spec.old_logprobs_from_update else {"old_logprobs": adv.old_logprobs})
      | ({"reward_kl": adv.reward_kl} if spec.kl_in_reward else {})
      | ({"values": adv.values, "returns": adv.returns} if spec.use_critic else {}))
  logged = metrics_lib.episode_metrics(rows.episodes, episodes)
  logged.update(_batch_diagnostics(rows.episodes, fetched, spec=spec))
  logged["overlong/fraction"] = float(np.mean(adv.overlong))
  if spec.overlong != "none":
    name = {"filter": "filtered", "penalty": "penalised"}[spec.overlong]
    logged[f"overlong/{name}"] = logged["overlong/fraction"]
  per_token = ({"advantages": fetched["adv"]}
               | ({"values": fetched["values"]} if spec.use_critic else {})) if saving else {}
  return logged, per_token


def _masked_stats(prefix: str, x: np.ndarray, mask: np.ndarray) -> dict[str, float]:
  values = np.asarray(x)[mask]
  if values.size == 0:
    return {f"{prefix}_mean": 0.0, f"{prefix}_std": 0.0}
  return {f"{prefix}_mean": float(values.mean()), f"{prefix}_std": float(values.std())}


def _batch_diagnostics(host: Any, got: dict[str, np.ndarray], *,
                       spec: algorithm.AlgorithmSpec) -> dict[str, float]:
  """Advantage statistics, sampler/trainer log-prob agreement, in-reward KL, critic quality.

  `rollout/logprob_gap` is the mean |log-prob of the trainer's forward - the sampler's| over
  agent tokens (`rollout/logprob_gap_max` its max, the token that `algo.tis_cap` would weigh
  most): ~1e-7 when both compute the same distribution; a large gap means the
  rollout and the loss disagree (e.g. a temperature or masking mismatch). It is the update's
  metric instead when the update's forward gives the old log-probs
  (`spec.old_logprobs_from_update`). `got` holds the [B, L] host arrays an enabled diagnostic
  reads: adv, old_logprobs (scored before the update), reward_kl (KL in the reward), values
  and returns (a critic).
  """
  mask = np.asarray(host.loss_mask).astype(bool)
  out = _masked_stats("batch/advantage", got["adv"], mask)
  if not spec.old_logprobs_from_update:
    out.update({k: float(v) for k, v in update_lib.logprob_gap(
        got["old_logprobs"], host.sample_logprobs, mask).items()})
  if spec.kl_in_reward:
    out["reward/kl_mean"] = float(got["reward_kl"][mask].mean()) if mask.any() else 0.0
  if spec.use_critic:
    out.update(_masked_stats("critic/values", got["values"], mask))
    out["critic/explained_variance"] = metrics_lib.explained_variance(
        got["returns"], got["values"], mask)
  return out
