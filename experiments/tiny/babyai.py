r"""Tiny-model study on BabyAI: behaviour cloning from a noisy expert, then RL, on 2 CPU cores.

Levels: the three red-ball levels below (task ids cycle over them, so the 810 train and 90 test
ids stay distinct tasks): go to the red ball, among grey distractors or other objects, in a
room where it may be out of sight. The agent must answer "go to red ball 1" when the ball is
listed and otherwise turn or move to find it; the expert (minigrid's BabyAIBot) does both.
(A first try with four GoTo/Pickup levels, where the agent must copy the goal's object into
the action, left this model answering "go to red ball 1" everywhere after 40 BC steps: copying
from the goal needs more training than this study's budget.)

  # 1. BC warm start (about 7 minutes on a quiet 2-core machine), then optionally a second
  #    BC cycle from it:
  python -m agentgym_jax.train --config=experiments/tiny/babyai.py:stage=bc \
      --workdir=/tmp/tiny/babyai/bc
  python -m agentgym_jax.train \
      --config=experiments/tiny/babyai.py:stage=bc_more,init=/tmp/tiny/babyai/bc \
      --workdir=/tmp/tiny/babyai/bc_more
  # 2. RL from it, one run per algorithm (and horizon=short|long|scaling_inter for the
  #    horizon study; eval=sampled evaluates at temperature 1, 4 samples per task, as
  #    AgentGym-RL's scripts do, instead of greedily):
  python -m agentgym_jax.train \
      --config=experiments/tiny/babyai.py:stage=rl,algo=grpo,init=/tmp/tiny/babyai/bc \
      --workdir=/tmp/tiny/babyai/grpo
  # 3. Tables and curves: experiments/tiny/run_study.sh runs all of it; plot.py draws it.

Expected (seed 0; experiments/tiny/README.md has every number): after the 24-step BC, greedy
held-out success 76.7% and 8.3% per sample at temperature 1; GRPO from it 36.9% per sample
(+28.6 points) while greedy success falls to 37.8%; PPO and RLOO alike. With eval=sampled the
GRPO run prints 0.081 -> 0.336 (seventh round).
"""

from experiments.tiny import common
from agentgym_jax.train import config as base

LEVELS = ("GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists")
SETTING = common.EnvSetting(
    env="babyai", env_kwargs={"levels": LEVELS}, turns=6, short=2, long=10,
    max_reply_tokens=32, max_context=2048, bc_steps=24, bc_more_steps=24, rl_steps=20,
    bc_noise=0.3)


def get_config(arg=None):
  args = common.parse(arg)
  return base.lock(common.study_config(args, SETTING))
