r"""SmolLM2-135M-Instruct on TextCraft: zero-shot, a short BC that teaches the action format, GRPO.

The BabyAI study's stages and RL recipe (common.py; README.md here has the tables and curves)
on TextCraft's depth-1 and depth-2 goals: craft a Minecraft item from the crafting commands
the first observation lists, getting base items and crafting intermediates on the way.

  cfg=experiments/smollm2/textcraft.py
  # 1. zero-shot, AgentGym's prompt:
  python -m agentgym_jax.evaluate --config=$cfg:stage=zero_shot --output=/tmp/smollm2_tc/zero_shot
  # 2. BC on the expert's demonstrations (greedy held-out before and after, in the run):
  python -m agentgym_jax.train --config=$cfg:stage=bc --workdir=/tmp/smollm2_tc/bc
  # 3. RL from it (algo=grpo runs Dr.GRPO; greedy held-out three times in the run):
  python -m agentgym_jax.train --config=$cfg:stage=rl,init=/tmp/smollm2_tc/bc \
      --workdir=/tmp/smollm2_tc/grpo
  # sampled: T=1, 4 samples of each of the 31 depth-1 test goals:
  python -m agentgym_jax.evaluate --config=$cfg:stage=bc --checkpoint=/tmp/smollm2_tc/grpo \
      "--config.env.categories=('depth1',)" --temperature=1.0 --num_samples=4 \
      --output=/tmp/smollm2_tc/grpo/eval_t1_avg4_depth1
  # the smoke run of any stage: append ,runlocal

Config arguments: common.py (stage, algo, init, seed, runlocal).

Measured (2026-12-05, seed 0, 2 CPU cores; README.md has every number), held-out = the 72
depth-1 and depth-2 test goals, 10 turns, greedy:
  zero-shot 0.0% (the BC run's step-0 evaluation);
  stage=bc: "Held-out success 0.000 at step 0 -> 0.167 at step 8" (depth 1: 12/31, depth 2:
    0/41; 36-86 s per step);
  stage=rl (Dr.GRPO on depth-1 goals, rollouts at temperature 0.7): "Held-out success 0.194
    at step 4 -> 0.222 at step 12" (0.208 at step 8): +5.6 points over BC, depth 1 12/31 ->
    16/31 (5 goals gained, 1 lost), depth 2 still 0/41; 163-556 s per step, 58.5 minutes in
    all; actor/kl (to BC) at most 0.013.
  sampled at T=1, 4 samples x the 31 depth-1 goals: success per sample 10.5% -> 19.4%, Pass@4
    29.0% -> 48.4%; at T=0.7, one sample x 72 goals: 13.9% -> 20.8%.
"""

from __future__ import annotations

from experiments.smollm2 import common

SETTING = common.EnvSetting(
    env="textcraft", env_kwargs={},
    # The expert needs 2-3 turns for a depth-1 goal and 3-10 for a depth-2 one.
    turns=10, max_reply_tokens=48,
    # 10 turns of TextCraft's long crafting observations (AgentGym's episodes run to 4-12k
    # tokens): room for them, now that the update's memory grows linearly with the row.
    max_context=4096,
    # Held-out: all 72 depth-1 and depth-2 test goals (31 + 41).
    eval_tasks=0,
    # 16 depth-1 and 16 depth-2 train goals, taken in turn.
    bc_tasks=32, rl_steps=12, categories=("depth1", "depth2"),
    # RL trains on the depth-1 goals: BC solves none of the depth-2 test goals greedily, so
    # groups of depth-2 tasks (71% of the train goals) almost never hold a success to
    # reinforce. Held-out evaluation keeps both depths.
    rl_categories=("depth1",))


def get_config(arg=None):
  return common.study_config(common.parse(arg), SETTING)
