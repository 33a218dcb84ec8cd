r"""Keypad: a randomly initialised tiny model learns to open a lock, with every estimator.

The learning check of the trainer (tests/test_learning.py runs it). `keypad` shows a code
digit and rewards 1 / turn for replying with it within 3 turns (environments/keypad). Here
every task's code is 7, so the reward is found only by exploring: a random 2-layer model
replies with near-uniform tokens and succeeds in a few percent of episodes; the policy
gradient has to find the digit, credit it through the masks and raise its probability. A sign
error, a misaligned log-prob or a loss on observation tokens stops the rise.

  python -m agentgym_jax.train --config=experiments/keypad/learn.py:algo=grpo \
      --workdir=/tmp/keypad/grpo
  python -m agentgym_jax.train --config=experiments/keypad/learn.py:algo=ppo,runlocal \
      --workdir=/tmp/keypad/ppo_local

Config arguments: `algo` = grpo | ppo (GAE with a critic) | reinforce_pp | rloo | gigpo |
turn_ppo (GAE over turns, with a critic); `runlocal` = 2 steps of the same run (the CLI smoke
test), with a checkpoint each step.

Expected (2-core CPU, 1 device, 24 steps; experiments/keypad/README.md has the measured table):
training success 0.03-0.05 at step 1, >= 0.9 by step 13-16, held-out greedy success 1.0 on 32
test tasks; under a minute of CPU per algorithm once compiled, 1-6 minutes wall on a busy machine.
"""

from __future__ import annotations

import ml_collections

from agentgym_jax.rl.algorithm import ALGORITHMS
from agentgym_jax.train import config as base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = base.parse_arg(arg, algo="grpo", runlocal=False)
  if args.algo not in ALGORITHMS:
    raise ValueError(f"Config argument algo={args.algo!r} is not one of {list(ALGORITHMS)}.")
  # Only what differs from base_config() (agentgym_jax/train/config.py, every field commented)
  # is set here: seed 0, a random TINY_ARCH model, sampling at temperature 1, one plain PPO
  # epoch with clip 0.2, no whitening, greedy single-sample evaluation on the test split.
  c = base.base_config()
  c.total_steps = 24

  # ----- model: 2 layers, width 64, over a 300-id BPE vocabulary ---------------------------
  c.model.arch.max_position_embeddings = 256
  # ~40 merges over 256 bytes: digits stay single ids, so a random reply holds one often
  # enough for the reward to be found.
  c.tokenizer.spec = "bpe:300"

  # ----- environment: one code for every task, found by exploring -----------------------
  c.env.name = "keypad"
  c.env.kwargs = ml_collections.ConfigDict({"codes": "7", "max_steps": 3})
  c.env.num_workers = 1
  c.env.timeout_s = 30.0

  # ----- data and rollout: 8 tasks x 8 samples, 4-token replies ----------------------------
  c.data.batch_tasks = 8
  # Short replies: fewer random tokens share the credit of a success.
  c.rollout.max_reply_tokens = 4
  c.rollout.max_context = 256
  c.schedule.horizons = (3,)

  # ----- algorithm: on-policy, one update per batch, from scratch ---------------------------
  c.algo.estimator = ALGORITHMS[args.algo]
  # No KL, entropy or weight-decay terms: there is nothing to stay close to.
  c.update_from_flattened_dict(base.FROM_SCRATCH)
  c.algo.minibatches = 1

  # ----- optimizer: a tiny model needs a large step to move in tens of updates --------------
  c.optim.lr = 5e-3
  c.optim.critic_lr = 5e-3

  c.checkpoint.every_steps = 8
  c.checkpoint.keep = 2
  # Greedy held-out success after the last step.
  c.eval.every_steps = c.total_steps
  c.eval.num_tasks = 32

  if args.runlocal:
    c.update_from_flattened_dict(base.RUNLOCAL)
  return base.lock(c)
