"""A run compiles once: JAX's persistent compilation cache and the per-step compile metrics.

Keypad's runlocal config (experiments/keypad/learn.py) through the command lines, in fresh
processes on one CPU device with caches of their own under tmp_path (the suite's shared cache,
tests/conftest.py, stays out of it): a first run compiles into an empty cache, a second loads
what it saved, and an evaluation with the cache off saves nothing.
"""

import os
import shutil
import subprocess
import sys

import pytest

from agentgym_jax import caches
from agentgym_jax.train import config as base
from test_trainer import CONFIG, REPO, metrics

# Three steps without evaluation or saved trajectories: a saving step scores per-token
# log-probs (a program of its own), so with these every program is built in step 1.
STEPS = ["--config.total_steps=3", "--config.eval.every_steps=0",
         "--config.log.trajectories_every=0", "--config.checkpoint.export_hf=False",
         "--config.log.progress_bar=False"]


def run_cli(module, args, jax_cache_dir):
  """`python -m module args` with JAX_COMPILATION_CACHE_DIR=`jax_cache_dir` (the default of
  config.compile.cache_dir); returns the finished process."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # one device: conftest's eight would only slow these runs down
  env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(jax_cache_dir))
  result = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def train(workdir, jax_cache_dir, *overrides):
  run_cli("agentgym_jax.train", [f"--config={CONFIG}", f"--workdir={workdir}", *STEPS,
                                 *overrides], jax_cache_dir)
  return metrics(workdir)


def total(records, name):
  return sum(r.get(name, 0.0) for r in records)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A cold run whose config names the cache (JAX's variable points elsewhere), then the same
  run in a new process that finds it through JAX_COMPILATION_CACHE_DIR."""
  root = tmp_path_factory.mktemp("compile_cache")
  cache, elsewhere = root / "cache", root / "elsewhere"
  cold = train(root / "cold", elsewhere, f"--config.compile.cache_dir={cache}")
  saved = sorted(os.listdir(cache))
  warm = train(root / "warm", cache)
  # A copy in another directory (a pod's hosts, a CI cache): its keys do not name the path.
  copy = shutil.copytree(cache, root / "copy")
  moved = train(root / "moved", copy)
  return dict(root=root, cache=cache, elsewhere=elsewhere, cold=cold, warm=warm, moved=moved,
              saved=saved)


def test_a_second_run_loads_what_the_first_compiled(runs):
  cold, warm = runs["cold"], runs["warm"]
  assert total(cold, "compile/count") > 0 and total(cold, "compile/cache_hits") == 0
  # Every program of the second run but a few is a cache hit, and loading them takes a small
  # fraction of the time that compiling them took.
  compiled = total(warm, "compile/count") - total(warm, "compile/cache_hits")
  assert compiled <= 0.1 * total(cold, "compile/count"), warm
  assert total(warm, "compile/seconds") < 0.25 * total(cold, "compile/seconds"), (cold, warm)
  # The loads are the warm run's build seconds; the cold run loaded nothing.
  assert total(cold, "compile/load_seconds") == 0
  assert 0 < total(warm, "compile/load_seconds") <= total(warm, "compile/seconds"), warm


def test_a_copy_of_the_cache_in_another_directory_is_hit(runs):
  moved = runs["moved"]
  compiled = total(moved, "compile/count") - total(moved, "compile/cache_hits")
  assert compiled <= 0.1 * total(runs["cold"], "compile/count"), moved


def test_every_step_records_its_compiles_and_a_fixed_shape_run_builds_only_in_step_one(runs):
  for records in runs["cold"], runs["warm"]:
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all({"compile/count", "compile/cache_hits", "compile/seconds",
                "compile/load_seconds"} <= set(r)
               for r in records)
    first, *later = records
    assert first["compile/count"] > 0 and first["compile/seconds"] > 0
    # Keypad's batches have the same shapes every step: nothing new after the first.
    assert [r["compile/count"] for r in later] == [0.0] * len(later), later


def test_the_config_field_moves_the_cache(runs):
  # The cold run's config named the cache: it was filled there, and JAX's variable, which
  # named another directory, was overridden.
  assert runs["saved"] and not runs["elsewhere"].exists()


def test_an_empty_cache_dir_turns_the_cache_off(runs, tmp_path):
  cache, before = runs["cache"], sorted(os.listdir(runs["cache"]))

  def evaluate(*overrides):
    run_cli("agentgym_jax.evaluate", [
        f"--config={CONFIG}", f"--checkpoint={runs['root'] / 'cold'}", "--num_tasks=2",
        f"--output={tmp_path / 'report'}", *overrides], cache)

  # The evaluation's batches have other shapes than training's: programs the cache lacks.
  evaluate("--config.compile.cache_dir=")
  assert sorted(os.listdir(cache)) == before
  evaluate()  # the default, JAX_COMPILATION_CACHE_DIR: saved there now
  assert set(before) < set(os.listdir(cache))


def test_the_default_cache_is_jaxs_variable_or_the_users_cache_dir(monkeypatch, tmp_path):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert base.base_config().compile.cache_dir == str(tmp_path / "agentgym_jax" / "jax_compile")
  assert caches.user_cache_dir("demonstrations") == str(tmp_path / "agentgym_jax" /
                                                        "demonstrations")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "gs://bucket/cache")
  assert base.base_config().compile.cache_dir == "gs://bucket/cache"


def test_an_unwritable_cache_dir_stops_the_command_with_one_line(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  result = subprocess.run(
      [sys.executable, "-m", "agentgym_jax.train", f"--config={CONFIG}",
       f"--workdir={tmp_path / 'run'}", f"--config.compile.cache_dir={blocker / 'cache'}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1 and "Traceback" not in result.stderr
  line = result.stderr.strip().splitlines()[-1]
  assert line.startswith("FATAL: config.compile.cache_dir: cannot create") and "--config" in line
  assert not (tmp_path / "run").exists()


def test_programs_released_before_each_update_are_reloaded_and_train_the_same(runs):
  # compile.max_resident_gib=1e-6 (1 KiB): every step drops its programs between its batch and
  # its update; the next step loads them back from the cache. The run trains the same as one keeping them.
  released = train(runs["root"] / "released", runs["cache"], "--config.compile.max_resident_gib=1e-6")
  kept = runs["warm"]
  for r in released[1:]:
    assert r["compile/count"] > 0 and r["compile/cache_hits"] == r["compile/count"], r
  for a, b in zip(released, kept):
    for key in b:
      if not key.startswith(("time/", "compile/", "rollout/tokens_per_s", "update/tokens_per_s",
                             "rollout/env_seconds")):
        assert a[key] == b[key], key
