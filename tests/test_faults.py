"""Faults never poison training: failed episodes train nothing and stay out of the group
baselines, a mostly failing run stops, SIGTERM saves and resumes exactly, a checkpoint write cut
short never loses the run, a full disk stops it with one line and the last checkpoint kept, and
evaluation leaves failed episodes out of its table.

The first and last tests run in this process against real env workers (and an env server);
the others drive the trainer's command line in subprocesses, as tests/test_trainer.py does
(experiments/keypad/learn.py:runlocal, one CPU device, a shared compilation cache).
"""

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from agentgym_jax import settings as settings_lib
from agentgym_jax import evaluate
from agentgym_jax.models import Decoder, ModelConfig
from agentgym_jax.rl import advantages
from agentgym_jax.rollout import RolloutSettings, SamplingConfig, envs, run_episodes
from agentgym_jax.tokenization import ChatTokenizer
from agentgym_jax.train import config as base
from agentgym_jax.train import metrics as metrics_lib
from environments.server import running_server
from environments.workers import EnvPool
from test_trainer import CONFIG, REPO, metrics, run_cli, training_metrics
from toy_envs import CounterEnv

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_TOY_ENV = {"PYTHONPATH": os.pathsep.join([_TESTS_DIR, os.environ.get("PYTHONPATH", "")])}
# Every run: no evaluation (it is not what these tests look at), no progress bar.
_QUIET = ["--config.eval.every_steps=0", "--config.log.progress_bar=False"]


@pytest.fixture(scope="module")
def tok():
  corpus = [CounterEnv.instruction, "Target 1. Count 0. Action: inc", "Done. Slept."] * 10
  return ChatTokenizer.train_bpe(corpus, vocab_size=300)


@pytest.fixture(scope="module")
def model(tok):
  cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2)
  return Decoder(cfg, rngs=nnx.Rngs(0))


class ScriptedActions:
  """A real pool stepped with a chosen action per slot instead of the policy's reply."""

  def __init__(self, pool, actions):
    self.pool, self.actions = pool, actions
    self.env_cls = pool.env_cls

  def reset(self, task_ids):
    return self.pool.reset(task_ids)

  def step(self, slots, responses):
    return self.pool.step(slots, [f"Action: {self.actions[s]}" for s in slots])


def test_failed_episodes_train_nothing_and_stay_out_of_the_group_baselines(tok, model, caplog):
  # 3 tasks x 4 samples, target 1 each ("inc" succeeds, anything else ends at the turn limit
  # with reward 0). 4 workers: slot s lives in worker s % 4, so the crash in slot 0 fails
  # slots 0, 4 and 8; slots 1, 9 and 10 raise in their environment.
  actions = ["crash", "raise", "inc", "noop",   # group 0: healthy scores 1, 0
             "inc", "inc", "inc", "noop",       # group 1: 4 crashed; healthy 1, 1, 0
             "inc", "raise", "raise", "inc"]    # group 2: one healthy episode left
  graphdef, state = nnx.split(model)
  with EnvPool(CounterEnv, num_workers=4, timeout_s=30.0) as pool, \
       caplog.at_level(logging.WARNING):
    settings = RolloutSettings(sampling=SamplingConfig(max_reply_tokens=4), group_size=4,
                               max_turns=1, max_context=256)
    traj, stats = run_episodes((graphdef, state), tok, ScriptedActions(pool, actions),
                               [0, 5, 10], settings)
  traj = jax.device_get(traj)
  failed = [0, 1, 4, 8, 9, 10]
  assert np.flatnonzero(traj.failed).tolist() == failed
  episodes = stats["episodes"]
  assert [episodes[i].stop_reason for i in failed] == ["worker_crash", "env_error",
                                                         "worker_crash", "worker_crash",
                                                         "env_error", "env_error"]
  assert "died during step (exit code 3)" in episodes[0].error
  assert "step raised RuntimeError: CounterEnv was told to raise" in episodes[1].error
  # The replacement of worker 0 is logged once, with its reason.
  replaced = [r.getMessage() for r in caplog.records if "was replaced" in r.getMessage()]
  assert len(replaced) == 1 and "env worker 0" in replaced[0] and "died during step" in replaced[0]

  # Failed episodes train nothing: no loss-mask token, no reward.
  mask = np.asarray(traj.loss_mask)
  assert not mask[failed].any() and mask[[2, 3, 5, 6, 7, 11]].any(axis=1).all()
  assert (np.asarray(traj.rewards).sum(axis=1) == [0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 1]).all()

  # Group baselines over the healthy episodes, by hand (unbiased std):
  #   group 0: scores 1, 0 -> mean 1/2, std sqrt(1/2) -> +-1/sqrt(2)
  #   group 1: scores 1, 1, 0 -> mean 2/3, std sqrt(1/3) -> 1/sqrt(3), 1/sqrt(3), -2/sqrt(3)
  #   group 2: one healthy episode: no baseline, advantage 0
  adv, _ = advantages.grpo(traj.rewards, traj.loss_mask, group_ids=traj.group_id)
  rows = np.asarray(adv).sum(axis=1) / np.maximum(mask.sum(axis=1), 1)
  want = np.array([0, 0, 2 ** -0.5, -2 ** -0.5, 0, 3 ** -0.5, 3 ** -0.5, -2 * 3 ** -0.5,
                   0, 0, 0, 0])
  np.testing.assert_allclose(rows, want, atol=1e-5)
  # RLOO: n / (n - 1) (s - mean) over the healthy n: 2 * (+-1/2); 3/2 * (1/3, 1/3, -2/3).
  adv_rloo, _ = advantages.rloo(traj.rewards, traj.loss_mask, group_ids=traj.group_id)
  rows_rloo = np.asarray(adv_rloo).sum(axis=1) / np.maximum(mask.sum(axis=1), 1)
  np.testing.assert_allclose(rows_rloo, [0, 0, 1, -1, 0, .5, .5, -1, 0, 0, 0, 0], atol=1e-6)
  # ... which is what a batch without the failed episodes (and the lone survivor) gives.
  kept = [2, 3, 5, 6, 7]
  alone, _ = advantages.grpo(traj.rewards[kept], traj.loss_mask[kept],
                             group_ids=traj.group_id[kept])
  np.testing.assert_allclose(np.asarray(adv)[kept], np.asarray(alone), atol=1e-6)

  # The step's metrics count them by reason and average the outcomes over the healthy ones.
  counted = metrics_lib.episode_metrics(traj, episodes)
  assert counted["episodes/failed_rate"] == pytest.approx(0.5)
  assert counted["episodes/stop_worker_crash"] == pytest.approx(0.25)
  assert counted["episodes/stop_env_error"] == pytest.approx(0.25)
  assert counted["episodes/success_rate"] == pytest.approx(4 / 6)
  assert metrics_lib.failure_summary(episodes)[:2] == ("worker_crash", 3)


