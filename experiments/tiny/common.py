"""What the tiny-model study shares: model, tokenizer, the BC stage and the RL stage.

Not an experiment itself: `babyai.py` and `textcraft.py` are. Each states its environment,
horizons and step counts in an `EnvSetting` and calls `study_config(args, setting)`.

Config arguments (`--config=experiments/tiny/<env>.py:k=v,...`):
  stage     "bc" (behaviour cloning from the environment's noisy expert, from scratch) |
            "bc_more" (more behaviour cloning, from the BC run given by init=DIR) | "rl"
            (from a BC checkpoint given by init=DIR).
  algo      "grpo" | "ppo" (GAE + critic) | "reinforce_pp" | "rloo" | "gigpo" (turn-level group
            credit) | "turn_ppo" (GAE over turns, then tokens) (stage=rl only).
  horizon   "fixed" (the setting's turn limit) | "short" | "long" (fixed limits of the horizon
            study) | "scaling_inter" (short -> long, ScalingInter-RL).
  init      the BC run's workdir (stage=bc_more and rl); the tokenizer comes from there too.
  seed      run seed (initialisation, task order, sampling).
  eval      "greedy" (held-out success of greedy decoding, one episode per test task) |
            "sampled" (as AgentGym-RL's evaluation scripts: temperature 1, here 4 samples per
            test task, success per sample; evaluated at the start, midway and at the end).
  runlocal  two steps of everything, few tasks (the CLI smoke test).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from agentgym_jax.rl.algorithm import ALGORITHMS
from agentgym_jax.train import config as base

HORIZONS = ("fixed", "short", "long", "scaling_inter")
EVALS = ("greedy", "sampled")
STAGES = ("bc", "bc_more", "rl")

# A 4-layer decoder of width 128 (about 0.9M parameters): small enough that an RL step of 32
# episodes takes seconds on 2 CPU cores.
TINY = dict(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2,
            head_dim=32, max_position_embeddings=2048)


@dataclasses.dataclass(frozen=True)
class EnvSetting:
  """One environment's row of the study."""

  env: str
  env_kwargs: dict
  turns: int  # fixed turn limit of the main runs (and of evaluation).
  short: int  # horizon study: the short fixed limit, and ScalingInter's first phase.
  long: int  # horizon study: the long fixed limit, and ScalingInter's last phase.
  max_reply_tokens: int
  max_context: int
  bc_steps: int
  bc_more_steps: int  # stage=bc_more: a second BC cycle from the first one's checkpoint.
  rl_steps: int
  bc_noise: float  # probability that a demonstrated action is a random valid one.
  categories: tuple[str, ...] = ()  # the task categories studied (config.env.categories).


def parse(arg: str | None) -> ml_collections.ConfigDict:
  args = base.parse_arg(arg, stage="bc", algo="grpo", horizon="fixed", init="", seed=0,
                        eval="greedy", runlocal=False)
  if args.stage not in STAGES:
    raise ValueError(f"Config argument stage={args.stage!r} is not one of {list(STAGES)}.")
  if args.algo not in ALGORITHMS:
    raise ValueError(f"Config argument algo={args.algo!r} is not one of {list(ALGORITHMS)}.")
  if args.horizon not in HORIZONS:
    raise ValueError(f"Config argument horizon={args.horizon!r} is not one of {list(HORIZONS)}.")
  if args.eval not in EVALS:
    raise ValueError(f"Config argument eval={args.eval!r} is not one of {list(EVALS)}.")
  if args.stage != "bc" and not args.init and not args.runlocal:
    raise ValueError(f"stage={args.stage} starts from a BC run: add init=<the BC run's workdir>.")
  return args


