"""What the SmolLM2 study shares: model, stages and the RL recipe.

Not an experiment itself: `babyai.py` and `textcraft.py` are. Each states its environment,
turn limit, held-out tasks and step counts in an `EnvSetting` and calls
`study_config(args, setting)`.

Config arguments (`--config=experiments/smollm2/<env>.py:k=v,...`):
  stage     "zero_shot" (the model as shipped; for `evaluate`) | "bc" (behaviour cloning from
            the expert) | "rl" (from the BC run given by init=DIR).
  algo      "grpo" | "ppo" | "reinforce_pp" | "rloo" | "gigpo" | "turn_ppo" (stage=rl);
            algo=grpo runs Dr.GRPO (group mean, no std division).
  init      the BC run's workdir (stage=rl).
  seed      run seed.
  lora      0 (full fine-tuning) | R: the RL stage trains LoRA adapters of rank R over the BC
            policy's frozen weights, at 10x the recipe's learning rate (as the paper configs'
            lora=R), the weights kept in float32 (XLA:CPU's fast path; the paper configs
            store them in bfloat16 to fit a TPU chip).
  runlocal  a smoke run of the stage: one step of two rows, 2 turns, 2 held-out tasks.
"""

from __future__ import annotations

import copy
import dataclasses

import ml_collections

from agentgym_jax.rl.algorithm import ALGORITHMS
from agentgym_jax.train import config as base
from experiments.agentgym_rl import common as agentgym_rl

STAGES = ("zero_shot", "bc", "rl")


@dataclasses.dataclass(frozen=True)
class EnvSetting:
  """One environment's row of the study."""

  env: str
  env_kwargs: dict
  turns: int  # turn limit of training and held-out evaluation.
  max_reply_tokens: int
  eval_tasks: int  # held-out: the first eval_tasks test tasks (0 = all of them).
  bc_tasks: int  # BC: the expert's episodes of this many train tasks, each seen once.
  rl_steps: int
  max_context: int = 1536  # tokens of an episode (rollout.max_context).
  categories: tuple[str, ...] = ()  # the task categories studied (config.env.categories).
  rl_categories: tuple[str, ...] = ()  # RL trains on these of them (empty: all).


def parse(arg: str | None) -> ml_collections.ConfigDict:
  args = base.parse_arg(arg, stage="zero_shot", algo="grpo", init="", seed=0, lora=0,
                        runlocal=False)
  if args.stage not in STAGES:
    raise ValueError(f"Config argument stage={args.stage!r} is not one of {list(STAGES)}.")
  if args.algo not in ALGORITHMS:
    raise ValueError(f"Config argument algo={args.algo!r} is not one of {list(ALGORITHMS)}.")
  if args.stage == "rl" and not args.init:
    raise ValueError("stage=rl starts from a BC run: add init=<the BC run's workdir>.")
  if args.lora and args.stage != "rl":
    raise ValueError(f"lora={args.lora} applies to stage=rl only (got stage={args.stage}).")
  return args


