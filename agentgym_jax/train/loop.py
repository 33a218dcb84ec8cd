"""The trainer: rollout -> scoring -> advantages -> update -> metrics -> checkpoint, per step.

`train(config, workdir)` runs `config.total_steps` steps; called again with the same workdir
it resumes from the newest complete checkpoint, with the same parameters, optimizer moments,
task order and random numbers as an uninterrupted run.

A run stops early, after saving a checkpoint of the step it finished, when it is preempted
(SIGTERM, or JAX's preemption notice on a pod: `multihost.preempted`; `train` returns, the
command exits 0) or when more than `env.max_failed_fraction` of the episodes of each of
`env.max_failed_steps` steps in a row failed (`EnvironmentFailing` is raised). Failed episodes
train nothing and stay out of the group baselines (rollout/trajectory.py).

Layouts: the update trains one packed row per episode, or with a history window
(`rollout.history_turns`) one row per turn holding the context the model saw
(rollout/window.py). Advantages are computed on the packed episodes either way, every estimator
(group, turn-level and critic ones) included: log-probs and values scored on the per-turn rows
are moved to their tokens in the episodes' rows, and the advantages and returns back. A
group's episodes, a turn's place in its episode and the critic's successive states (each the
context a turn was sampled in) are then what the estimator sees, and each episode counts once.

Sections follow big_vision's trainer: workdir, mesh, tokenizer and environments, model and
train state, update step, checkpoint, loop.

Randomness: every step derives its keys from (seed, step) with fold_in, one stream each for
the rollout, the update's minibatch order and evaluation, so nothing depends on how many
steps ran in this process.

What the loop reads from elsewhere, each from one place: the algorithm from
`rl.algorithm.AlgorithmSpec`, the environments from `rollout.envs`, the held-out evaluation
from `evaluate.evaluate`, the episode statistics from `metrics.episode_metrics`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentgym_jax import evaluate
from agentgym_jax import multihost
from agentgym_jax import sharding as sharding_lib
from agentgym_jax.rl import advantages as advantages_lib, algorithm, schedule
from agentgym_jax.rl import dynamic_sampling, overlong as overlong_lib
from agentgym_jax.rollout import SamplingConfig, build_trajectory, envs, run_episodes, window
from agentgym_jax.rollout.episodes import replica_meshes
from agentgym_jax.train import checkpoints, data, metrics as metrics_lib, provenance, sources
from agentgym_jax.train import state as state_lib
from agentgym_jax.train import trajectories
from agentgym_jax.train import update as update_lib

ROLLOUT_STREAM = 0  # update_lib.UPDATE_STREAM is 1; evaluations use evaluate.eval_key
# Behaviour cloning samples nothing: its steps report no rollout throughput.
_NO_ROLLOUT_STATS = {"rollout/sampled_tokens": 0, "rollout/env_seconds": 0.0}
# In-loop evaluation reports, one folder per step, inside the workdir.
EVAL_DIR = "eval"


class EnvironmentFailing(RuntimeError):
  """The run stopped because most of its episodes kept failing; the message is one line."""


def sample_batch(config: ml_collections.ConfigDict, policy_def: Any, params: Any, tok: Any,
                 pool: Any, task_ids: list[int], max_turns: int, rng: jax.Array,
                 mesh: Mesh | None, rows: np.ndarray | None = None) -> tuple[Any, dict]:
  """A step's rollout with the config's group size, sampling, context, system prompt and
  replicas: `run_episodes`, as the trainer and `agentgym_jax.replay` both call it, so a
  replay samples exactly as the run did."""
  sampling = SamplingConfig(temperature=config.rollout.temperature, top_p=config.rollout.top_p,
                            top_k=config.rollout.top_k,
                            max_reply_tokens=config.rollout.max_reply_tokens)
  return run_episodes(
      policy_def, params, tok, pool, task_ids, group_size=config.data.group_size,
      max_turns=max_turns, sampling=sampling, max_context=config.rollout.max_context, rng=rng,
      system_prompt=config.env.system_prompt or None, mesh=mesh,
      replicas=config.rollout.replicas, rows=rows, history_turns=config.rollout.history_turns,
      invalid_action_reward=config.env.invalid_action_reward,
      overlap_env=config.rollout.overlap_env)


def check_batch_layout(config: ml_collections.ConfigDict, mesh: Mesh) -> None:
  """Fails early, with the numbers, when the rows of a step cannot be split as configured."""
  rows = config.data.batch_tasks * config.data.group_size
  shards = sharding_lib.data_parallel_size(mesh)
  parts = config.algo.minibatches * config.algo.microbatches
  if rows % (parts * shards):
    raise ValueError(
        f"data.batch_tasks x data.group_size = {rows} rows per step must be divisible by "
        f"algo.minibatches x algo.microbatches x data-parallel devices = "
        f"{config.algo.minibatches} x {config.algo.microbatches} x {shards}; change one of them.")
  try:
    replica_meshes(mesh, config.rollout.replicas)
  except ValueError as exc:
    raise ValueError(f"rollout.replicas: {exc}") from exc
  if config.rollout.history_turns < 0:
    raise ValueError(f"rollout.history_turns must be >= 0 (0 keeps every turn), got "
                     f"{config.rollout.history_turns}.")


def row_multiple(config: ml_collections.ConfigDict, mesh: Mesh) -> int:
  """What the update's row count must be a multiple of: minibatches x microbatches x
  data-parallel devices (per-turn rows are padded to one)."""
  return (config.algo.minibatches * config.algo.microbatches
          * sharding_lib.data_parallel_size(mesh))


def layouts(rows: window.TurnRows | None, put: Callable, shape: tuple[int, int]
            ) -> tuple[Callable, Callable]:
  """(to the packed episodes [B, L], to the update's rows): how per-token arrays move between
  the layouts; identities when the update trains the packed rows (`rows` None)."""
  if rows is None:
    return (lambda x: x), (lambda x: x)
  episode, source = put(rows.episode), put(rows.source)
  return (lambda x: window.to_packed(x, episode, source, shape),
          lambda x: window.to_rows(x, episode, source))


def _masked_stats(prefix: str, x: np.ndarray, mask: np.ndarray) -> dict[str, float]:
  values = np.asarray(x)[mask]
  if values.size == 0:
    return {f"{prefix}_mean": 0.0, f"{prefix}_std": 0.0}
  return {f"{prefix}_mean": float(values.mean()), f"{prefix}_std": float(values.std())}


def _batch_diagnostics(host: Any, adv: jax.Array, old_logprobs: jax.Array,
                       values: jax.Array, returns: jax.Array, reward_kl: jax.Array, *,
                       use_critic: bool, kl_in_reward: bool) -> dict[str, float]:
  """Advantage statistics, sampler/trainer log-prob agreement, in-reward KL, critic quality.

  `rollout/logprob_gap` is the mean |log-prob of the trainer's forward - the sampler's| over
  agent tokens (`rollout/logprob_gap_max` its max, the token that `algo.tis_cap` would weigh
  most): ~1e-7 when both compute the same distribution; a large gap means the
  rollout and the loss disagree (e.g. a temperature or masking mismatch). Of the [B, L] arrays
  only those an enabled diagnostic reads are copied to the host.
  """
  wanted = {"adv": adv, "old_logprobs": old_logprobs}
  if kl_in_reward:
    wanted["reward_kl"] = reward_kl
  if use_critic:
    wanted.update(values=values, returns=returns)
  got = multihost.fetch(wanted)
  mask = np.asarray(host.loss_mask).astype(bool)
  out = _masked_stats("batch/advantage", got["adv"], mask)
  gap = np.abs(got["old_logprobs"] - host.sample_logprobs)[mask]
  out["rollout/logprob_gap"] = float(gap.mean()) if mask.any() else 0.0
  out["rollout/logprob_gap_max"] = float(gap.max()) if mask.any() else 0.0
  if kl_in_reward:
    out["reward/kl_mean"] = float(got["reward_kl"][mask].mean()) if mask.any() else 0.0
  if use_critic:
    out.update(_masked_stats("critic/values", got["values"], mask))
    out["critic/explained_variance"] = metrics_lib.explained_variance(
        got["returns"], got["values"], mask)
  return out


def _due(step: int, every: int, total: int) -> bool:
  """Whether an every-N action runs after `step` (1-based count of completed steps)."""
  return every > 0 and (step % every == 0 or step == total)


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains per `config` in `workdir` (resuming from its newest checkpoint); returns the
  metrics of the last step run (empty if the run was already complete).

  On several hosts every process calls this with the same arguments (agentgym_jax/multihost.py
  says who does what)."""
  ##############################################################################################
  #                                   Workdir and run info                                     #
  ##############################################################################################
  config = multihost.process_config(config)
  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() == 0:
    metrics_lib.write_run_info(workdir, config)
    provenance.save_config(workdir, config)
  logging.info("Config:\n%s", config)

  ##############################################################################################
  #                                            Mesh                                            #
  ##############################################################################################
  mesh = sharding_lib.make_mesh(config.mesh)
  rows_sharding = NamedSharding(mesh, P(sharding_lib.BATCH_AXES))
  # This process's devices: where it rolls out its rows of each batch (the mesh, on one host).
  share = multihost.process_share(mesh)
  check_batch_layout(config, mesh)
  update_cfg = update_lib.UpdateConfig.from_config(config)  # validates the algorithm
  spec = update_cfg.algo
  bc = config.mode == "bc"
  schedule.validate(config.schedule)
  logging.info("Mesh %s over %d devices.", dict(mesh.shape), mesh.size)

  ##############################################################################################
  #                               Tokenizer and environments                                   #
  ##############################################################################################
  # A "bpe:" tokenizer is trained and saved by process 0; the others then read it.
  tok = multihost.process_zero_first(lambda: sources.load_tokenizer(config, workdir),
                                     "tokenizer")
  splits = envs.task_splits(config)
  stream = data.TaskStream(splits[config.data.split], config.seed)
  rows = config.data.batch_tasks * config.data.group_size
  if bc:
    # Behaviour cloning draws `rows` demonstrations per step, in shuffled epochs.
    # Played and cached by process 0 first; the others then read its cache (if they see it).
    demos = multihost.process_zero_first(lambda: sources.demonstrations(config, tok),
                                         "demonstrations")
    stream = data.TaskStream(range(len(demos)), config.seed)

  ##############################################################################################
  #                           Model, optimizers and train state                                #
  ##############################################################################################
  policy = sources.build_policy(config, tok, mesh)
  critic = sources.build_critic(policy, config.seed, mesh) if spec.use_critic else None
  optimizers = state_lib.Optimizers.from_config(config, with_critic=critic is not None)
  split = state_lib.split_models(policy, critic, keep_reference=spec.keep_reference,
                                 optimizers=optimizers, mesh=mesh)
  policy_def, critic_def, shardings = split.policy_def, split.critic_def, split.shardings
  state = state_lib.init_train_state(
      policy=split.policy, critic=split.critic, keep_reference=spec.keep_reference,
      optimizers=optimizers, seed=config.seed, shardings=shardings)
  del policy, critic, split  # the state owns the parameters now
  logging.info("Policy: %s", jax.tree.reduce(lambda n, x: n + x.size, state.policy, 0))

  ##############################################################################################
  #                               Update step and scoring passes                               #
  ##############################################################################################
  update_step = update_lib.make_update_step(policy_def, critic_def, optimizers, update_cfg,
                                            mesh, shardings)
  score_chunks = config.algo.minibatches * config.algo.microbatches
  score_logprobs, score_values = update_lib.make_scorers(
      policy_def, critic_def, update_cfg.temperature, score_chunks, mesh,
      compute_dtype=update_cfg.compute_dtype)
  compute_advantages = algorithm.make_advantage_fn(spec)

  ##############################################################################################
  #                                Checkpoint and resumption                                   #
  ##############################################################################################
  # Precedence: the workdir's newest checkpoint; otherwise the initial state built above.
  ckpt = checkpoints.Checkpointer(os.path.join(workdir, checkpoints.CHECKPOINT_DIR),
                                  config.checkpoint.keep)
  if ckpt.interrupted and jax.process_index() == 0:
    latest = ckpt.latest_step()
    print(f"Checkpoint {', '.join(map(str, ckpt.interrupted))} in {ckpt.directory} was not "
          "completely written (the process was stopped while saving) and is ignored; "
          + (f"resuming from checkpoint {latest}, the last complete one." if latest is not None
             else "no complete checkpoint: starting from scratch."), flush=True)
  cursor = 0
  if ckpt.latest_step() is not None:
    if jax.process_index() == 0:
      latest = ckpt.latest_step()
      print(f"Resuming from step {latest} ({os.path.join(ckpt.directory, str(latest))})",
            flush=True)
    state, meta = ckpt.restore(state)
    if meta.get("tokenizer") != config.tokenizer.spec:
      raise ValueError(f"The checkpoint in {workdir} was trained with tokenizer "
                       f"{meta.get('tokenizer')!r}, the config says {config.tokenizer.spec!r}.")
    cursor = int(meta["data_cursor"])
  start_step = int(jax.device_get(state.step))
  writer = (metrics_lib.MetricWriter(workdir, resume_step=start_step)
            if jax.process_index() == 0 else None)
  pool = envs.make_pool(config)
  eval_settings = evaluate.EvalSettings.from_config(config)

  def meta_at(cursor: int) -> dict[str, Any]:
    return {"data_cursor": cursor, "tokenizer": config.tokenizer.spec, "env": config.env.name}

  def run_eval(step: int) -> dict[str, float]:
    # The command line's evaluation of this step's checkpoint: same settings, key and report.
    # One key for every evaluation of the run, so checkpoints are compared on the same
    # sampling noise and a change between them is the policy's.
    result = evaluate.evaluate(config, eval_settings, policy_def, state.policy, tok, pool,
                               rng=evaluate.eval_key(config.seed), mesh=mesh)
    if jax.process_index() == 0:
      evaluate.write_report(result, os.path.join(workdir, EVAL_DIR, f"step_{step}"),
                            evaluate.checkpoint_label(workdir, step), eval_settings.split)
    overall = result.summary[evaluate.eval_metrics.OVERALL]
    # A metric whose episodes all failed measured nothing: it is left out, not logged as 0.
    scalars = dict(overall, success_rate=result.success_rate)
    return {f"eval/{k}": float(v) for k, v in scalars.items() if v is not None}

  ##############################################################################################
  #                                        Train loop                                          #
  ##############################################################################################
  last: dict[str, float] = {}
  stopped = ""  # why the run stopped before total_steps: "preempted" or "failing"
  failing_steps = 0  # consecutive steps with more than env.max_failed_fraction failed
  run_start = time.perf_counter()
  if start_step == 0 and config.eval.every_steps > 0 and config.eval.at_start:
    # The starting point's held-out score: the "before" of the run's before/after line.
    initial = run_eval(0)
    _report_eval(0, initial)
    if writer:
      writer.write(0, initial)
  progress = tqdm.tqdm(total=config.total_steps, initial=start_step, desc="train",
                       disable=not config.log.progress_bar, dynamic_ncols=True)
  try:
    for step in range(start_step, config.total_steps):
      timer = {"start": time.perf_counter()}
      max_turns = schedule.max_turns(config.schedule, step)
      # A saved step records what regenerates its episodes (agentgym_jax/replay.py).
      saving = _due(step + 1, config.log.trajectories_every, config.total_steps)

      # ----- rollout (or, for behaviour cloning, the step's demonstrations) -----
      if bc:
        chosen = [demos[i] for i in stream.take(cursor, rows)]
        cursor += rows
        traj, stats = build_trajectory(chosen, tok.pad_id), _NO_ROLLOUT_STATS
      else:
        task_ids = stream.take(cursor, config.data.batch_tasks)
        cursor += config.data.batch_tasks
        mine = share.rows(rows)  # this process's rows of the batch (None: all of them)
        rollout_key = state_lib.step_key(jax.device_get(state.rng), step, ROLLOUT_STREAM)
        replay = provenance.step_provenance(
            config, step + 1, task_ids, rollout_key, max_turns,
            provenance.policy_checksum(state.policy), mesh.size) if saving else None
        # The rollout computes as the update does: a bf16 copy of float32 weights when the
        # run is mixed precision (half the per-host copy and KV cache).
        rollout_params = share.local(update_lib.as_compute(state.policy,
                                                           update_cfg.compute_dtype))
        traj, stats = sample_batch(config, policy_def, rollout_params, tok, pool,
                                   task_ids, max_turns, rollout_key, share.mesh, mine)
        traj, stats["episodes"] = multihost.gather_trajectory(traj, stats["episodes"], mine,
                                                              tok.pad_id)
        if spec.dynamic_sampling:  # DAPO: more rounds of tasks until the groups carry signal
          def draw(r, first=cursor, key=rollout_key):
            ids = stream.take(first + (r - 1) * config.data.batch_tasks, config.data.batch_tasks)
            t, s = sample_batch(config, policy_def, rollout_params, tok, pool, ids,
                                max_turns, jax.random.fold_in(key, r), share.mesh, mine)
            t, s["episodes"] = multihost.gather_trajectory(t, s["episodes"], mine, tok.pad_id)
            return t, s
          traj, stats, drawn, sampling_metrics = dynamic_sampling.sample_until_full(
              (traj, stats), draw, batch_tasks=config.data.batch_tasks,
              group_size=config.data.group_size,
              max_extra_rounds=spec.dynamic_sampling_max_rounds,
              rewards_of=lambda t: overlong_lib.apply(t, spec.overlong,
                                                      spec.overlong_penalty)[0],
              build=lambda episodes: build_trajectory(episodes, tok.pad_id))
          cursor += (drawn - 1) * config.data.batch_tasks
          replay = replay if drawn == 1 else None  # a replay regenerates the first round only
      timer["rollout"] = time.perf_counter()

      host = jax.device_get(traj)  # the whole batch, on every process
      put = lambda x: sharding_lib.put_global(np.asarray(x), rows_sharding)
      # With a history window the update trains one row per turn, its context as the model
      # saw it (rollout/window.py); advantages are still computed over the episodes.
      turn_rows = (window.build_turn_rows(host, config.rollout.history_turns, tok.pad_id,
                                          row_multiple(config, mesh))
                   if config.rollout.history_turns else None)
      trained = host if turn_rows is None else turn_rows
      tokens, valid, mask = put(trained.tokens), put(trained.valid), put(trained.loss_mask)
      to_episodes, to_rows = layouts(turn_rows, put, host.tokens.shape)
      seq_tokens = None if turn_rows is None else put(turn_rows.episode_tokens)
      if bc:
        # Cross-entropy needs neither the sampler's log-probs nor advantages.
        zeros = jnp.zeros(tokens.shape, jnp.float32, device=rows_sharding)
        batch = update_lib.build_batch(spec, tokens, valid, mask, zeros, zeros, zeros, zeros,
                                       zeros, seq_tokens)
        diagnostics = {}
        timer["score"] = timer["advantages"] = time.perf_counter()
      else:
        # ----- scoring: old and reference log-probs, values -----
        old_logprobs = score_logprobs(state.policy, tokens, valid)
        ref_logprobs = (score_logprobs(state.ref, tokens, valid) if state.ref is not None
                        else jnp.zeros_like(old_logprobs))
        values = (score_values(state.critic, tokens, valid) if score_values is not None
                  else jnp.zeros_like(old_logprobs))
        jax.block_until_ready((old_logprobs, ref_logprobs, values))
        timer["score"] = time.perf_counter()

        # ----- advantages, over the episodes' packed rows -----
        # Every agent token sits once in its episode's row, so each estimator sees the
        # episodes (groups, turns, its critic's successive states) whatever the update's rows.
        rewards, turn_rewards, overlong = overlong_lib.apply(host, spec.overlong,
                                                             spec.overlong_penalty)
        turns = (advantages_lib.Turns(index=put(host.turn_index), rewards=put(turn_rewards),
                                      anchors=put(host.turn_anchors))
                 if spec.uses_turns else None)
        old_lp, ref_lp, old_values = map(to_episodes, (old_logprobs, ref_logprobs, values))
        episode_mask = mask if turn_rows is None else put(host.loss_mask)
        adv, returns, reward_kl = compute_advantages(
            put(rewards), episode_mask, put(host.group_id), old_lp, ref_lp, old_values,
            turns)
        jax.block_until_ready(adv)
        timer["advantages"] = time.perf_counter()
        if spec.overlong == "filter":  # out of the loss, still in their group's baseline (DAPO)
          mask = put(overlong_lib.mask_rows(trained.loss_mask, overlong,
                                            None if turn_rows is None else turn_rows.episode))
        batch = update_lib.build_batch(
            spec, tokens, valid, mask, old_logprobs, to_rows(adv), ref_logprobs,
            to_rows(returns), values, seq_tokens,
            rollout_logprobs=put(trained.sample_logprobs) if spec.tis_cap > 0 else None)
        diagnostics = _batch_diagnostics(host, adv, old_lp, old_values, returns, reward_kl,
                                         use_critic=spec.use_critic,
                                         kl_in_reward=spec.kl_in_reward)
        diagnostics["overlong/fraction"] = float(np.mean(overlong))
        if spec.overlong != "none":
          name = {"filter": "filtered", "penalty": "penalised"}[spec.overlong]
          diagnostics[f"overlong/{name}"] = diagnostics["overlong/fraction"]
        if spec.dynamic_sampling:
          diagnostics.update(sampling_metrics)

      # ----- update -----
      state, update_metrics = update_step(state, batch)
      update_metrics = jax.device_get(update_metrics)
      timer["update"] = time.perf_counter()

      # ----- stop early? (the same answer on every process: a collective) -----
      done = step + 1
      failing_steps = (failing_steps + 1
                       if np.mean(host.failed) > config.env.max_failed_fraction else 0)
      if multihost.preempted(done):
        stopped = "preempted"
      elif failing_steps >= config.env.max_failed_steps:
        stopped = "failing"

      # ----- checkpoint, saved trajectories and evaluation -----
      if _due(done, config.checkpoint.every_steps, config.total_steps) or stopped:
        ckpt.save(done, state, meta_at(cursor))
        multihost.check_replicas_agree(share, state.policy, f"Step {done}")
      if saving:
        per_token = {} if bc else multihost.fetch(
            {"advantages": adv} | ({"values": old_values} if spec.use_critic else {}))
        if jax.process_index() == 0:
          trajectories.save_step(workdir, done, host, chosen if bc else stats["episodes"],
                                 tok.decode, config.log.trajectories_episodes, **per_token,
                                 replay=None if bc else replay)
      timer["checkpoint"] = time.perf_counter()
      eval_metrics = run_eval(done) if _due(done, config.eval.every_steps,
                                            config.total_steps) and not stopped else {}
      timer["eval"] = time.perf_counter()

      # ----- metrics -----
      step_metrics = metrics_lib.episode_metrics(host, chosen if bc else stats["episodes"])
      if bc:  # the batch is the expert's, not the policy's: keep the two apart in the logs
        step_metrics = {k.replace("episodes/", "demos/"): v for k, v in step_metrics.items()}
      step_metrics.update({k: float(v) for k, v in update_metrics.items()})
      step_metrics.update(diagnostics)
      step_metrics.update({
          "schedule/max_turns": float(max_turns),
          "schedule/phase": float(schedule.phase(config.schedule, step)),
          "rollout/tokens_per_s": stats["rollout/sampled_tokens"] / max(
              timer["rollout"] - timer["start"], 1e-9),
          "rollout/env_seconds": float(stats["rollout/env_seconds"]),
          "update/tokens_per_s": float(np.sum(trained.valid)) * update_cfg.epochs / max(
              timer["update"] - timer["advantages"], 1e-9),
          "data/cursor": float(cursor),
      })
      previous = timer["start"]
      for phase in ("rollout", "score", "advantages", "update", "checkpoint", "eval"):
        step_metrics[f"time/{phase}"] = timer[phase] - previous
        previous = timer[phase]
      step_metrics["time/step"] = previous - timer["start"]
      step_metrics.update(eval_metrics)
      if writer and _due(done, config.log.every_steps, config.total_steps):
        writer.write(done, step_metrics)
      progress.update(1)
      if bc:
        progress.set_postfix(nll=f"{step_metrics['actor/nll']:.3f}")
      else:
        progress.set_postfix(success=f"{step_metrics['episodes/success_rate']:.2f}",
                             reward=f"{step_metrics['episodes/reward_mean']:.2f}",
                             turns=max_turns)
      if eval_metrics:
        _report_eval(done, eval_metrics)
      last = step_metrics
      if host.failed.any():  # demonstrations never fail: behaviour cloning skips this
        kind, count, example = metrics_lib.failure_summary(stats["episodes"])
        logging.warning("Step %d: %d of %d episodes failed, most by %s (%d), e.g. %s", done,
                        int(host.failed.sum()), host.batch_size, kind, count, example)
      if stopped == "failing":  # its step had failures: kind, count, example are this step's
        raise EnvironmentFailing(
            f"Stopped after step {done}: more than env.max_failed_fraction="
            f"{config.env.max_failed_fraction:g} of the episodes failed in each of the last "
            f"{failing_steps} steps, most by {kind} ({count} of {host.batch_size} in step "
            f"{done}), e.g. {example}. Checkpoint {done} is saved; fix the environment and "
            "rerun with the same --workdir to resume.")
      if stopped:
        break
  finally:
    # A crash must not lose a checkpoint that is still being written.
    progress.close()
    ckpt.close()
    pool.close()
    if writer:
      writer.close()

  ##############################################################################################
  #                                          Export                                            #
  ##############################################################################################
  if stopped == "preempted":
    if jax.process_index() == 0:
      print(f"Preempted: saved checkpoint {int(jax.device_get(state.step))} in {ckpt.directory} "
            "and stopped; rerun the same command to resume.", flush=True)
    multihost.barrier("preempted")
    return last
  if config.checkpoint.export_hf:
    # Every process takes part in gathering its copy; process 0 writes it.
    params = share.local(state.policy)
    if jax.process_index() == 0:
      checkpoints.export_hf(policy_def, params, tok,
                            os.path.join(workdir, checkpoints.HF_EXPORT_DIR))
  if jax.process_index() == 0 and last:
    print(summary_line(workdir, time.perf_counter() - run_start), flush=True)
  # The processes finish together: one that exits first waits for the others at shutdown
  # only as long as the heartbeat timeout (sharding.maybe_initialize_distributed).
  multihost.barrier("end of training")
  return last


def _report_eval(step: int, metrics: dict[str, float]) -> None:
  success = metrics.get("eval/success_rate")
  tqdm.tqdm.write(f"eval at step {step}: held-out success "
                  + ("- (every episode failed)" if success is None else f"{success:.3f}"))


def summary_line(workdir: str, seconds: float) -> str:
  """One line on how the run went: held-out success at its first and last evaluation."""
  records = metrics_lib.read_metrics(workdir)
  evals = [(r["step"], r["eval/success_rate"]) for r in records if "eval/success_rate" in r]
  steps = max((r["step"] for r in records), default=0)
  where = (f"{steps} steps, {seconds / 60:.1f} min in this process; results in {workdir}, "
           f"view them with: python -m agentgym_jax.viewer {workdir}")
  if not evals:
    return f"Done: {where}."
  (first_step, first), (last_step, final) = evals[0], evals[-1]
  return (f"Held-out success {first:.3f} at step {first_step} -> {final:.3f} at step "
          f"{last_step} ({where}).")