def study_config(args: ml_collections.ConfigDict, s: EnvSetting) -> ml_collections.ConfigDict:
  """The base config with the study's model and the stage's fields (unlocked)."""
  c = base.base_config()
  c.seed = args.seed
  c.model.arch.update(TINY)
  # Byte-level BPE trained on the environment's own texts (instruction, observations, expert
  # actions): the long instruction and the action grammar become a few hundred ids.
  c.tokenizer.spec = "bpe:1024"
  c.tokenizer.bpe_tasks = 128

  c.env.name = s.env
  c.env.kwargs = ml_collections.ConfigDict(s.env_kwargs)
  c.env.categories = s.categories
  c.rollout.max_reply_tokens = s.max_reply_tokens
  c.rollout.max_context = s.max_context
  # The main runs' turn limit, which held-out evaluation also uses (the rest of evaluation is
  # the base's: the whole test split, greedy).
  c.schedule.horizons = (s.turns,)

  c.checkpoint.keep = 1
  # No KL, entropy or weight-decay terms: the tiny model has no pretrained behaviour to protect.
  c.update_from_flattened_dict(base.FROM_SCRATCH)
  # Memory only (the gradient is the same): 8-16 rows of up to 1536 tokens per micro-batch.
  c.algo.microbatches = 2

  if args.stage in ("bc", "bc_more"):
    c.mode = "bc"
    c.bc.noise = s.bc_noise
    # 32 demonstrations per step over all training tasks.
    c.data.batch_tasks, c.data.group_size = 32, 1
    c.optim.decay = "cosine"
    c.optim.end_lr_fraction = 0.1
    if args.stage == "bc":
      c.total_steps = s.bc_steps
      c.optim.lr = 3e-3
      c.optim.warmup_steps = 3
    else:
      # A second cosine cycle from the first one's checkpoint: on BabyAI the 32-step policy
      # of the study's third round ignored the observation (the same action distribution
      # whether the ball is in view or not, probe_actions.py); more cloning read it more.
      c.init_from = args.init
      c.total_steps = s.bc_more_steps
      c.optim.lr = 2e-3
    c.eval.every_steps = 8
    c.checkpoint.every_steps = c.total_steps
  else:
    c.init_from = args.init
    c.total_steps = s.rl_steps
    c.algo.estimator = ALGORITHMS[args.algo]
    # 4 tasks x 8 samples: the group of GRPO/RLOO baselines.
    c.data.batch_tasks, c.data.group_size = 4, 8
    c.algo.microbatches = 4
    # One weight per episode, not per token: with "token-mean" the long failed episodes
    # outweigh the short successes, the net push is down on the reply template every episode
    # shares, and at lr 1e-3 the format broke within 3 steps (experiments/tiny/README.md).
    c.algo.loss_agg_mode = "seq-mean-token-mean"
    # From the 24-step BC policy, 1e-3 broke the replies at the first step (approximate KL
    # 0.29, no success from step 2); the 32-step policy of the first round took 1e-3.
    c.optim.lr = 3e-4
    c.optim.critic_lr = 1e-3
    if args.algo == "gigpo":
      # A refused action leaves the state as it was, so the turns that acted from one state
      # differ by how many turns their success was still away: a discount of 0.9 per turn,
      # and the std division, which puts those small return differences on GRPO's scale.
      c.algo.gamma, c.algo.estimator_kwargs.step_norm = 0.9, "mean_std_norm"
    elif args.algo == "turn_ppo":
      c.algo.estimator_kwargs.turn_gamma = 0.9
    c.eval.every_steps = max(1, s.rl_steps // 4)
    c.checkpoint.every_steps = max(1, s.rl_steps // 4)
    if args.horizon == "short":
      c.schedule.horizons = (s.short,)
    elif args.horizon == "long":
      c.schedule.horizons = (s.long,)
    elif args.horizon == "scaling_inter":
      c.schedule.kind = "scaling_inter"
      c.schedule.horizons = (s.short, (s.short + s.long) // 2, s.long)
      c.schedule.steps_per_phase = max(1, s.rl_steps // 3)

  if args.eval == "sampled":
    # 4 samples per task: 360 episodes on BabyAI, so three evaluations, not one every few steps.
    c.eval.temperature, c.eval.group_size = 1.0, 4
    c.eval.every_steps = max(1, c.total_steps // 2)

  if args.runlocal:
    c.update_from_flattened_dict(base.RUNLOCAL)
    # Demonstrations of 8 tasks; BC keeps its 1 sample per task, all rows in one micro-batch.
    c.bc.num_tasks = 8
    if args.stage != "rl":
      c.data.batch_tasks, c.data.group_size = 4, 1
    c.algo.microbatches = 1
  return c
