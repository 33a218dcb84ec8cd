r"""SmolLM2-135M-Instruct on BabyAI and TextCraft in one run: each batch half of each.

AgentGym-RL trains one environment per run (its issue #4 asks for several). Here one policy
learns both: the study's stages and RL recipe (common.py) over a mixture of the BabyAI study's
levels (babyai.py) and TextCraft's depth-1 goals (textcraft.py's RL tasks), each environment
with its own turn limit (5 and 10 turns), task split and system prompt (none, as in the
single-environment runs). Every batch of 2 tasks x 4 samples holds one task of each
(`env.mix` ratios 0.5 / 0.5, `data.MixtureStream`); the metrics carry each environment's
share (`episodes/babyai/success_rate`, `eval/textcraft/success_rate`, ...) beside the pooled
ones, and held-out evaluation runs each environment's first 48 test tasks (TextCraft has 31
depth-1 test goals: all of them).

  cfg=experiments/smollm2/multienv.py
  # 1. BC on both experts' demonstrations (32 tasks of each, seen once; greedy held-out of
  #    both environments before and after):
  python -m agentgym_jax.train --config=$cfg:stage=bc --workdir=/tmp/smollm2_mix/bc
  # 2. Dr.GRPO from it, 24 steps (the BabyAI run's), greedy held-out at steps 8, 16 and 24:
  python -m agentgym_jax.train --config=$cfg:stage=rl,init=/tmp/smollm2_mix/bc \
      --workdir=/tmp/smollm2_mix/grpo
  # the smoke run of either stage: append ,runlocal (one step of one task of each environment)

To compare against the single-environment runs (babyai.py's 0.521 -> 0.708 on 48 BabyAI
tasks; textcraft.py's depth-1 goals 12/31 -> 16/31), read `eval/babyai/success_rate` and
`eval/textcraft/success_rate` in /tmp/smollm2_mix/grpo/metrics.jsonl, or the per-environment
columns of /tmp/smollm2_mix/grpo/eval/step_24/.

Config arguments: common.py (stage, algo, init, seed, runlocal).

Not measured yet: the study (BC about half an hour, RL about 2 hours on 2 CPU cores, judged
from the single-environment runs) has not been run.
"""

from __future__ import annotations

import dataclasses


from agentgym_jax.rollout import envs
from agentgym_jax.train import config as base
from experiments.smollm2 import babyai, common, textcraft

# The mixture's environments, each as in its single-environment run: levels and turn limit of
# babyai.py; TextCraft's depth-1 goals (the ones textcraft.py's RL trains on) and its limit.
MIX = {
    "babyai": envs.member("babyai", 0.5, kwargs=babyai.SETTING.env_kwargs,
                          max_turns=babyai.SETTING.turns),
    "textcraft": envs.member("textcraft", 0.5, categories=textcraft.SETTING.rl_categories,
                             max_turns=textcraft.SETTING.turns),
}

# What the study's stages take from the setting, for both environments at once: the longer
# turn limit and context (each environment's episodes stop at its own limit), the first 48
# test tasks of each, 32 demonstrations of each, the BabyAI run's 24 RL steps.
SETTING = dataclasses.replace(
    babyai.SETTING, env=envs.MIX, env_kwargs={}, turns=textcraft.SETTING.turns,
    max_context=textcraft.SETTING.max_context, eval_tasks=48)


def get_config(arg=None):
  args = common.parse(arg)
  c = common.study_config(args, SETTING)
  common.mix_environments(c, MIX, args.runlocal)
  return base.lock(c)
