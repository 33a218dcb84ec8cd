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
  # the smoke run of any stage: append ,runlocal

Config arguments: common.py (stage, algo, init, seed, runlocal).
"""

from __future__ import annotations

from experiments.smollm2 import common

SETTING = common.EnvSetting(
    env="textcraft", env_kwargs={},
    # The expert needs 2-3 turns for a depth-1 goal and 3-10 for a depth-2 one.
    turns=10, max_reply_tokens=48,
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
