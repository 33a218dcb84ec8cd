r"""Turn-level credit: a randomly initialised tiny model learns a two-digit lock, a digit a turn.

`keypad` with the code 37 for every task (environments/keypad): each turn enters one digit,
the right next digit adds 1 / (2 * (1 + wrong replies so far)) to the reward, a wrong one
changes nothing, and the lock opens at the second right digit, within 6 turns. Why turn-level
credit matters here: an episode is several decisions of different worth (a right digit, two
wrong ones, another right one), and which digit is right depends on what is entered, so "3"
must be raised at the start and lowered after it. A trajectory-level estimator (GRPO) gives
every turn of an episode the episode's advantage: an episode that entered "3" and then repeated
it outscores one that entered nothing, so the repeats are raised with the first "3". GiGPO
compares the turns that acted from the same entry state (the env's `state_key`) across the
group; turn-level GAE reads a critic at each turn. A random model finds the first digit in a
few percent of turns and the second only after it.

  for algo in grpo gigpo ppo turn_ppo; do for seed in 0 1 2; do
    python -m agentgym_jax.train --config=experiments/keypad/credit.py:algo=$algo,seed=$seed \
        --workdir=/tmp/keypad_credit/${algo}_s$seed
  done; done
  python experiments/keypad/plot_credit.py --root=/tmp/keypad_credit --out=experiments/keypad

Config arguments: `algo` (any of agentgym_jax.rl.algorithm.ALGORITHMS), `seed`, `runlocal`.

Expected (experiments/keypad/README.md has the measured table): training success under 0.05 at
step 1 for every estimator; the steps to open the lock in 90% of training episodes and the
held-out success after 60 steps (sampled) are what the table compares.
"""

from __future__ import annotations

import ml_collections

from agentgym_jax.train import config as base
from experiments.keypad import learn


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """learn.py (model, rollout, optimizer) with the two-digit lock; only the changes here."""
  args = base.parse_arg(arg, algo="grpo", seed=0, runlocal=False)
  c = learn.get_config(f"algo={args.algo}" + (",runlocal" if args.runlocal else ""))
  c.seed = args.seed
  c.env.kwargs = ml_collections.ConfigDict({"code": "37", "max_steps": 6})
  c.schedule.horizons = (6,)
  # Six turns of instruction-free chat need more than learn.py's 256 positions.
  c.model.arch.max_position_embeddings = c.rollout.max_context = 512
  if not args.runlocal:
    c.total_steps = 60
    c.eval.every_steps = 10
    c.checkpoint.every_steps = 30
  # Held-out success as AgentGym-RL measures it: sampled at temperature 1, 4 samples per task.
  c.eval.temperature, c.eval.group_size = 1.0, 4
  # A turn's return is its own digit's reward plus the discounted later ones, so GiGPO's step
  # groups rank a right digit above a wrong one from the same entry state; the std division
  # puts those step advantages on the episode level's scale. turn_gae discounts between turns.
  if args.algo == "gigpo":
    c.algo.gamma, c.algo.estimator_kwargs.step_norm = 0.9, "mean_std_norm"
  elif args.algo == "turn_ppo":
    c.algo.estimator_kwargs.turn_gamma = 0.9
  return c
