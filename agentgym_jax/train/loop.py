"""The trainer: rollout -> scoring -> advantages -> update -> metrics -> checkpoint, per step.

`train(config, workdir)` runs `config.total_steps` steps, or fewer when a budget of trained
tokens (`config.total_tokens`) is reached first; called again with the same workdir it resumes
from the newest complete checkpoint, with the same parameters, optimizer moments, task order,
turn-limit schedule, tokens trained and random numbers as an uninterrupted run.

A run stops early, after saving a checkpoint of the step it finished, when it is preempted
(SIGTERM, or JAX's preemption notice on a pod: `multihost.preempted`; `train` returns, the
command exits 0) or when more than `env.max_failed_fraction` of the episodes of each of
`env.max_failed_steps` steps in a row failed (`EnvironmentFailing` is raised). Failed episodes
train nothing and stay out of the group baselines (rollout/trajectory.py).

One step: the step's batch (`train/batches.py`: `rl_batch` rolls out, scores and computes
advantages; `bc_batch` takes the expert's demonstrations), the jitted update, the stop checks,
checkpoint and saved trajectories, evaluation, and one record of metrics (`step_metrics`).

Sections follow big_vision's trainer: workdir, mesh, tokenizer and environments, model and
train state, update step, checkpoint, loop.

Asynchronous rollout (`rollout.max_staleness`, `rollout.devices`: train/asynchronous.py,
docs/async.md): a rollout thread samples the steps' episodes ahead, at most k updates stale, and
the step's batch is the next one it finished; the trainer publishes its weights to it after
each update.

Randomness: every step derives its keys from (seed, step) with fold_in, one stream each for
the rollout, the update's minibatch order and evaluation, so nothing depends on how many
steps ran in this process.

What the loop reads from elsewhere, each from one place: the config's typed settings from
`agentgym_jax.settings` (made once, below; the library takes those, never the config), the
algorithm from `rl.algorithm.AlgorithmSpec`, the environments from `rollout.envs`, the held-out
evaluation from `evaluate.evaluate`, the episode statistics from `metrics.episode_metrics`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np
import tqdm

from agentgym_jax import caches
from agentgym_jax import evaluate
from agentgym_jax import freed_memory
from agentgym_jax import multihost
from agentgym_jax import policies
from agentgym_jax import settings as settings_lib
from agentgym_jax import sharding as sharding_lib
from agentgym_jax.rl import algorithm, schedule
from agentgym_jax.rollout import envs
from agentgym_jax.train import asynchronous
from agentgym_jax.train import batches, checkpoints, metrics as metrics_lib, provenance
from agentgym_jax.train import sources
from agentgym_jax.train import state as state_lib
from agentgym_jax.train import trajectories
from agentgym_jax.train import update as update_lib

# In-loop evaluation reports, one folder per step, inside the workdir.
EVAL_DIR = "eval"
# The checkpoint meta's key of the tokens trained so far (what `config.total_tokens` budgets).
TOKENS_KEY = "trained_tokens"


class EnvironmentFailing(RuntimeError):
  """The run stopped because most of its episodes kept failing; the message is one line."""


def _due(step: int, every: int, final: bool) -> bool:
  """Whether an every-N action runs after `step` (1-based count of completed steps), `final`
  if it is the run's last."""
  return every > 0 and (step % every == 0 or final)


