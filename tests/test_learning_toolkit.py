"""The keypad learning check (tests/test_learning.py) with each RL-toolkit option on: truncated
importance sampling, overlong filtering, overlong penalty, dynamic sampling (GRPO; one to a few
minutes each on a CPU, so marked slow):

  .venv/bin/pytest tests/test_learning_toolkit.py -m slow -q -s

Keypad's failed episodes end at its 3-step limit (truncated, not terminated), so the overlong
options act on every failure: filtered, GRPO trains on the successes alone; penalised, a
failure's reward is -penalty.
"""

import pytest

from test_learning import compile_cache  # pylint: disable=unused-import
from test_trainer import metrics, run_cli

OPTIONS = {
    "tis": ["--config.algo.tis_cap=2.0"],
    "overlong_filter": ["--config.algo.overlong=filter"],
    "overlong_penalty": ["--config.algo.overlong=penalty", "--config.algo.overlong_penalty=0.5"],
    "dynamic_sampling": ["--config.algo.dynamic_sampling=True",
                         "--config.algo.dynamic_sampling_max_rounds=2"],
}
# The metric that shows each option acting.
ACTING = {"tis": "actor/tis_weight", "overlong_filter": "overlong/filtered",
          "overlong_penalty": "overlong/penalised",
          "dynamic_sampling": "dynamic_sampling/extra_rollouts"}


@pytest.mark.slow
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_grpo_learns_keypad_with_the_option_on(option, tmp_path, compile_cache):
  result = run_cli("agentgym_jax.train", [
      "--config=experiments/keypad/learn.py:algo=grpo", f"--workdir={tmp_path}",
      "--config.log.progress_bar=False", "--config.checkpoint.export_hf=False",
      *OPTIONS[option]], compile_cache, timeout=1200)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = metrics(str(tmp_path))
  steps = [m for m in lines if "episodes/success_rate" in m]
  # Dynamic sampling trains on the mixed groups: the policy's success is over all it drew.
  rate = ("dynamic_sampling/success_rate" if option == "dynamic_sampling"
          else "episodes/success_rate")
  success = [m[rate] for m in steps]
  acting = [round(m[ACTING[option]], 3) for m in steps]
  print(f"\n{option}: success by step {[round(s, 2) for s in success]}, {ACTING[option]} "
        f"{acting}, held-out greedy {lines[-1]['eval/success_rate']}")
  assert all("rollout/logprob_gap_max" in m for m in steps)
  assert max(acting) > 0  # the option acted
  assert sum(success[-3:]) / 3 > 0.9, success
  assert lines[-1]["eval/success_rate"] > 0.9
