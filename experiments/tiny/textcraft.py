r"""Tiny-model study on TextCraft: behaviour cloning from a noisy planner, then RL, on 2 CPUs.

All 374 train goals (crafting depth 1-4) and the 100 held-out test goals. The agent must copy
the right "get"/"craft" commands from the listed crafting commands in the right order.

  python -m agentgym_jax.train --config=experiments/tiny/textcraft.py:stage=bc \
      --workdir=/tmp/tiny/textcraft/bc
  python -m agentgym_jax.train \
      --config=experiments/tiny/textcraft.py:stage=rl,algo=grpo,init=/tmp/tiny/textcraft/bc \
      --workdir=/tmp/tiny/textcraft/grpo

Expected (seed 0, experiments/tiny/README.md): greedy held-out success 0.0% after the 32 BC
steps and after 48 more (`stage=bc_more --config.total_steps=48`): the policy writes the action
format and the goal's name, not the listed ingredients, so RL from it has no signal.
"""

from experiments.tiny import common
from agentgym_jax.train import config as base

SETTING = common.EnvSetting(
    env="textcraft", env_kwargs={}, turns=10, short=5, long=15, max_reply_tokens=40,
    max_context=2048, bc_steps=32, bc_more_steps=24, rl_steps=20, bc_noise=0.3)


def get_config(arg=None):
  args = common.parse(arg)
  return base.lock(common.study_config(args, SETTING))
