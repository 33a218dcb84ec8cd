"""Estimator options as data: `algo.estimator_kwargs` reaches the estimator, from an experiment
file or the command line, for the built-in estimators and for one registered by a test alone;
a misspelt option stops the run with one line naming the estimator's options."""

import json
import logging
import os
import pathlib
import signal
import subprocess
import sys

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from absl import flags
from absl import logging as absl_logging

from agentgym_jax import settings as settings_lib
from agentgym_jax import cli
from agentgym_jax.rl import advantages
from agentgym_jax.rl.algorithm import AlgorithmSpec, make_advantage_fn
from agentgym_jax.rl.registry import Registry
from agentgym_jax.train import config as base

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = "experiments/keypad/learn.py:runlocal"
GIGPO_TYPO = ("algo.estimator_kwargs has 'step_wieght', which gigpo does not take; its options: "
              "['step_norm', 'step_weight']")


def _spec(estimator, **kwargs) -> AlgorithmSpec:
  c = base.base_config()
  c.algo.estimator, c.algo.kl_coef = estimator, 0.0
  c.algo.estimator_kwargs = ml_collections.ConfigDict(kwargs)
  return settings_lib.algorithm(base.lock(c))


def _parse(*overrides, config=f"{CONFIG},algo=gigpo"):
  """The config the trainer's --config flag (cli.define_config_flag) gives for `overrides`."""
  argv = ["prog", f"--config={config}", *overrides]
  flag_values = flags.FlagValues()
  cli.define_config_flag("config", flag_values=flag_values, sys_argv=argv)
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    flag_values(argv)
    return flag_values.config
  finally:
    os.chdir(cwd)


# ----- one batch, for the built-in estimators -----------------------------------------------

# Two tasks x two samples, two turns each: [prompt | turn 0 | observation | turn 1 | pad].
MASK = jnp.array([[0, 1, 1, 0, 1, 0]] * 4, jnp.float32)
STEP_REWARDS = jnp.array([[0, 0, 0.3, 0, 1.0, 0], [0, 0, 0.0, 0, 0.0, 0],
                          [0, 0, 0.3, 0, 0.0, 0], [0, 0, 0.0, 0, 1.0, 0]], jnp.float32)
TURNS = advantages.Turns(index=jnp.array([[-1, 0, 0, 0, 1, 1]] * 4),
                         rewards=STEP_REWARDS,
                         anchors=jnp.array([[0, 1], [0, 2], [0, 1], [0, 2]]))
GROUPS = jnp.array([0, 0, 1, 1])
VALUES = jnp.array(np.random.default_rng(0).normal(size=MASK.shape), jnp.float32)


def _assembled(spec):
  zeros = jnp.zeros_like(MASK)
  return make_advantage_fn(spec)(STEP_REWARDS, MASK, GROUPS, zeros, zeros, VALUES, TURNS)[0]


def _direct(name, **options):
  return advantages.ESTIMATORS[name](STEP_REWARDS, MASK, values=VALUES, group_ids=GROUPS,
                                     turns=TURNS, **options)[0]


@pytest.mark.parametrize("name, options", [
    ("gigpo", {"step_weight": 0.5, "step_norm": "mean_std_norm"}),
    ("turn_gae", {"turn_gamma": 0.5}),
])
def test_builtin_options_reach_the_estimator(name, options):
  spec = _spec(name, **options)
  assert spec.estimator_options == tuple(sorted(options.items()))
  hash(spec)  # static in the jitted update: a string option included
  got = _assembled(spec)
  np.testing.assert_allclose(got, _direct(name, **options), rtol=1e-5, atol=1e-6)
  # The options matter on this batch: the estimator's defaults give other advantages.
  assert not np.allclose(got, _direct(name), atol=1e-4)
  # No options: the estimator's own defaults.
  np.testing.assert_allclose(_assembled(_spec(name)), _direct(name), rtol=1e-5, atol=1e-6)


def test_drgrpo_is_its_own_estimator():
  spec = _spec("drgrpo")
  assert spec.estimator == "drgrpo" and spec.estimator_options == ()
  got = _assembled(spec)
  np.testing.assert_allclose(got, _direct("drgrpo"), rtol=1e-6)
  assert not np.allclose(got, _direct("grpo"), atol=1e-4)  # the std division is gone


def test_traits_come_from_the_registration():
  assert [n for n in sorted(advantages.ESTIMATORS)
          if advantages.ESTIMATORS.traits(n)["uses_critic"]] == ["gae", "turn_gae"]
  assert [n for n in sorted(advantages.ESTIMATORS)
          if advantages.ESTIMATORS.traits(n)["uses_turns"]] == ["gigpo", "turn_gae"]
  assert advantages.options("gigpo") == {"step_weight": 1.0, "step_norm": "mean_norm"}
  assert advantages.options("turn_gae") == {"turn_gamma": 1.0}
  assert advantages.options("grpo") == {}
  registry = Registry("thing", needs_x=False)
  with pytest.raises(ValueError, match=r"traits \['needs_y'\] are not among"):
    registry.register("a", needs_y=True)


# ----- bad options: one line ------------------------------------------------------------------


def test_misspelt_option_fails_at_the_spec_with_one_line():
  with pytest.raises(ValueError) as error:
    _spec("gigpo", step_wieght=0.5)
  assert str(error.value) == GIGPO_TYPO
  with pytest.raises(ValueError, match=r"^algo.estimator_kwargs has 'turn_gamma', which grpo "
                                       r"does not take; its options: \[\]$"):
    _spec("grpo", turn_gamma=0.9)
  with pytest.raises(ValueError, match=r"^algo.estimator_kwargs.step_norm 'std' is not one of "
                                       r"\['mean_norm', 'mean_std_norm'\] \(gigpo's choices\)\.$"):
    _spec("gigpo", step_norm="std")


