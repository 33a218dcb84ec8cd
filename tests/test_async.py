"""Asynchronous rollout (agentgym_jax/train/asynchronous.py, docs/async.md): the rollout
thread's order, bound and failures with a stand-in sampler; the device groups of a TPU slice
and the plan's programs on each; a partial rollout's turns each
sampled by a full forward of their weights (the episode runner with two models); then whole
runs of experiments/keypad/learn.py:runlocal through the command line (the shared compilation
cache makes reruns fast): staleness 0 on a device group of its own equals the synchronous loop
value for value, staleness k records its versions and never trains a batch more than k updates
old, partial rollouts stay within the bound, a run whose environments fail stops as the
synchronous one does and resumes. Slow: a resumed run at staleness 0 equals an uninterrupted
one, and the keypad learning checks with staleness 1, 2 and 2 with partial rollouts:

  .venv/bin/pytest tests/test_async.py -m slow -q -s
"""

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tpu_slices

from flax import nnx

from agentgym_jax import caches
from agentgym_jax import plan
from agentgym_jax import sharding
from agentgym_jax import tpus
from agentgym_jax.rollout import RolloutSettings, run_episodes
from agentgym_jax.train import asynchronous, batches
from agentgym_jax.train import config as base
from test_episodes import SAMPLING, FakePool, _forward_logprobs, _model, tok  # noqa: F401
from test_trainer import REPO, metrics, training_metrics

CONFIG = "experiments/keypad/learn.py:runlocal"
_QUIET = ["--config.log.progress_bar=False", "--config.checkpoint.export_hf=False"]


# ----- the rollout thread, with a stand-in sampler ---------------------------------------------

def _board():
  return asynchronous.WeightBoard(sharding.make_mesh([("data", -1)], devices=jax.devices()[:1]))


def test_each_step_is_sampled_by_the_version_k_updates_before_it():
  board, taken = _board(), []
  board.publish(0, {"w": jnp.zeros(2)})

  def sample(step, params, version):
    taken.append((step, version, float(params["w"][0])))
    return step

  thread = asynchronous.RolloutThread(sample, board, first_step=0, total_steps=6,
                                      max_staleness=2)
  for step in range(6):
    assert thread.next() == step
    # Step s is trained by version s; the thread can then be at most 2 updates ahead.
    time.sleep(0.05)
    assert len(taken) <= step + 1 + 2, taken
    board.publish(step + 1, {"w": jnp.full(2, step + 1.0)})
  thread.close()
  # Versions max(s - 2, 0), each the weights published as that version.
  assert taken == [(0, 0, 0.0), (1, 0, 0.0), (2, 0, 0.0), (3, 1, 1.0), (4, 2, 2.0),
                   (5, 3, 3.0)]
  # The board forgets the versions the thread has gone past (then closes).
  assert board.versions() == []


def test_a_resumed_thread_never_samples_before_its_first_step():
  board = _board()
  board.publish(5, {"w": jnp.zeros(2)})
  versions = []
  thread = asynchronous.RolloutThread(lambda s, p, v: versions.append(v) or s, board,
                                      first_step=5, total_steps=7, max_staleness=3)
  assert [thread.next(), thread.next()] == [5, 6]
  thread.close()
  assert versions == [5, 5]


def test_a_failing_sampler_loses_none_of_the_steps_finished_before_it():
  board = _board()
  board.publish(0, {"w": jnp.zeros(2)})

  def sample(step, params, version):
    if step == 2:
      raise ConnectionError("env server went away")
    return step

  thread = asynchronous.RolloutThread(sample, board, first_step=0, total_steps=5,
                                      max_staleness=3)
  assert [thread.next(), thread.next()] == [0, 1]
  with pytest.raises(asynchronous.RolloutFailed,
                     match="stopped: ConnectionError: env server went away"):
    thread.next()
  thread.close()


def test_close_stops_a_thread_waiting_for_weights():
  board = _board()  # nothing published: the thread waits for version 0
  thread = asynchronous.RolloutThread(lambda s, p, v: s, board, first_step=0, total_steps=3,
                                      max_staleness=1)
  closer = threading.Timer(0.2, thread.close)
  closer.start()
  with pytest.raises(asynchronous.RolloutFailed, match="ended without the next step's batch"):
    thread.next()
  closer.join()


