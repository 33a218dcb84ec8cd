r"""SmolLM2-135M-Instruct on TextCraft: fixed turn limits against ScalingInter-RL and a horizon
that lengthens on evidence, at one budget of trained tokens (the paper's Fig. 7 at CPU scale).

AgentGym-RL's Fig. 7 trains with a short fixed turn limit, a long one, and ScalingInter-RL (the
limit grows in phases of fixed length) and finds the last best. Here the same comparison from
a pretrained model: Dr.GRPO (common.py's RL recipe) from a BC run of this file with
`horizon=`

  short          a fixed limit of 4 turns
  long           a fixed limit of 10 turns
  scaling_inter  4 -> 7 -> 10 turns, a phase every 4 steps (the paper's schedule)
  evidence       4 -> 7 -> 10 turns, a phase ending once the training success of its last 2
                 steps reaches 0.25 (schedule.advance="success", rl/schedule.py), after 4 steps
                 at the latest: ours, not the paper's

every run stopping at the first step that brings its trained tokens to TOKEN_BUDGET
(`total_tokens`), so a horizon that makes longer episodes gets fewer steps, not more compute.

Every batch holds one depth-1 goal and one depth-2 goal (a mixture of TextCraft's two depths,
`env.mix`, labels "depth1" and "depth2"): the BC policy solves no depth-2 goal greedily, and
depth-2 goals are 71% of the train split, so batches drawn from the split alone held no success
to reinforce (a probe of horizon=long drawn that way: 0 of 40 episodes in 5 steps). The
depth-1 group carries the learning signal at every limit; the depth-2 group is where a longer
limit can matter. The metrics and held-out results come per depth (`eval/depth2/success_rate`).

  cfg=experiments/smollm2/horizons.py ROOT=/tmp/smollm2_horizons
  # 1. BC once (16 expert demonstrations of each depth, up to 10 turns; greedy held-out after):
  python -m agentgym_jax.train --config=$cfg:stage=bc --workdir=$ROOT/bc
  # 2. each horizon x seeds 0-2 from it, one after another (12 runs; drop --run to print them):
  python launch/sweep.py --config=$cfg:init=$ROOT/bc --sweep=seeds --workdir=$ROOT --run
  #    one of them alone:
  python -m agentgym_jax.train --config=$cfg:horizon=evidence,seed=0,init=$ROOT/bc \
      --workdir="$ROOT/horizon=evidence,seed=0"
  # 3. held-out before and after per horizon, its seeds pooled, with 95% intervals (per depth);
  #    the curves (held-out success, training success, episodes/turns_mean and
  #    update/trained_tokens_total per step), the seeds as mean and band:
  python -m agentgym_jax.report $ROOT/horizon=* --out=$ROOT/report
  python -m agentgym_jax.viewer $ROOT
  # the runs' records without checkpoints, kept in the repository (runs/textcraft/bc and
  # runs/textcraft/horizon=*), so that seeds run on different machines report together:
  python -m agentgym_jax.archive $ROOT/bc $ROOT/horizon=* --into=experiments/smollm2/runs/textcraft
  # the smoke run (BC's, then one horizon's from it): append ,runlocal to both configs.

What will be reported (experiments/smollm2/README.md): per horizon, greedy held-out success on
all 72 depth-1 and depth-2 test goals at 10 turns before (the BC policy) and after, its change
with the report's 95% interval over tasks and the 3 seeds, per depth; held-out success against
trained tokens; the turn limit and episode length over training; the steps each horizon took
to spend the budget and the step at which the evidence schedule moved to each phase.

Config arguments: stage ("rl", default, or "bc"), horizon (above; default scaling_inter), init
(the BC run's workdir; default the one above), seed, runlocal.

Not run yet: no results. Measured on 2 CPU cores (2026-12-07, session 23, alone): stage=bc 7.6
minutes, "0.222 at step 8" (depth 1 14/31, depth 2 2/41), peak 4.59 GiB; horizon=long,seed=0
from it, 4 steps as a probe: 113-140 s and 4,734-7,502 trained tokens a step (25,098 in all),
8 of 32 episodes succeeded (depth 1 4/4 and 2/4, depth 2 2/4 at step 1: groups with a signal
in 2 of the 4 steps), peak 4.96 GiB. So about 15 steps and two evaluations of the 72 goals
(about 6 minutes each), near 45 minutes, for a 10-turn run.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from agentgym_jax import sweeps
from agentgym_jax.rollout import envs
from agentgym_jax.train import config as base
from experiments.smollm2 import common, textcraft

STAGES = ("bc", "rl")
HORIZONS = ("short", "long", "scaling_inter", "evidence")
# TextCraft's expert needs 2-3 turns for a depth-1 goal and 3-10 for a depth-2 one. 4 turns
# allow every depth-1 recipe and the short depth-2 ones with no turn to spare; 10 (textcraft.py's
# limit) allows every expert episode and room to recover from a refused craft, the BC policy's
# main failure. ScalingInter's middle phase sits half way.
SHORT, LONG = 4, 10
PHASES = (SHORT, 7, LONG)
STEPS_PER_PHASE = 4
# The evidence rule: the phase ends once the mean training success of its last WINDOW steps
# (2 tasks x 4 samples each) reaches THRESHOLD, about twice BC's sampled success on TextCraft
# (13.9% at T=0.7 over both depths, README.md): the policy has learned something at this limit.
# Not tuned.
WINDOW, THRESHOLD = 2, 0.25
# The budget: 16 steps of textcraft.py's 10-turn RL run, whose steps trained 4,800-7,600
# tokens (8 depth-1 episodes). Every episode carries TextCraft's ~450-token opening (the
# runlocal's 1-turn rows: ~470 tokens), so the 10-turn run, whose failed depth-2 episodes use
# every turn, gets fewer steps than that and the 4-turn run more.
TOKEN_BUDGET = 96_000
# A cap on steps, above what any horizon should need to spend the budget.
MAX_STEPS = 40
# Greedy held-out evaluation of the 72 goals (about 6 minutes each): every 8 steps and at the
# last. Not at the start: that is the BC policy, which the BC run evaluated last with the same
# goals, turns and greedy decoding (the report's "before" for every run, through init_from).
EVAL_EVERY = 8

# The two depths as two task streams, half of each batch apiece; each keeps the run's turn
# limit (max_turns 0: the schedule's) and its own demonstrations and held-out goals (all 31
# depth-1 and 41 depth-2 test goals).
MIX = {depth: envs.member("textcraft", 0.5, categories=(depth,))
       for depth in ("depth1", "depth2")}
# textcraft.py's setting over the mixture: BC on 16 demonstrations of each depth (textcraft.py's
# 32, 16 of each), held-out on every test goal of each.
SETTING = dataclasses.replace(textcraft.SETTING, env=envs.MIX, env_kwargs={}, categories=(),
                              rl_categories=(), bc_tasks=16, eval_tasks=0, rl_steps=MAX_STEPS)


# Where the commands above put the BC run: init's default.
DEFAULT_INIT = "/tmp/smollm2_horizons/bc"


def parse(arg: str | None) -> ml_collections.ConfigDict:
  args = base.parse_arg(arg, stage="rl", horizon="scaling_inter", init=DEFAULT_INIT, seed=0,
                        runlocal=False)
  if args.stage not in STAGES:
    raise ValueError(f"Config argument stage={args.stage!r} is not one of {list(STAGES)}.")
  if args.horizon not in HORIZONS:
    raise ValueError(f"Config argument horizon={args.horizon!r} is not one of {list(HORIZONS)}.")
  if args.stage == "rl" and not args.init:
    raise ValueError("The horizon study starts from a BC run: add init=<the workdir of "
                     "horizons.py:stage=bc>.")
  return args


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = parse(arg)
  c = common.study_config(ml_collections.ConfigDict(dict(
      stage=args.stage, algo="grpo", init=args.init if args.stage == "rl" else "",
      seed=args.seed, runlocal=args.runlocal)), SETTING)
  # BC: 16 demonstrations of each depth; the runlocal: a goal of each depth a step.
  common.mix_environments(c, MIX, args.runlocal)
  if args.stage == "bc":
    return base.lock(c)
  c.total_tokens = TOKEN_BUDGET
  # Every horizon is evaluated at the longest limit: the same held-out task for all of them.
  c.eval.max_turns = LONG
  c.eval.at_start = False
  c.eval.every_steps = EVAL_EVERY
  # No dynamic sampling: with it the step's episode metrics, and so the training success the
  # evidence rule reads, are those of the kept groups, which it picks for mixed outcomes; off
  # for every horizon so that the four runs differ in their turn limits alone.
  c.algo.dynamic_sampling = False
  short, phases, steps_per_phase = SHORT, PHASES, STEPS_PER_PHASE
  if args.runlocal:
    # Two steps at 1 and 2 turns: ScalingInter's phase changes after the first, and the
    # evaluation runs at 2 turns (study_config's runlocal: 2 held-out goals).
    short, phases, steps_per_phase = 1, (1, 2), 1
    c.total_steps = 2
    c.eval.max_turns = phases[-1]
    c.eval.every_steps = c.total_steps
  if args.horizon in ("short", "long"):
    c.schedule.kind = "fixed"
    c.schedule.horizons = (short if args.horizon == "short" else phases[-1],)
  else:
    c.schedule.kind = "scaling_inter"
    c.schedule.horizons = phases
    c.schedule.steps_per_phase = steps_per_phase
    c.schedule.advance = "success" if args.horizon == "evidence" else "steps"
    c.schedule.window = min(WINDOW, steps_per_phase)
    c.schedule.success_threshold = THRESHOLD
  return base.lock(c)


def get_sweep(arg: str | None = None) -> sweeps.Sweep:
  """"seeds": every horizon x seeds 0-2 (run with :init=<the BC run>)."""
  if arg != "seeds":
    raise ValueError(f"Unknown sweep {arg!r}; use 'seeds'.")
  return sweeps.product(sweeps.sweep("arg.horizon", HORIZONS), sweeps.sweep("arg.seed", [0, 1, 2]))