def _evaluate_config(url):
  c = base.base_config()
  c.env.name = "remote"
  # A short instruction keeps the openings within a tiny context.
  c.env.kwargs = ml_collections.ConfigDict(
      {"url": url, "env_name": "babyai", "instruction": "Go."})
  c.env.num_workers = 1
  c.rollout.max_context = 256
  return base.lock(c)


def test_evaluation_reports_failed_episodes_as_failed_not_as_zeros(tok, model, tmp_path):
  # The env server fails the reset of every task whose id is divisible by 3 and scores every
  # other episode 1: BabyAI's first 6 test tasks (1800-1805) hold two such tasks.
  graphdef, state = nnx.split(model)
  with running_server("toy_envs:FlakyEnv", protocol="babyai", extra_env=_TOY_ENV) as url:
    config = _evaluate_config(url)
    settings = settings_lib.evaluation(config, split="test", num_tasks=6, num_samples=2,
                                       max_turns=1, temperature=1.0, max_reply_tokens=4)
    env = settings_lib.env(config)
    with envs.make_pool(env) as pool:
      result = evaluate.evaluate(env, settings, graphdef, state, tok, pool,
                                 rng=evaluate.eval_key(0))
  assert result.failed.tolist() == [t % 3 == 0 for t in result.task_ids]
  assert result.failed.sum() == 4
  assert {r for r, f in zip(result.stop_reasons, result.failed) if f} == {"reset_failed"}
  overall = result.summary["Overall"]
  # Over the 8 healthy episodes every one passed: failures are not zeros.
  assert overall["avg"] == 1.0 and overall["pass"] == 1.0 and overall["pass@1"] == 1.0
  assert overall["failed"] == 4 and overall["num_tasks"] == 6
  assert result.success_rate == 1.0
  _, md_path = evaluate.write_report(result, str(tmp_path), "flaky", "test")
  with open(md_path) as f:
    table = f.read()
  assert "| flaky (Pass@2) | 100.00 |" in table and "| flaky (Avg@2) | 100.00 |" in table
  assert "Failed episodes: 4 of 12 (reset_failed 4), left out of Avg@n and Pass@n" in table
  assert "4 episodes failed" in evaluate.result_line(result, "flaky", "test", str(tmp_path))
  # Every episode failed: nothing measured, and the closing line says so instead of crashing.
  nothing = {**overall, "avg": None, "pass": None}
  all_failed = dataclasses.replace(result, summary={"Overall": nothing},
                                   failed=np.ones_like(result.failed))
  line = evaluate.result_line(all_failed, "flaky", "test", str(tmp_path))
  assert "Pass@2 -, Avg@2 -, success - per episode" in line and "12 episodes failed" in line