def test_misspelt_option_fails_on_the_command_line_with_one_line(tmp_path):
  workdir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  result = subprocess.run(
      [sys.executable, "-m", "agentgym_jax.train", f"--config={CONFIG},algo=gigpo",
       f"--workdir={workdir}", "--config.algo.estimator_kwargs.step_wieght=0.5"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 1
  assert [line for line in result.stderr.splitlines() if line.strip()] == [
      f"FATAL: {GIGPO_TYPO}"], result.stderr[-2000:]
  assert not workdir.exists()


# ----- the command line -----------------------------------------------------------------------


def test_command_line_sets_options_one_by_one_or_as_a_dict():
  one = _parse("--config.algo.estimator_kwargs.step_weight=0.5",
               "--config.algo.estimator_kwargs.step_norm=mean_std_norm")
  whole = _parse("--config.algo.estimator_kwargs={'step_weight': 0.5, "
                 "'step_norm': 'mean_std_norm'}")
  for config in (one, whole):
    assert config.algo.estimator_kwargs.to_dict() == {"step_weight": 0.5,
                                                      "step_norm": "mean_std_norm"}
    assert settings_lib.algorithm(config).estimator_options == (
        ("step_norm", "mean_std_norm"), ("step_weight", 0.5))
  # Everything else stays locked: a misspelt or removed field is still an error.
  for bad in ("--config.algo.step_weight=0.5", "--config.optim.lrr=1.0",
              "--config.nonexistent.x=1"):
    with pytest.raises((AttributeError, KeyError)):
      _parse(bad)


def test_lock_leaves_only_the_estimator_options_open():
  c = base.base_config()
  c.algo.estimator_kwargs.anything = 1  # checked against the estimator later, not the schema
  c = base.lock(c)
  assert c.is_locked and c.algo.is_locked and not c.algo.estimator_kwargs.is_locked
  c.algo.estimator_kwargs.more = 2
  with pytest.raises(AttributeError):
    c.algo.step_weight = 1.0
  bad = base.base_config()
  bad.algo.step_weight = 1.0
  with pytest.raises(ValueError, match=r"\['algo.step_weight'\]"):
    base.lock(bad)


# ----- a new estimator, registered by this file alone, through the trainer's command line -----


@pytest.fixture
def toy_bonus():
  """Registers "toy_bonus" (every agent token's advantage is its option `bonus`) for one test;
  yields the bonuses it is traced with."""
  traced = []

  @advantages.ESTIMATORS.register("toy_bonus")
  def toy(rewards, mask, *, values=None, group_ids=None, gamma=1.0, lam=1.0, eps=1e-6,
          turns=None, bonus=0.0):
    traced.append(bonus)
    adv = jnp.where(jnp.asarray(mask) > 0, bonus, 0.0).astype(jnp.asarray(rewards).dtype)
    return adv, adv

  try:
    yield traced
  finally:
    advantages.ESTIMATORS.unregister("toy_bonus")


@pytest.fixture
def train_in_process(monkeypatch):
  """Runs the trainer's command line (`python -m agentgym_jax.train ARGS`) in this process, so
  it sees estimators this test registered; undoes what the command changes process-wide."""
  from agentgym_jax.train import __main__ as train_main  # pylint: disable=import-outside-toplevel
  root = logging.getLogger()
  handlers, level = list(root.handlers), root.level
  absl_level = absl_logging.get_absl_handler().level
  sigterm = signal.getsignal(signal.SIGTERM)
  monkeypatch.chdir(ROOT)

  def forget_overrides():
    # config_flags defines a flag per --config.x=v it parses; a second parse would define them
    # again.
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:
      delattr(flags.FLAGS, name)

  def run(*args):
    argv = ["agentgym_jax.train", *args]
    monkeypatch.setattr(sys, "argv", argv)  # config_flags reads --config.x=v from sys.argv
    forget_overrides()
    train_main.main(cli.parse_flags(argv))

  try:
    yield run
  finally:
    signal.signal(signal.SIGTERM, sigterm)
    for handler in root.handlers[len(handlers):]:
      root.removeHandler(handler)
      handler.close()
    root.setLevel(level)
    absl_logging.get_absl_handler().setLevel(absl_level)
    forget_overrides()
    flags.FLAGS.unparse_flags()


def test_a_registered_estimator_trains_with_its_option_from_the_command_line(
    toy_bonus, train_in_process, tmp_path):
  workdir = tmp_path / "run"
  common = [f"--config={CONFIG}", f"--workdir={workdir}", "--config.algo.estimator=toy_bonus"]
  with pytest.raises(SystemExit) as stop:
    train_in_process(*common, "--config.algo.estimator_kwargs.bonu=0.5")
  assert str(stop.value) == ("FATAL: algo.estimator_kwargs has 'bonu', which toy_bonus does "
                             "not take; its options: ['bonus']")
  assert not workdir.exists()

  train_in_process(*common, "--config.algo.estimator_kwargs.bonus=0.5",
                   "--config.total_steps=1", "--config.eval.every_steps=0",
                   "--config.log.progress_bar=False", "--config.checkpoint.export_hf=False",
                   "--config.log.trajectories_every=0")
  assert toy_bonus and set(toy_bonus) == {0.5}
  with open(workdir / "config.json") as f:
    algo = json.load(f)["algo"]
  assert algo["estimator"] == "toy_bonus" and algo["estimator_kwargs"] == {"bonus": 0.5}
  with open(workdir / "metrics.jsonl") as f:
    (line,) = [json.loads(text) for text in f]
  assert line["step"] == 1
  assert line["batch/advantage_mean"] == pytest.approx(0.5)
  assert line["batch/advantage_std"] == pytest.approx(0.0, abs=1e-6)
