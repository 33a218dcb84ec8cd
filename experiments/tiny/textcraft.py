r"""Tiny-model study on TextCraft: behaviour cloning from a noisy planner, then RL, on 2 CPUs.

The depth-1 goals (`env.categories = ("depth1",)`: 94 train goals, 31 held-out test goals): the
agent must find the goal's line among the listed crafting commands, "get" its ingredients and
"craft" it, copying item names and counts from the list. (The fifth round cloned all 374 train
goals of depths 1-4 for 80 steps and stayed at 0.0% held-out; experiments/tiny/README.md.)

  python -m agentgym_jax.train --config=experiments/tiny/textcraft.py:stage=bc \
      --workdir=/tmp/tiny/textcraft/bc
  python -m agentgym_jax.train \
      --config=experiments/tiny/textcraft.py:stage=bc_more,init=/tmp/tiny/textcraft/bc \
      --workdir=/tmp/tiny/textcraft/bc_more
  python -m agentgym_jax.train \
      --config=experiments/tiny/textcraft.py:stage=rl,algo=grpo,init=/tmp/tiny/textcraft/bc_more \
      --workdir=/tmp/tiny/textcraft/grpo

Expected (seed 0, experiments/tiny/README.md, "Sixth round"): held-out greedy 0.0% after BC,
3.2% after bc_more (55% of the train goals), 0.0% after 20 steps of GRPO or PPO from it.
"""

from experiments.tiny import common
from agentgym_jax.train import config as base

SETTING = common.EnvSetting(
    env="textcraft", env_kwargs={}, turns=6, short=3, long=10, max_reply_tokens=40,
    max_context=2048, bc_steps=64, bc_more_steps=64, rl_steps=20, bc_noise=0.3,
    categories=("depth1",))


def get_config(arg=None):
  args = common.parse(arg)
  return base.lock(common.study_config(args, SETTING))