def test_weights_are_published_device_to_device_onto_the_rollout_mesh():
  train_mesh = sharding.make_mesh([("data", 2)], devices=jax.devices()[:2])
  rollout_mesh = sharding.make_mesh([("data", 2)], devices=jax.devices()[2:4])
  spec = jax.sharding.PartitionSpec("data")
  w = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(train_mesh, spec))
  board = asynchronous.WeightBoard(rollout_mesh)
  board.publish(3, {"w": w})
  version, weights = board.take(3)
  got = weights["w"]
  assert version == 3
  assert got.sharding == jax.sharding.NamedSharding(rollout_mesh, spec)
  assert set(got.devices()) == set(jax.devices()[2:4])
  np.testing.assert_array_equal(got, np.arange(8.0))
  # A copy even on the same mesh: the update donates the buffers it was given.
  same = asynchronous.WeightBoard(train_mesh)
  same.publish(0, {"w": w})
  w.delete()
  np.testing.assert_array_equal(same.take(0)[1]["w"], np.arange(8.0))


def test_with_newest_the_thread_takes_the_newest_weights_published_and_newer_offers_them():
  board = _board()
  for version in range(3):
    board.publish(version, {"w": jnp.full(2, float(version))})
  assert board.newer(0)[0] == 2 and board.newer(2) is None
  taken = []
  thread = asynchronous.RolloutThread(lambda s, p, v: taken.append(v) or s, board,
                                      first_step=0, total_steps=1, max_staleness=1,
                                      newest=True)
  assert thread.next() == 0
  thread.close()
  assert taken == [2]


# ----- partial rollouts: new weights between turns, the cache prefilled again ------------------

def test_a_partial_rollout_continues_with_new_weights_from_a_cache_they_computed(tok):
  old, new = _model(tok, seed=0), _model(tok, seed=1)
  graphdef, old_state = nnx.split(old)
  asked = []

  def weights(version):
    asked.append(version)
    return (1, nnx.state(new)) if len(asked) == 2 else None  # before the batch's 2nd turn

  settings = RolloutSettings(sampling=SAMPLING, max_turns=4, max_context=1024, compact=False)
  # FakePool: task k lasts k % 4 + 1 turns.
  traj, stats = run_episodes((graphdef, old_state), tok, FakePool(), [1, 2, 3, 5], settings,
                             rng=3, version=0, weights=weights)
  assert asked == [0, 0, 1, 1]
  assert [e.policy_versions for e in stats["episodes"]] == [[0, 1], [0, 1, 1], [0, 1, 1, 1],
                                                            [0, 1]]
  # Each turn's tokens were sampled by its version's weights over a context they computed: the
  # sampler's log-probs are a full forward's of that model. A cache kept from the old weights
  # would give the new turns other log-probs.
  mask, turn = np.asarray(traj.loss_mask), np.asarray(traj.turn_index)
  sampled = np.asarray(traj.sample_logprobs)
  first, later = mask & (turn == 0), mask & (turn >= 1)
  np.testing.assert_allclose(sampled[first], _forward_logprobs(old, traj)[first], atol=1e-4)
  np.testing.assert_allclose(sampled[later], _forward_logprobs(new, traj)[later], atol=1e-4)
  assert np.abs(sampled[later] - _forward_logprobs(old, traj)[later]).max() > 1e-2


# ----- settings --------------------------------------------------------------------------------

def _config(**rollout):
  c = base.base_config()
  c.update_from_flattened_dict({f"rollout.{k}": v for k, v in rollout.items()})
  return c


def test_staleness_0_on_the_trainers_mesh_is_the_synchronous_loop():
  assert not asynchronous.AsyncSettings.from_config(_config()).enabled
  assert asynchronous.device_groups(asynchronous.AsyncSettings()) == (None, None)