def _budget_spent(config: ml_collections.ConfigDict, tokens: int) -> bool:
  """Whether `tokens` trained reach the run's token budget (never, without one)."""
  return config.total_tokens > 0 and tokens >= config.total_tokens


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains per `config` in `workdir` (resuming from its newest checkpoint); returns the
  metrics of the last step run (empty if the run was already complete).

  On several hosts every process calls this with the same arguments (agentgym_jax/multihost.py
  says who does what)."""
  if config.total_tokens < 0:
    raise ValueError(f"total_tokens must be >= 0 (a budget of trained tokens; 0 = none), got "
                     f"{config.total_tokens}.")
  ##############################################################################################
  #                                   Workdir and run info                                     #
  ##############################################################################################
  # This process's environments (with env.urls: its own env service).
  env = multihost.process_env(settings_lib.env(config))
  # Executables built from here on: each step's metrics count those since the step before, so
  # the first step's include the start-up's (the model's init, the starting evaluation).
  compiles = caches.CompileCounter()
  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() == 0:
    metrics_lib.write_run_info(workdir, config)
    provenance.save_config(workdir, config)
  logging.info("Config:\n%s", config)

  ##############################################################################################
  #                                            Mesh                                            #
  ##############################################################################################
  # Asynchronous rollout (train/asynchronous.py) may roll out on devices of its own.
  async_settings = asynchronous.AsyncSettings.from_config(config)
  train_devices, rollout_devices = asynchronous.device_groups(async_settings)
  mesh = sharding_lib.make_mesh(config.mesh, devices=train_devices)
  rollout_mesh = (mesh if rollout_devices is None
                  else sharding_lib.make_mesh(config.mesh, devices=rollout_devices))
  # This process's devices: where it rolls out its rows of each batch (the mesh, on one host).
  share = multihost.process_share(mesh)
  batches.check_layout(config, mesh, rollout_mesh)
  rollout = settings_lib.rollout(config)  # validates the rollout's settings
  turn_limits = settings_lib.schedule(config)
  update_cfg = update_lib.UpdateConfig.from_config(config)  # validates the algorithm
  spec = update_cfg.algo
  if turn_limits.reads_success and async_settings.enabled:
    raise ValueError(f"schedule.advance={turn_limits.advance!r} sets each step's turn limit "
                     "from the steps before it; asynchronous rollout samples ahead of them: use "
                     "rollout.max_staleness=0 and rollout.devices=0, or schedule.advance='steps'.")
  logging.info("Mesh %s over %d devices.", dict(mesh.shape), mesh.size)

  ##############################################################################################
  #                               Tokenizer and environments                                   #
  ##############################################################################################
  # A "bpe:" tokenizer is trained and saved by process 0; the others then read it.
  policy_settings = settings_lib.policy(config)
  tok = multihost.process_zero_first(
      lambda: policies.load_tokenizer(policy_settings, env, workdir), "tokenizer")
  stream = sources.task_stream(env, config.seed)
  demos = []
  if config.mode == "bc":
    # Behaviour cloning draws its rows from the demonstrations, in shuffled epochs. Played
    # and cached by process 0 first; the others then read its cache (if they see it).
    demos = multihost.process_zero_first(lambda: sources.demonstrations(config, env, tok),
                                         "demonstrations")
    stream = sources.task_stream(env, config.seed, demos)

  ##############################################################################################
  #                           Model, optimizers and train state                                #
  ##############################################################################################
  policy = policies.build_policy(policy_settings, tok, mesh)
  critic = sources.build_critic(policy, config.seed, mesh) if spec.use_critic else None
  state, split, optimizers = state_lib.create(config, policy, critic,
                                              keep_reference=spec.keep_reference, mesh=mesh)
  del policy, critic  # the state owns the parameters now
  logging.info("Policy: %s", jax.tree.reduce(lambda n, x: n + x.size, state.policy, 0))

  ##############################################################################################
  #                                        Update step                                         #
  ##############################################################################################
  # Its program, and the scorers', outlive the drops of a program budget (below) that do not
  # need them gone: each phase runs right after a drop, and would only load its program again.
  update_step = freed_memory.KeptPrograms(update_lib.make_update_step(
      split.policy_def, split.critic_def, optimizers, update_cfg, mesh, split.shardings),
                                          phase="update")

  ##############################################################################################
  #                                Checkpoint and resumption                                   #
  ##############################################################################################
  # Precedence: the workdir's newest checkpoint; otherwise the initial state built above.
  ckpt = checkpoints.Checkpointer(os.path.join(workdir, policies.CHECKPOINT_DIR),
                                  config.checkpoint.keep)
  state, cursor, horizon, tokens = _resume(ckpt, state, config, workdir)
  start_step = int(jax.device_get(state.step))
  # A resumed run that had reached its token budget has no steps left.
  end_step = start_step if _budget_spent(config, tokens) else config.total_steps
  writer = (metrics_lib.MetricWriter(workdir, resume_step=start_step)
            if jax.process_index() == 0 else None)
  eval_settings = settings_lib.evaluation(config)
  pool = envs.make_pool(env)
  inputs = batches.StepInputs(
      config=config, update=update_cfg, tok=tok, pool=pool, stream=stream, mesh=mesh,
      share=share, policy_def=split.policy_def,
      rollout=rollout, env=env, schedule=turn_limits, demos=demos,
      scorers=tuple(scorer and freed_memory.KeptPrograms(scorer, phase="score") for scorer in
                    update_lib.make_scorers(split.policy_def, split.critic_def, update_cfg, mesh)),
      advantages=algorithm.make_advantage_fn(spec))
  make_batch = batches.bc_batch if config.mode == "bc" else batches.rl_batch
  rollouts = None  # the rollout thread of an asynchronous run
  if async_settings.enabled:
    rollouts = asynchronous.AsyncRollout(config, async_settings, inputs, state,
                                         first_step=start_step, cursor=cursor,
                                         rollout_mesh=rollout_mesh)
    make_batch = rollouts.batch

  def meta_at(cursor: int) -> dict[str, Any]:
    return {"data_cursor": cursor, "tokenizer": config.tokenizer.spec, "env": config.env.name,
            schedule.META_KEY: horizon.to_meta(), TOKENS_KEY: tokens}

  def run_eval(step: int) -> dict[str, float]:
    # The command line's evaluation of this step's checkpoint: same settings, key and report.
    # One key for every evaluation of the run, so checkpoints are compared on the same
    # sampling noise and a change between them is the policy's. Sampled with the rollout's
    # copy of the weights, in the compute dtype on each host's rollout mesh: on the train
    # mesh's FSDP layout a 7B decode does not fit a v5e chip (docs/tpu.md).
    params = batches.rollout_params(inputs, state.policy)
    result = evaluate.evaluate(env, eval_settings, split.policy_def, params, tok, pool,
                               rng=evaluate.eval_key(config.seed),
                               mesh=sharding_lib.mesh_of(params))
    del params
    if jax.process_index() == 0:
      evaluate.write_report(result, os.path.join(workdir, EVAL_DIR, f"step_{step}"),
                            evaluate.checkpoint_label(workdir, step), eval_settings.split)
    overall = result.summary[evaluate.eval_metrics.OVERALL]
    # A metric whose episodes all failed measured nothing: it is left out, not logged as 0.
    scalars = dict(overall, success_rate=result.success_rate)
    scalars.update(evaluate.environment_metrics(env, result))  # a mixture's, per environment
    return {f"eval/{k}": float(v) for k, v in scalars.items() if v is not None}

  ##############################################################################################
  #                                        Train loop                                          #
  ##############################################################################################
  last: dict[str, float] = {}
  stopped = ""  # why the run stopped before total_steps: "preempted" or "failing"
  failing_steps = 0  # consecutive steps with more than env.max_failed_fraction failed
  run_start = time.perf_counter()
  # Programs hold host memory (freed_memory.py): to keep the peaks under
  # compile.max_resident_gib they are dropped at the safe points (before the scoring, the
  # update and a checkpoint's write, by the rise each has shown; between a rollout's turns, evaluations'
  # included). An asynchronous run's rollout thread may trace at any time, so only the
  # synchronous loop drops them.
  freed_memory.set_program_budget(
      None if rollouts else freed_memory.budget_of(config.compile.max_resident_gib,
                                                   compiles.built))
  if start_step == 0 and config.eval.every_steps > 0 and config.eval.at_start:
    # The starting point's held-out score: the "before" of the run's before/after line.
    initial = run_eval(0)
    _report_eval(0, initial)
    if writer:
      writer.write(0, initial)
  progress = tqdm.tqdm(total=config.total_steps, initial=start_step, desc="train",
                       disable=not config.log.progress_bar, dynamic_ncols=True)
  try:
    for step in range(start_step, end_step):
      clock = [time.perf_counter()]
      done = step + 1
      max_turns = schedule.max_turns(turn_limits, step, horizon)
      # A saved step records what regenerates its episodes (agentgym_jax/replay.py).
      saving = _due(done, config.log.trajectories_every, done == config.total_steps)
      got = make_batch(inputs, state, step, cursor, max_turns, saving)
      cursor = got.cursor
      tokens += got.trained_tokens * config.algo.epochs
      # The run's last step: total_steps', or the first to reach the token budget.
      final = done == config.total_steps or _budget_spent(config, tokens)
      horizon = schedule.advance(turn_limits, horizon, step, got.metrics)
      clock.append(time.perf_counter())
      # The rollout's programs are not held through the update's peak when both would pass
      # the budget (compile.max_resident_gib).
      with freed_memory.ahead_of("update"):
        state, update_metrics = update_step(state, got.batch)
        if rollouts:
          rollouts.publish(state)
        update_metrics = jax.device_get(update_metrics)
      clock.append(time.perf_counter())

      # Stop early? (the same answer on every process: a collective)
      failing_steps = (failing_steps + 1
                       if np.mean(got.host.failed) > config.env.max_failed_fraction else 0)
      if multihost.preempted(done):
        stopped = "preempted"
      elif failing_steps >= config.env.max_failed_steps:
        stopped = "failing"

      if _due(done, config.checkpoint.every_steps, final) or stopped:
        # Writing copies the train state to the host; under a program budget the phase lasts
        # until the write is done, so that its copies count in the phase's measured rise.
        with freed_memory.ahead_of("checkpoint", finish=ckpt.wait):
          ckpt.save(done, state, meta_at(cursor))
        multihost.check_replicas_agree(share, state.policy, f"Step {done}")
      if saving and jax.process_index() == 0:
        trajectories.save_step(workdir, done, got.host, got.episodes, tok.decode,
                               config.log.trajectories_episodes, **got.per_token,
                               replay=got.replay)
      clock.append(time.perf_counter())
      eval_metrics = run_eval(done) if _due(done, config.eval.every_steps,
                                            final) and not stopped else {}
      clock.append(time.perf_counter())

      compile_metrics = compiles.take()
      last = step_metrics(got, update_metrics, eval_metrics, clock, compile_metrics,
                          inputs=inputs, max_turns=max_turns, tokens=tokens)
      if writer and _due(done, config.log.every_steps, final):
        writer.write(done, last)
      progress.update(1)
      progress.set_postfix(_progress_fields(last, max_turns))
      if eval_metrics:
        _report_eval(done, eval_metrics)
      if got.host.failed.any():  # demonstrations never fail: behaviour cloning skips this
        _report_failures(got, done, failing_steps, config, stop=stopped == "failing")
      if stopped or final:
        break
  finally:
    freed_memory.set_program_budget(None)
    # A crash must not lose a checkpoint that is still being written.
    progress.close()
    if rollouts:
      rollouts.close()
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
      checkpoints.export_hf(split.policy_def, params, tok,
                            os.path.join(workdir, checkpoints.HF_EXPORT_DIR))
  if jax.process_index() == 0 and last:
    print(summary_line(workdir, time.perf_counter() - run_start), flush=True)
  # The processes finish together: one that exits first waits for the others at shutdown
  # only as long as the heartbeat timeout (multihost.maybe_initialize_distributed).
  multihost.barrier("end of training")
  return last


def _resume(ckpt: checkpoints.Checkpointer, state: state_lib.TrainState,
            config: ml_collections.ConfigDict, workdir: str
            ) -> tuple[state_lib.TrainState, int, schedule.Progress, int]:
  """The newest complete checkpoint's state, task cursor, turn-limit schedule's progress and
  tokens trained, or (`state`, 0, its start, 0) in a new run; says on the console which one
  (and any checkpoint left half-written)."""
  latest = ckpt.latest_step()
  if ckpt.interrupted and jax.process_index() == 0:
    print(f"Checkpoint {', '.join(map(str, ckpt.interrupted))} in {ckpt.directory} was not "
          "completely written (the process was stopped while saving) and is ignored; "
          + (f"resuming from checkpoint {latest}, the last complete one." if latest is not None
             else "no complete checkpoint: starting from scratch."), flush=True)
  if latest is None:
    return state, 0, schedule.Progress(), 0
  if jax.process_index() == 0:
    print(f"Resuming from step {latest} ({os.path.join(ckpt.directory, str(latest))})",
          flush=True)
  state, meta = ckpt.restore(state)
  if meta.get("tokenizer") != config.tokenizer.spec:
    raise ValueError(f"The checkpoint in {workdir} was trained with tokenizer "
                     f"{meta.get('tokenizer')!r}, the config says {config.tokenizer.spec!r}.")
  if TOKENS_KEY not in meta and config.total_tokens:
    raise ValueError(f"The checkpoint in {workdir} does not record the tokens trained (it "
                     "predates total_tokens): resume it without a token budget "
                     "(--config.total_tokens=0).")
  return (state, int(meta["data_cursor"]),
          schedule.Progress.from_meta(meta.get(schedule.META_KEY)), int(meta.get(TOKENS_KEY, 0)))


def step_metrics(got: batches.StepBatch, update_metrics: dict[str, Any],
                 eval_metrics: dict[str, float], clock: list[float],
                 compile_metrics: dict[str, float], *, inputs: batches.StepInputs,
                 max_turns: int, tokens: int) -> dict[str, float]:
  """Everything a step logs: its batch's statistics, the update's, the schedule, throughput,
  the time of each phase, the executables it built and the evaluation's results.

  `tokens`: the tokens trained by the run up to and including this step.

  `clock` holds the times at the step's start and after its batch, update, checkpoint and
  evaluation; the batch's own phases (rollout, scoring, advantages) are in `got.metrics`.
  `compile_metrics` is `caches.CompileCounter.take()`'s: compile/count, compile/cache_hits,
  compile/seconds and compile/load_seconds, each 0 in a step that met no new shape.
  """
  start, batched, updated, saved, evaluated = clock
  config, env = inputs.config, inputs.env
  out = dict(got.metrics)
  if env.is_mixture and config.mode == "rl":
    out.update(metrics_lib.environment_metrics(
        got.host, got.episodes, lambda task_id: envs.environment_of(env, task_id)))
  out.update({k: float(v) for k, v in update_metrics.items()})
  out.update({
      "schedule/max_turns": float(max_turns),
      "schedule/phase": float(schedule.phase_of(inputs.schedule, max_turns)),
      "update/trained_tokens": float(got.trained_tokens * config.algo.epochs),
      "update/trained_tokens_total": float(tokens),
      "update/tokens_per_s": got.trained_tokens * config.algo.epochs / max(updated - batched,
                                                                           1e-9),
      "data/cursor": float(got.cursor),
      "time/update": updated - batched,
      "time/checkpoint": saved - updated,
      "time/eval": evaluated - saved,
      "time/step": evaluated - start,
  })
  out.update(compile_metrics)
  out.update(eval_metrics)
  return out


def _progress_fields(metrics: dict[str, float], max_turns: int) -> dict[str, str]:
  """The progress bar's fields: the cloning loss, or the rollouts' success and reward."""
  if "actor/nll" in metrics:
    return {"nll": f"{metrics['actor/nll']:.3f}"}
  return {"success": f"{metrics['episodes/success_rate']:.2f}",
          "reward": f"{metrics['episodes/reward_mean']:.2f}", "turns": str(max_turns)}


def _report_failures(got: batches.StepBatch, done: int, failing_steps: int,
                     config: ml_collections.ConfigDict, *, stop: bool) -> None:
  """Logs the step's failed episodes; with `stop`, ends the run naming the fault seen most."""
  kind, count, example = metrics_lib.failure_summary(got.episodes)
  batch_size = got.host.batch_size
  logging.warning("Step %d: %d of %d episodes failed, most by %s (%d), e.g. %s", done,
                  int(got.host.failed.sum()), batch_size, kind, count, example)
  if stop:
    raise EnvironmentFailing(
        f"Stopped after step {done}: more than env.max_failed_fraction="
        f"{config.env.max_failed_fraction:g} of the episodes failed in each of the last "
        f"{failing_steps} steps, most by {kind} ({count} of {batch_size} in step "
        f"{done}), e.g. {example}. Checkpoint {done} is saved; fix the environment and "
        "rerun with the same --workdir to resume.")


def _report_eval(step: int, metrics: dict[str, float]) -> None:
  success = metrics.get("eval/success_rate")
  tqdm.tqdm.write(f"eval at step {step}: held-out success "
                  + ("- (every episode failed)" if success is None else f"{success:.3f}"))


def summary_line(workdir: str, seconds: float) -> str:
  """One line on how the run went: held-out success at its first and last evaluation."""
  records = metrics_lib.read_metrics(workdir)
  evals = [(r["step"], r["eval/success_rate"]) for r in records if "eval/success_rate" in r]
  steps = max((r["step"] for r in records), default=0)
  where = (f"{steps} step{'s' * (steps != 1)}, {seconds / 60:.1f} min in this process; "
           f"results in {workdir}, view them with: python -m agentgym_jax.viewer {workdir}")
  if not evals:
    return f"Done: {where}."
  (first_step, first), (last_step, final) = evals[0], evals[-1]
  if len(evals) == 1:  # one evaluation (eval.at_start=False, evaluated at the end)
    return f"Held-out success {final:.3f} at step {last_step} ({where})."
  return (f"Held-out success {first:.3f} at step {first_step} -> {final:.3f} at step "
          f"{last_step} ({where}).")