def study_config(args: ml_collections.ConfigDict, s: EnvSetting) -> ml_collections.ConfigDict:
  """The locked config of one stage of the study on `s`'s environment."""
  c = base.base_config()
  agentgym_rl.smollm2_on_cpu(c)
  c.seed = args.seed
  c.env.name = s.env
  c.env.kwargs = ml_collections.ConfigDict(s.env_kwargs)
  c.env.categories = s.categories
  c.schedule.horizons = (s.turns,)
  # Trained replies are 20-40 tokens ("Thought: ...\n\nAction:\ngo to red ball 1"); the cap
  # bounds the rambling of zero-shot replies, decoded a token at a time on the CPU.
  c.rollout.max_reply_tokens = s.max_reply_tokens
  # The opening (~470-510 tokens) and the turns of BabyAI's expert episodes fit in 1536 tokens;
  # the update's rows are as long as the batch's longest episode, so a longer limit costs only
  # where an episode uses it.
  c.rollout.max_context = s.max_context
  c.eval.num_tasks = s.eval_tasks
  c.checkpoint.keep = 1
  c.checkpoint.export_hf = False
  c.log.progress_bar = False

  if args.stage == "zero_shot":
    c.total_steps = 0
  elif args.stage == "bc":
    c.mode = "bc"
    # Clean demonstrations, 4 per step, each seen once. One row's update costs ~10 s on
    # 2 cores (~50 tokens/s), so BC is kept short: enough to teach the action format.
    c.bc.num_tasks = s.bc_tasks
    c.bc.balance_categories = bool(s.categories)
    c.data.batch_tasks, c.data.group_size = 4, 1
    c.total_steps = s.bc_tasks // c.data.batch_tasks
    c.optim.lr = 5e-5
    c.optim.warmup_steps = 1
    c.optim.decay = "cosine"
    c.optim.end_lr_fraction = 0.1
    c.eval.every_steps = c.total_steps
    # The starting point is SmolLM2 as shipped: its held-out success is stage=zero_shot's
    # (0 of 48), a constant that a BC run need not measure again (~5 minutes of replies that
    # run to the cap).
    c.eval.at_start = False
    # Held-out episodes 8 at a time, as the RL stage's (a step's rows there).
    c.eval.rows = 8
    c.checkpoint.every_steps = c.total_steps
    # The update's blocks as a scan, not CPU's unrolled default: BC compiles an update for each
    # of its demonstrations' row widths, and a scanned update compiles in a third less time and
    # loads from the compilation cache ~5x faster (XLA:CPU's load grows with the square of a
    # program's size), so a rerun or a resume rebuilds in seconds; its step is as fast and the
    # run's peak lower (README.md, "Where a BC rerun's seconds go"). The RL stage keeps the
    # unrolled update, 0.5 GiB smaller at its rows, under its 6 GiB peak.
    c.model.layer_loop = "scan"
  else:
    c.init_from = args.init
    c.data.categories = s.rl_categories
    # algo=grpo runs as Dr.GRPO: centre on the group mean, no std division. BabyAI's reward is
    # shaped (1 - 0.9 * steps / max_steps on success), so in a group of successes the std is
    # tiny and dividing by it turns a one-turn difference into a full-size advantage.
    c.algo.estimator = "drgrpo" if args.algo == "grpo" else ALGORITHMS[args.algo]
    # DAPO's clip-higher: room for low-probability tokens to rise.
    c.algo.clip_high = 0.28
    # Every episode weighs the same, whatever its length (the tiny study's choice).
    c.algo.loss_agg_mode = "seq-mean-token-mean"
    # kl_coef stays the base's 0.001 (low_var_kl): the reference is kept, so actor/kl logs the
    # KL to the starting checkpoint every step. Without it (DAPO's and Dr.GRPO's choice; no
    # reference forward, ~15 s a step and 0.5 GiB less) seed 0 sampled run 5's episodes for 6
    # steps, then others, and ended at BC's 0.542 where run 5 reached 0.708 (README.md, session
    # 14): one draw a side, so the recipe keeps the KL term that its gains were measured with.
    # A small step: one update at the tiny study's 3e-4 from a fresh AdamW flips a policy, and
    # at 2e-5 the first update cost KL 0.035 per token to the BC checkpoint and 10 greedy
    # points (README.md, run 1): half of it, smollm2_on_cpu's 1e-5 (Adam's first steps move
    # every weight by about the learning rate, whatever the gradient's size; a warm-up would
    # spend the first of the few steps that fit at learning rate 0).
    c.optim.lr = 1e-5
    # algo=ppo's critic (a copy of the policy's backbone, value head at zero) learns at 10x the
    # policy's rate, the paper's ratio (1e-5 to 1e-6): at the policy's own 1e-5 its values stay
    # near 0 for the whole of a short run, and GAE's advantage is then the return alone.
    c.optim.critic_lr = 10 * c.optim.lr
    if args.get("lora", 0):  # (horizons.py and multienv.py pass no lora)
      agentgym_rl.with_lora(c, args.lora, base_dtype=c.model.dtype)
    # A refused action (BabyAI: "go to red ball" when no such action is listed, repeated to
    # the turn limit, the BC policy's main failure) costs 0.1: the outcome estimators score an
    # episode by its summed reward, so groups whose samples all fail still rank them by how
    # often they were refused, and dynamic sampling drops fewer groups. Success is unaffected.
    c.env.invalid_action_reward = -0.1
    # 2 tasks x 4 samples per step: one row's update costs ~10 s on 2 cores, so 8 rows (plus
    # the reference's and the old policy's forwards) is ~3-4 minutes a step.
    c.data.batch_tasks, c.data.group_size = 2, 4
    # Sampling at temperature 0.7: at 1.0 (runs 1-3 in README.md) the updates cost greedy
    # success within 4-8 steps; at 0.5 (run 4) the samples are the greedy policy's and
    # most groups carry no signal; at 0.7 (run 5) greedy success rose.
    c.rollout.temperature = 0.7
    # DAPO's dynamic sampling: a group whose samples all succeed or all fail trains nothing, so
    # roll out up to 2 more rounds of 2 tasks to fill the batch with informative groups
    # (rollouts are cheaper than the update rows they fill).
    c.algo.dynamic_sampling = True
    c.total_steps = s.rl_steps
    # One greedy held-out evaluation costs minutes: once, at the end (the start's is the BC
    # run's last).
    c.eval.every_steps = s.rl_steps
    c.checkpoint.every_steps = 2
    # The starting checkpoint's greedy held-out success is the BC run's last evaluation (same
    # tasks, greedy: the same number); not evaluating it again saves minutes.
    c.eval.at_start = False

  if args.runlocal:
    # The smoke run: one step of two rows (an update row of SmolLM2 costs seconds on a CPU),
    # 2 turns, and one greedy evaluation of 2 tasks at the end.
    c.total_steps = min(c.total_steps, 1)
    c.bc.num_tasks = 2
    c.data.group_size = min(c.data.group_size, 2)
    c.data.batch_tasks = 2 // c.data.group_size
    c.schedule.horizons = (2,)
    c.eval.num_tasks = 2
    c.eval.at_start = False
    c.eval.every_steps = c.total_steps
    c.checkpoint.every_steps = 1
  pack(c)
  return base.lock(c)


