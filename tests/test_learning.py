"""Learning checks: every estimator trains a random tiny model from < 20% to > 90% success on
keypad; the turn-level estimators open keypad's two-digit lock; on BabyAI, behaviour cloning
lifts held-out success and RL from it is checked against it (experiments/tiny).

experiments/keypad/learn.py: `keypad` with one code for all tasks, found only by exploring;
a 2-layer random model, 8 tasks x 8 samples per step, 24 steps. A sign error, a misaligned
log-prob, a loss on observation tokens or a broken estimator keeps success near its random
level. Each algorithm runs through the command line (one CPU device) and takes one to a few
minutes, so the file is marked slow:

  .venv/bin/pytest tests/test_learning.py -m slow -q -s
"""

import json
import os
import time

import pytest

from test_trainer import metrics, run_cli

ALGOS = ("grpo", "ppo", "reinforce_pp", "rloo", "gigpo", "turn_ppo")


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  # Shared by the runs: grpo, reinforce_pp and rloo compile the same update and rollout.
  return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.mark.slow
@pytest.mark.parametrize("algo", ALGOS)
def test_estimator_learns_keypad_from_scratch(algo, tmp_path, compile_cache):
  start = time.perf_counter()
  result = run_cli("agentgym_jax.train", [
      f"--config=experiments/keypad/learn.py:algo={algo}", f"--workdir={tmp_path}",
      "--config.log.progress_bar=False", "--config.checkpoint.export_hf=False"],
      compile_cache, timeout=1200)
  seconds = time.perf_counter() - start
  assert result.returncode == 0, result.stderr[-3000:]
  lines = metrics(str(tmp_path))
  success = [m["episodes/success_rate"] for m in lines if "episodes/success_rate" in m]
  print(f"\n{algo}: {seconds:.0f} s, success by step {[round(s, 2) for s in success]}, "
        f"held-out greedy {lines[-1]['eval/success_rate']}")
  with open(os.path.join(tmp_path, "config.json")) as f:
    assert json.load(f)["algo"]["estimator"] == {
        "grpo": "grpo", "ppo": "gae", "reinforce_pp": "reinforce_plus_plus", "rloo": "rloo",
        "gigpo": "gigpo", "turn_ppo": "turn_gae"}[algo]
  assert success[0] < 0.2, success
  assert sum(success[-3:]) / 3 > 0.9, success
  assert lines[-1]["eval/success_rate"] > 0.9


# experiments/keypad/credit.py: the two-digit lock, where the right digit depends on what is
# entered. GRPO's episode-level credit raises the first digit everywhere and never opens it
# (experiments/keypad/README.md); the turn-level estimators must.
CREDIT_ALGOS, CREDIT_OPENED = ("gigpo", "turn_ppo"), 0.8


@pytest.mark.slow
@pytest.mark.parametrize("algo", CREDIT_ALGOS)
def test_turn_level_credit_opens_the_two_digit_lock(algo, tmp_path, compile_cache):
  result = run_cli("agentgym_jax.train", [
      f"--config=experiments/keypad/credit.py:algo={algo}", f"--workdir={tmp_path}",
      "--config.log.progress_bar=False", "--config.checkpoint.export_hf=False"],
      compile_cache, timeout=1800)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = metrics(str(tmp_path))
  success = [m["episodes/success_rate"] for m in lines if "episodes/success_rate" in m]
  held_out = [m["eval/success_rate"] for m in lines if "eval/success_rate" in m]
  print(f"\n{algo}: training success {[round(s, 2) for s in success]}, held-out {held_out}")
  assert success[0] < 0.1, success
  assert sum(success[-5:]) / 5 > CREDIT_OPENED, success
  assert held_out[-1] > CREDIT_OPENED, held_out


# The study's own run lengths (experiments/tiny/babyai.py). RL from the 24-step BC policy raises
# held-out success per sample at temperature 1 (AgentGym-RL's evaluation; 8.3% -> 36.9% for
# GRPO in experiments/tiny/README.md) while greedy success falls (76.7% -> 37.8%, reported
# there as the study's open problem), so the RL check is on the sampled metric.
BC_STEPS, RL_STEPS, BC_LIFT, RL_GAIN = 24, 20, 0.25, 0.15


@pytest.mark.slow
def test_bc_then_grpo_on_babyai(tmp_path, compile_cache):
  """experiments/tiny/babyai.py end to end (about 25 minutes on a quiet 2-core machine): BC
  lifts greedy held-out success over the untrained model by BC_LIFT, and GRPO from the BC
  checkpoint raises held-out success per sample at temperature 1 (4 samples per test task,
  before the first RL step and after the last) by RL_GAIN."""
  bc, rl = str(tmp_path / "bc"), str(tmp_path / "grpo")
  for workdir, args, steps in ((bc, "stage=bc", BC_STEPS),
                               (rl, f"stage=rl,algo=grpo,init={bc},eval=sampled", RL_STEPS)):
    result = run_cli("agentgym_jax.train", [
        f"--config=experiments/tiny/babyai.py:{args}", f"--workdir={workdir}",
        "--config.log.progress_bar=False", "--config.checkpoint.export_hf=False",
        f"--config.total_steps={steps}", f"--config.eval.every_steps={steps}"],
        compile_cache, timeout=3600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Held-out success" in result.stdout
  untrained, after_bc = [m["eval/success_rate"] for m in metrics(bc) if "eval/success_rate" in m]
  before_rl, after_rl = [m["eval/success_rate"] for m in metrics(rl) if "eval/success_rate" in m]
  print(f"\nheld-out: greedy untrained {untrained}, BC {after_bc}; per sample at temperature 1 "
        f"BC {before_rl}, GRPO {after_rl}")
  assert after_bc >= untrained + BC_LIFT
  assert after_rl >= before_rl + RL_GAIN