def test_bad_async_settings_stop_the_run_saying_what_to_change():
  with pytest.raises(ValueError, match=r"max_staleness=2 .* set algo.tis_cap > 0"):
    asynchronous.AsyncSettings.from_config(_config(max_staleness=2))
  c = _config(max_staleness=1)
  c.algo.tis_cap = 2.0
  c.mode = "bc"
  with pytest.raises(ValueError, match="apply to mode='rl' only"):
    asynchronous.AsyncSettings.from_config(c)
  settings = asynchronous.AsyncSettings.from_config(_config(devices=jax.local_device_count()))
  with pytest.raises(ValueError, match=f"leaves none of the {jax.local_device_count()} "
                     "devices of each process"):
    asynchronous.device_groups(settings)
  with pytest.raises(ValueError, match="must be >= 0"):
    asynchronous.AsyncSettings.from_config(_config(max_staleness=-1))
  with pytest.raises(ValueError, match="partial=True needs rollout.max_staleness > 0"):
    asynchronous.AsyncSettings.from_config(_config(partial=True))


def test_replicas_are_checked_on_the_rollout_devices_not_the_trainers():
  c = _config(devices=6, replicas=3)
  c.data.batch_tasks, c.data.group_size = 2, 4
  train_mesh = sharding.make_mesh(c.mesh, devices=jax.devices()[:2])
  rollout_mesh = sharding.make_mesh(c.mesh, devices=jax.devices()[2:])
  batches.check_layout(c, train_mesh, rollout_mesh)  # 3 replicas of 2 devices each
  with pytest.raises(ValueError, match="rollout.replicas"):
    batches.check_layout(c, train_mesh)  # the trainer's 2 devices hold no 3 replicas
  c.rollout.replicas = 4
  with pytest.raises(ValueError, match="rollout.replicas"):
    batches.check_layout(c, train_mesh, rollout_mesh)


def test_the_device_groups_split_every_hosts_devices_alike():
  # A v5e-16's 4 hosts of 4 chips: the last chip of each rolls out, the other 12 train.
  tpu_slices.require_libtpu()
  devices = tpus.Slice.parse("v5e-16").devices()
  train, rollout = asynchronous.device_groups(asynchronous.AsyncSettings(rollout_devices=1),
                                              devices)
  hosts = lambda group: [d.process_index for d in group]
  assert hosts(train) == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
  assert hosts(rollout) == [0, 1, 2, 3] and not set(train) & set(rollout)
  # Neither group fills a box of the chips' torus: each keeps the order of its devices.
  mesh = sharding.make_mesh([("data", -1)], train)
  assert list(mesh.devices.flat) == train