def mix_environments(c: ml_collections.ConfigDict, mix: dict, runlocal: bool) -> None:
  """Makes `c` (a study_config of a setting whose env is rollout.envs.MIX) run the mixture
  `mix` ({label: envs.member(...)}): BC on `bc.num_tasks` demonstrations of each member, each
  seen once; the runlocal, one task of each member a step. Lock `c` again after."""
  with c.unlocked():
    c.env.mix = ml_collections.ConfigDict(copy.deepcopy(mix))
  if runlocal:
    c.data.batch_tasks = len(mix)
    pack(c)
  if c.mode == "bc":
    c.total_steps = 1 if runlocal else len(mix) * c.bc.num_tasks // c.data.batch_tasks
    c.eval.every_steps = c.checkpoint.every_steps = c.total_steps


def pack(c: ml_collections.ConfigDict) -> None:
  """A step's rows as one packed row, one micro-batch (train/packing.py): each RL group's
  samples share their first observation and BC's demonstrations the system prompt, which the
  update and the scorers then compute once, with no padding between rows (one row of the update
  costs ~10 s on 2 cores). A packed row of 8,192 positions needs 1.3 GiB of the update's
  temporaries. Call it again after changing the batch's shape."""
  c.algo.pack_rows = c.data.batch_tasks * c.data.group_size
  c.algo.microbatches = 1