# ----- the trainer's command line ----------------------------------------------------------


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("jax_cache"))


def train(workdir, cache_dir, *overrides, ok=True):
  result = run_cli("agentgym_jax.train", [f"--config={CONFIG}", f"--workdir={workdir}", *_QUIET,
                                          *overrides], cache_dir)
  if ok:
    assert result.returncode == 0, result.stderr[-3000:]
  return result


def start_train(workdir, cache_dir, *overrides, driver=None):
  """The trainer's command line (or `driver`, a script standing in for it) as a child process."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache_dir,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  command = [driver] if driver else ["-m", "agentgym_jax.train"]
  return subprocess.Popen([sys.executable, *command, f"--config={CONFIG}",
                           f"--workdir={workdir}", *_QUIET, *overrides], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, process, timeout=600):
  deadline = time.monotonic() + timeout
  while not condition():
    if process.poll() is not None or time.monotonic() > deadline:
      process.kill()
      out, err = process.communicate()
      pytest.fail(f"the run ended (or took too long) first: {process.returncode}\n{err[-3000:]}")
    time.sleep(0.2)


def saved_steps(workdir):
  return sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit())


def test_a_run_whose_episodes_all_fail_stops_with_a_checkpoint_and_resumes(tmp_path,
                                                                         compile_cache):
  workdir = str(tmp_path / "run")
  train(workdir, compile_cache, "--config.total_steps=1")  # healthy: the tokenizer, checkpoint 1
  # keypad with max_steps=0 cannot be built: every reset fails, in every step.
  broken = train(workdir, compile_cache, "--config.total_steps=6",
                 "--config.env.kwargs.max_steps=0", "--config.env.max_failed_steps=2", ok=False)
  assert broken.returncode == 1
  line = broken.stderr.strip().splitlines()[-1]
  assert line.startswith("FATAL: Stopped after step 3: more than env.max_failed_fraction=0.5 of "
                         "the episodes failed in each of the last 2 steps, most by reset_failed "
                         "(8 of 8 in step 3), e.g. reset of task"), line
  assert "max_steps must be >= 1" in line and "rerun with the same --workdir" in line
  assert saved_steps(workdir)[-1] == 3
  failing = metrics(workdir)[-2:]
  assert [m["step"] for m in failing] == [2, 3]
  assert all(m["episodes/failed_rate"] == 1.0 and m["episodes/stop_reset_failed"] == 1.0
             for m in failing)
  # The fault is gone: the rerun resumes from checkpoint 3.
  train(workdir, compile_cache, "--config.total_steps=4")
  with open(os.path.join(workdir, "train.log")) as f:
    assert "Restored checkpoint 3" in f.read()
  lines = metrics(workdir)
  assert [m["step"] for m in lines] == [1, 2, 3, 4] and lines[-1]["episodes/failed_rate"] == 0.0


SIGTERM_RUN_STEPS = 12


def test_sigterm_saves_exits_0_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path,
                                                                              compile_cache):
  # Enough steps that the run is still going when the signal lands: once compiled, a keypad
  # step takes well under a second.
  straight, preempted = str(tmp_path / "straight"), str(tmp_path / "preempted")
  train(straight, compile_cache, f"--config.total_steps={SIGTERM_RUN_STEPS}")
  process = start_train(preempted, compile_cache,
                        f"--config.total_steps={SIGTERM_RUN_STEPS}")
  # Step 1 is logged: step 2 is under way.
  wait_for(lambda: os.path.exists(os.path.join(preempted, "metrics.jsonl")), process)
  process.send_signal(signal.SIGTERM)
  out, err = process.communicate(timeout=600)
  assert process.returncode == 0, err[-3000:]
  stopped_at = saved_steps(preempted)[-1]
  assert stopped_at < SIGTERM_RUN_STEPS and f"Preempted: saved checkpoint {stopped_at} in " in out
  assert [m["step"] for m in metrics(preempted)] == list(range(1, stopped_at + 1))
  assert not os.path.exists(os.path.join(preempted, "hf"))  # not finished: nothing exported
  train(preempted, compile_cache, f"--config.total_steps={SIGTERM_RUN_STEPS}")
  a, b = metrics(straight), metrics(preempted)
  assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, SIGTERM_RUN_STEPS + 1))
  for line_a, line_b in zip(a, b):
    assert training_metrics(line_a) == training_metrics(line_b), line_a["step"]
  with open(os.path.join(straight, "hf", "model.safetensors"), "rb") as f_a, \
       open(os.path.join(preempted, "hf", "model.safetensors"), "rb") as f_b:
    assert f_a.read() == f_b.read()  # identical final parameters, bit for bit


# Stands in for `python -m agentgym_jax.train`: Orbax's last act of a save, renaming the
# finished temporary directory, hangs for step SLOW_STEP after announcing it in MARKER.
_SLOW_SAVE = textwrap.dedent("""\
    import asyncio, os, runpy, sys
    from orbax.checkpoint._src.path import atomicity
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def slow_finalize(self, *args, **kwargs):
      if self.get_final().name == os.environ["SLOW_STEP"]:
        open(os.environ["MARKER"], "w").close()
        await asyncio.sleep(600)
      return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = slow_finalize
    sys.argv[0] = "agentgym_jax.train"
    runpy.run_module("agentgym_jax.train", run_name="__main__", alter_sys=True)
    """)


def test_a_process_killed_while_saving_resumes_from_the_last_complete_checkpoint(
    tmp_path, compile_cache, monkeypatch):
  workdir, marker = str(tmp_path / "run"), str(tmp_path / "saving")
  driver = tmp_path / "slow_save.py"
  driver.write_text(_SLOW_SAVE)
  monkeypatch.setenv("SLOW_STEP", "2")
  monkeypatch.setenv("MARKER", marker)
  process = start_train(workdir, compile_cache, "--config.total_steps=3", driver=str(driver))
  wait_for(lambda: os.path.exists(marker), process)
  process.kill()  # SIGKILL while checkpoint 2 is being written
  process.communicate()
  names = os.listdir(os.path.join(workdir, "checkpoints"))
  assert saved_steps(workdir) == [1] and any(n.startswith("2.orbax-checkpoint-tmp") for n in names)

  result = train(workdir, compile_cache, "--config.total_steps=3")
  assert (f"Checkpoint 2 in {os.path.join(workdir, 'checkpoints')} was not completely written"
          in result.stdout and "resuming from checkpoint 1, the last complete one" in result.stdout)
  with open(os.path.join(workdir, "train.log")) as f:
    assert "Restored checkpoint 1" in f.read()
  assert saved_steps(workdir) == [2, 3]
  assert [m["step"] for m in metrics(workdir)] == [1, 2, 3]
  assert not any("orbax-checkpoint-tmp" in n for n in os.listdir(os.path.join(workdir,
                                                                              "checkpoints")))
  assert [m["step"] for m in metrics(workdir)] == [1, 2, 3]


# Stands in for `python -m agentgym_jax.train`: the disk under the checkpoints reports FREE_AFTER
# bytes free from the second save on (the first one sees the real disk).
_FULL_DISK = textwrap.dedent("""\
    import os, runpy, shutil, sys
    real, calls = shutil.disk_usage, []

    def disk_usage(path):
      calls.append(path)
      usage = real(path)
      return usage if len(calls) == 1 else usage._replace(free=int(os.environ["FREE_AFTER"]))

    shutil.disk_usage = disk_usage
    sys.argv[0] = "agentgym_jax.train"
    runpy.run_module("agentgym_jax.train", run_name="__main__", alter_sys=True)
    """)


def test_a_full_disk_stops_the_run_with_one_line_and_keeps_the_last_checkpoint(
    tmp_path, compile_cache, monkeypatch):
  workdir = str(tmp_path / "run")
  driver = tmp_path / "full_disk.py"
  driver.write_text(_FULL_DISK)
  monkeypatch.setenv("FREE_AFTER", "1000")
  process = start_train(workdir, compile_cache, "--config.total_steps=3", driver=str(driver))
  out, err = process.communicate(timeout=600)
  assert process.returncode == 1, err[-3000:]
  line = err.strip().splitlines()[-1]
  assert line.startswith("FATAL: Checkpoint 2 needs ") and "GiB free: free disk space" in line, line
  assert saved_steps(workdir) == [1]
  assert not any("orbax-checkpoint-tmp" in n for n in os.listdir(os.path.join(workdir,
                                                                              "checkpoints")))
  train(workdir, compile_cache, "--config.total_steps=3")  # space again: resumed from 1
  assert saved_steps(workdir) == [2, 3]
  assert [m["step"] for m in metrics(workdir)] == [1, 2, 3]


def test_a_checkpoint_counts_each_shard_once():
  from agentgym_jax.train import checkpoints  # pylint: disable=import-outside-toplevel
  mesh = jax.make_mesh((2, 2), ("data", "fsdp"), devices=jax.devices()[:4])
  split = jax.device_put(np.zeros((8, 4), np.float32),  # halves, each on 2 devices
                         jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  assert checkpoints.bytes_written({"split": split, "host": np.zeros(3, np.int32)}) == 128 + 12
