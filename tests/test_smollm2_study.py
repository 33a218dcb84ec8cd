"""The SmolLM2 study (experiments/smollm2): its configs, its bad-input check, its RL stage.

The fast tests build every stage's config and run the trainer on a missing starting
checkpoint; the slow one reruns a shortened RL stage from the study's recipe (BC, then GRPO)
and checks what the study's results support (experiments/smollm2/README.md).
"""

from __future__ import annotations

import pytest

from test_trainer import metrics, run_cli

CONFIG = "experiments/smollm2/babyai.py"


@pytest.mark.parametrize("arg", ["stage=zero_shot", "stage=bc", "stage=rl,init=/tmp/bc",
                                 "stage=rl,init=/tmp/bc,algo=ppo,seed=1",
                                 "stage=bc,runlocal", "stage=rl,init=/tmp/bc,runlocal"])
def test_study_configs_build_and_lock(arg):
  from experiments.smollm2 import babyai  # pylint: disable=import-outside-toplevel
  c = babyai.get_config(arg)
  assert c.is_locked
  assert c.model.source == "smollm2" and c.env.name == "babyai"
  assert tuple(c.env.kwargs.levels) == babyai.LEVELS
  if "stage=rl" in arg:
    assert c.init_from == "/tmp/bc" and c.mode == "rl"
    assert c.algo.estimator == ("gae" if "algo=ppo" in arg else "drgrpo")  # grpo: Dr.GRPO
    assert c.algo.clip_high == 0.28 and c.algo.kl_coef > 0
  if "stage=bc" in arg:
    assert c.mode == "bc" and c.bc.num_tasks > 0
  with pytest.raises(AttributeError):
    c.not_a_field = 1


@pytest.mark.parametrize("arg", ["stage=rl", "stage=sft", "stage=rl,init=/x,algo=dpo",
                                 "stage=bc,lr=1"])
def test_study_config_rejects_bad_arguments(arg):
  from experiments.smollm2 import babyai  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError):
    babyai.get_config(arg)


def test_missing_init_checkpoint_stops_at_start_naming_it(tmp_path):
  missing = str(tmp_path / "no_bc_run")
  result = run_cli("agentgym_jax.train", [
      f"--config={CONFIG}:stage=rl,init={missing},runlocal", f"--workdir={tmp_path / 'rl'}"],
      str(tmp_path / "cache"), timeout=600)
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("FATAL: init_from=") and missing in last, last
  assert "Traceback" not in result.stderr, result.stderr[-2000:]  # one line, not a traceback


# The shortened RL stage: the committed BC stage, then GRPO with the committed RL recipe for
# RL_STEPS steps, greedy held-out on the first EVAL_TASKS test tasks. The study's runs
# (README.md, 2026-12-05) printed, on these 16 tasks: zero-shot 0/16, BC 6/16 (0.375), Dr.GRPO
# (run 2, this recipe) 6/16 at steps 4 and 8, with the KL to BC at most 0.013 per token (run 1,
# at lr 2e-5: 5/16 after 2 steps, KL 0.0345). The goal (+15 points greedy from RL) was
# missed, so this asserts what held: BC lifts zero-shot by BC_LIFT, and the GRPO steps keep
# greedy success within RL_DROP of BC with the KL to BC below MAX_KL. Not a gain.
RL_STEPS, EVAL_TASKS = 2, 16
BC_LIFT, RL_DROP, MAX_KL = 0.25, 0.2, 0.1


@pytest.mark.slow
def test_smollm2_grpo_from_bc_on_babyai(tmp_path):
  """experiments/smollm2/babyai.py's BC stage, then 2 GRPO steps (in the study, BC's 8 steps
  and a 48-task evaluation took 14.5 min on a shared 2-core machine, a GRPO step 3-4 min on a
  quiet one): BC teaches SmolLM2 the action format (greedy held-out success above zero-shot's
  by BC_LIFT), and the GRPO steps keep it (within RL_DROP) at a bounded KL. What it asserts
  is what the study's results support (see the margins above): no RL gain."""
  cache = str(tmp_path / "cache")
  bc, rl = str(tmp_path / "bc"), str(tmp_path / "grpo")
  for workdir, args in ((bc, "stage=bc"), (rl, f"stage=rl,init={bc}")):
    result = run_cli("agentgym_jax.train", [
        f"--config={CONFIG}:{args}", f"--workdir={workdir}",
        f"--config.eval.num_tasks={EVAL_TASKS}",
        *([f"--config.total_steps={RL_STEPS}", f"--config.eval.every_steps={RL_STEPS}"]
          if "rl" in args else [])], cache, timeout=5400)
    assert result.returncode == 0, result.stderr[-3000:]
  zero_shot, after_bc = [m["eval/success_rate"] for m in metrics(bc) if "eval/success_rate" in m]
  rl_metrics = metrics(rl)
  # The RL stage does not evaluate its start (eval.at_start=False): greedy on the same tasks,
  # it is the BC run's last evaluation.
  (after_rl,) = [m["eval/success_rate"] for m in rl_metrics if "eval/success_rate" in m]
  print(f"\nheld-out greedy: zero-shot {zero_shot}, BC {after_bc}, GRPO {after_rl}")
  assert zero_shot == 0.0
  assert after_bc >= zero_shot + BC_LIFT
  assert after_rl >= after_bc - RL_DROP
  kls = [m["actor/kl"] for m in rl_metrics if "actor/kl" in m]
  assert len(kls) == RL_STEPS and max(kls) < MAX_KL