def _keypad():
  """experiments/keypad/learn.py:runlocal's config."""
  spec = importlib.util.spec_from_file_location(
      "keypad_learn", os.path.join(REPO, "experiments", "keypad", "learn.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config("runlocal")


def _split_keypad():
  """Keypad's tiny model at staleness 1 with 1 chip of each host rolling out (libtpu needed)."""
  tpu_slices.require_libtpu()
  config = _keypad()
  config.update_from_flattened_dict({
      "data.batch_tasks": 6, "data.group_size": 8, "rollout.devices": 1,
      "rollout.max_staleness": 1, "algo.tis_cap": 2.0, "algo.kl_coef": 0.01})
  return config


def test_the_plan_compiles_each_groups_programs_on_its_own_chips():
  # Keypad's tiny model on a v5e-16 split as above; the rollout's extend on one host's rollout
  # chip and the scorer (a KL reference makes the step score) on the 12 train chips.
  config = _split_keypad()
  target = tpus.Slice.parse("v5e-16")
  programs, _ = plan.plan(config, target, only=("rollout_extend", "score_logprobs"))
  extend, score = programs
  assert (extend.name, extend.group) == ("rollout_extend", "rollout, 1 of each host's 4 chips")
  assert (score.name, score.group) == ("score_logprobs", "train, 12 chips")
  assert plan.fits(extend, target) and plan.fits(score, target)
  # The rollout chip holds no train state: besides the weights it decodes with, the one more
  # version staleness 1 may keep on the board.
  run = plan.Run.build(config, target.devices())
  weights = sum(x.size for x in jax.tree.leaves(run.state.policy)) * np.dtype(
      run.update_cfg.compute_dtype).itemsize
  assert extend.resident == weights
  assert score.resident > plan.per_chip_bytes(run.state.policy)  # the train state's share


def test_a_split_that_libtpu_will_not_place_is_one_line_naming_the_program():
  # On a v5e-64 (16 hosts) libtpu places no program on some chips of every host: the train
  # group's scorer is refused (the rollout's, on one host's chip, compiles).
  config = _split_keypad()
  with pytest.raises(ValueError, match=r"^score_logprobs: libtpu compiles no program over part "
                     r"of this slice's hosts' chips .*\(rollout.devices=0\)$"):
    plan.plan(config, tpus.Slice.parse("v5e-64"), only=("rollout_extend", "score_logprobs"))


# ----- whole runs through the command line -----------------------------------------------------

@pytest.fixture(scope="module")
def compile_cache():
  # The cache every test process shares (tests/conftest.py): a rerun loads the executables
  # of both device layouts instead of compiling them again.
  return caches.default_compilation_cache_dir()


def train(workdir, cache_dir, *overrides, devices=1, ok=True, config=CONFIG, timeout=600,
          evaluate=False):
  """The trainer's command line on `devices` CPU devices (without evaluation unless
  `evaluate`)."""
  overrides = overrides if evaluate else ("--config.eval.every_steps=0", *overrides)
  env = dict(os.environ)
  env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache_dir,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  result = subprocess.run([sys.executable, "-m", "agentgym_jax.train", f"--config={config}",
                           f"--workdir={workdir}", *_QUIET, *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
  if ok:
    assert result.returncode == 0, result.stderr[-3000:]
  return result


def _trained(line):
  """A step's metrics but the machine's timings, the async/ ones and the sampler/trainer gap."""
  return {k: v for k, v in training_metrics(line).items()
          if not k.startswith(("async/", "rollout/logprob_gap"))}


def test_staleness_0_on_its_own_devices_equals_the_synchronous_loop(tmp_path, compile_cache):
  # Both train on a 2-device mesh; the second rolls out on 2 more devices, after each update
  # (step 2 samples with the weights published after step 1).
  steps = "--config.total_steps=2"
  train(str(tmp_path / "sync"), compile_cache, steps, devices=2)
  train(str(tmp_path / "split"), compile_cache, steps, "--config.rollout.devices=2", devices=4)
  sync, split = metrics(str(tmp_path / "sync")), metrics(str(tmp_path / "split"))
  assert [m["async/staleness"] for m in split] == [0.0, 0.0]
  assert len(sync) == 2 and all("async/staleness" not in m for m in sync)
  # The same episodes, losses, gradient norms and weights' statistics, bit for bit ...
  assert [_trained(m) for m in split] == [_trained(m) for m in sync]
  # ... and the sampler's log-probs within float32 rounding of the synchronous run's (measured:
  # mean |gap| 6.6e-8 against 9.6e-8 at one step; a 4-device process's decode rounds
  # differently in the last bits, cause not isolated).
  for a, b in zip(split, sync):
    assert abs(a["rollout/logprob_gap"] - b["rollout/logprob_gap"]) < 1e-6


def test_staleness_2_trains_no_batch_older_than_2_updates_and_records_versions(
    tmp_path, compile_cache):
  workdir = str(tmp_path / "run")
  train(workdir, compile_cache, "--config.total_steps=5", "--config.rollout.max_staleness=2",
        "--config.algo.tis_cap=2.0", "--config.log.trajectories_every=1",
        "--config.log.trajectories_episodes=8")
  lines = metrics(workdir)
  # Step s (1-based) is trained by version s - 1 and sampled by version max(s - 3, 0).
  assert [m["async/policy_version"] for m in lines] == [0.0, 0.0, 0.0, 1.0, 2.0]
  assert [m["async/staleness"] for m in lines] == [0.0, 1.0, 2.0, 2.0, 2.0]
  # The stale batches are corrected by truncated importance sampling.
  assert all("actor/tis_weight" in m for m in lines)
  for m in lines:
    with open(os.path.join(workdir, "trajectories", f"step_{m['step']}.jsonl")) as f:
      records = [json.loads(line) for line in f]
    assert len(records) == 8
    versions = {v for r in records for v in r["policy_versions"]}
    assert versions == {m["async/policy_version"]}
    assert all(m["step"] - 1 - v <= 2 for v in versions)


def test_partial_rollouts_keep_every_turn_within_the_bound(tmp_path, compile_cache):
  workdir = str(tmp_path / "run")
  train(workdir, compile_cache, "--config.total_steps=3", "--config.rollout.max_staleness=1",
        "--config.rollout.partial=True", "--config.algo.tis_cap=2.0",
        "--config.log.trajectories_every=1", "--config.log.trajectories_episodes=8")
  for m in metrics(workdir):
    assert m["async/staleness"] <= 1 and m["async/staleness_mean"] <= m["async/staleness"]
    with open(os.path.join(workdir, "trajectories", f"step_{m['step']}.jsonl")) as f:
      versions = {v for line in f for v in json.loads(line)["policy_versions"]}
    # Trained by version step - 1: every turn sampled by it or the one before.
    assert versions <= {m["step"] - 2, m["step"] - 1}, versions


@pytest.mark.slow  # ~30 s; tests/test_faults.py runs the synchronous loop's in the default suite
def test_an_async_run_whose_episodes_all_fail_stops_with_a_checkpoint_and_resumes(
    tmp_path, compile_cache):
  workdir = str(tmp_path / "run")
  async_run = ["--config.rollout.max_staleness=1", "--config.algo.tis_cap=2.0"]
  train(workdir, compile_cache, "--config.total_steps=1", *async_run)
  # keypad with max_steps=0 cannot be built: every reset fails, in every step.
  broken = train(workdir, compile_cache, "--config.total_steps=6", *async_run,
                 "--config.env.kwargs.max_steps=0", "--config.env.max_failed_steps=2",
                 ok=False)
  assert broken.returncode == 1
  line = broken.stderr.strip().splitlines()[-1]
  assert line.startswith("FATAL: Stopped after step 3: more than env.max_failed_fraction=0.5 of "
                         "the episodes failed in each of the last 2 steps, most by reset_failed "
                         "(8 of 8 in step 3)"), line
  failing = metrics(workdir)[-2:]
  assert [m["step"] for m in failing] == [2, 3]
  # Failed episodes train nothing: no token in the loss, so no gradient.
  assert all(m["episodes/failed_rate"] == 1.0 and m["actor/grad_norm"] == 0.0 for m in failing)
  train(workdir, compile_cache, "--config.total_steps=4", *async_run)
  lines = metrics(workdir)
  assert [m["step"] for m in lines] == [1, 2, 3, 4] and lines[-1]["episodes/failed_rate"] == 0.0
  # Resumed from checkpoint 3: step 4 is sampled by the resumed weights.
  assert lines[-1]["async/staleness"] == 0.0


@pytest.mark.slow
def test_a_resumed_run_at_staleness_0_on_its_own_devices_equals_an_uninterrupted_one(
    tmp_path, compile_cache):
  split = ["--config.rollout.devices=2"]
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  train(straight, compile_cache, "--config.total_steps=3", *split, devices=4)
  train(resumed, compile_cache, "--config.total_steps=2", *split, devices=4)
  train(resumed, compile_cache, "--config.total_steps=3", *split, devices=4)
  assert ([training_metrics(m) for m in metrics(resumed)]
          == [training_metrics(m) for m in metrics(straight)])


@pytest.mark.slow
@pytest.mark.parametrize("staleness,partial", [(1, False), (2, False), (2, True)])
def test_grpo_learns_keypad_from_scratch_with_stale_rollouts(staleness, partial, tmp_path,
                                                             compile_cache):
  start = time.perf_counter()
  train(str(tmp_path), compile_cache, f"--config.rollout.max_staleness={staleness}",
        f"--config.rollout.partial={partial}", "--config.algo.tis_cap=2.0",
        config="experiments/keypad/learn.py:algo=grpo", timeout=1800, evaluate=True)
  lines = metrics(str(tmp_path))
  success = [m["episodes/success_rate"] for m in lines if "episodes/success_rate" in m]
  print(f"\nstaleness {staleness}, partial {partial}: {time.perf_counter() - start:.0f} s, "
        f"success by step {[round(s, 2) for s in success]}, "
        f"held-out greedy {lines[-1]['eval/success_rate']}")
  # Partial rollouts start a step with the newest weights out: at most k stale, maybe fresher.
  worst = max(m.get("async/staleness", 0) for m in lines)
  assert worst <= staleness and (partial or worst == staleness)
  assert success[0] < 0.2, success
  assert sum(success[-3:]) / 3 > 0.9, success
  assert lines[-1]["eval/success_rate"] > 0.9
