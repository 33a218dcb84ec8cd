r"""Compile one training step for a TPU slice on any machine, or for this machine, and say
whether it fits.

    python -m agentgym_jax.plan --topology=v4-32 \
      --config=experiments/agentgym_rl/searchqa.py:schedule=scaling_inter,model=7b
    JAX_PLATFORMS=cpu python -m agentgym_jax.plan --topology=cpu \
      --config=experiments/smollm2/babyai.py:stage=rl,init=/nowhere --only=update

With PyPI's libtpu installed (`pip install -e ".[tpu]"`), XLA compiles for a TPU topology
that is not there (ahead of time: `jax.jit(f).lower(abstract args).compile()`), and the
compiled program says how many bytes each chip needs; a program that does not fit a chip's
HBM fails to compile. MaxText checks pod configs the same way (train_compile.py).
`--topology=cpu` (or `gpu`) compiles the same programs for this process's own devices, and
compares them with the host's RAM (or the GPU's memory); XLA:CPU compiles a program of any
size, so there the comparison is the plan's. Both are a `targets.Target`.

The plan builds what `train/loop.py` builds, abstractly and with the trainer's own functions:
the run's tokenizer, the mesh of `config.mesh` on the target's devices, the train state's
shapes and shardings (the model's shapes from the experiment, from `models.published` when its
checkpoint is not on disk; no weight is read), and then compiles the programs of one step at
the config's largest shapes:

  rollout_extend  append a chunk of 512 tokens to one host's rows of the KV cache
  rollout_decode  sample a whole turn into that cache (max_reply_tokens)
  score_logprobs  reference (and, off-policy, old) log-probs of the step's batch
  score_values    the critic's values (PPO/GAE only)
  update          epochs x minibatches optimizer updates

each of them that the step runs (`Run.programs`: behaviour cloning runs the update only).

Asynchronous rollout on devices of its own (`rollout.devices = n`, train/asynchronous.py)
splits every host's chips into two groups: the last n of each host roll out, the others train.
The plan then builds the train state, scorers and update on the train group's mesh and the
rollout programs on one host's n rollout chips, which hold no train state, only the published
weights: `rollout.max_staleness` more versions of them besides the one decoding (`resident`).
Each program's row names its group and how many chips it spans.

Each host rolls out its own rows on its own chips (agentgym_jax/multihost.py), so the rollout
programs compile for one host of the slice's generation (a compile for part of a slice's
devices fails inside libtpu) with the rows and params of one host. A program's row counts
what its device holds while it runs: its arguments, outputs and temporaries (XLA's
`memory_analysis`, outputs that reuse a donated argument counted once) and its code, plus
`resident`, the train state it does not take as an argument but that stays in memory
meanwhile.

FLOPs per step are counted by formula (`step_flops`), not read from the compiler, whose cost
analysis counts a loop body once; the last line gives them, with the time they take on all
chips at the chip's bf16 peak where the target's peak is known (TPU slices).

The programs it compiles go into JAX's persistent compilation cache, `config.compile.cache_dir`
as for the trainer (agentgym_jax/caches.py): a run of the same config on the same target
started with that cache loads them instead of compiling them (docs/tpu.md, "A pod that starts
warm"). For that the plan lowers what the trainer lowers, argument for argument: the
tokenizer's end-of-turn ids (a static argument of the decode), the rows sharded as
`sharding.shard_batch` puts them, and only the programs the step runs.

Exit status 0 when every program fits, 1 with one line naming the first that does not.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentgym_jax import cli
from agentgym_jax import policies
from agentgym_jax import settings as settings_lib
from agentgym_jax import sharding as sharding_lib
from agentgym_jax import targets
from agentgym_jax.models import Decoder, KVCache, ModelConfig, resolve_attention
from agentgym_jax.models import published
from agentgym_jax.models.decoder import resolve_layer_loop
from agentgym_jax.models.value import ValueModel
from agentgym_jax.rl.algorithm import AlgorithmSpec
from agentgym_jax.rollout import sampler
from agentgym_jax.rollout.trajectory import bucket_length
from agentgym_jax.tokenization import ChatTokenizer
from agentgym_jax.train import asynchronous
from agentgym_jax.train import batches
from agentgym_jax.train import state as state_lib
from agentgym_jax.train import update as update_lib
from agentgym_jax.targets import GiB, Target

# ----- the run's shapes ---------------------------------------------------------------------


def run_tokenizer(config: ml_collections.ConfigDict) -> ChatTokenizer:
  """The run's tokenizer, loaded as the trainer loads it (a "bpe:" one trained on the config's
  tasks, as a new run trains it); for a published checkpoint that is not on disk, the
  Qwen2.5 vocabulary with its ChatML template (`ChatTokenizer.qwen2_5`: every model
  `models.published` knows is a Qwen2.5). Its end-of-turn ids are a static argument of the
  rollout's decode, and a random model's vocabulary is its size.

  Raises:
    ValueError: an HF path that is neither on disk nor a published model; a tokenizer spec
      the trainer would refuse.
  """
  path = config.model.path
  if config.tokenizer.spec == "model" and config.model.source == "hf" and not os.path.isdir(
      path):
    published.hf_config(path)  # raises, naming the published models
    return ChatTokenizer.qwen2_5()
  return policies.load_tokenizer(settings_lib.policy(config), settings_lib.env(config),
                                 workdir=None)


def model_config(config: ml_collections.ConfigDict, tok: ChatTokenizer,
                 platform: str) -> ModelConfig:
  """The policy's ModelConfig as the trainer reads it (`policies.policy_config`, no weights),
  from `models.published` for an HF checkpoint not on disk, with its "auto" settings resolved
  for `platform` ("tpu": the Pallas attention kernel, the blocks as a scan), the target's
  rather than this process's.

  Raises:
    ValueError: an HF path that is neither on disk nor a published model.
  """
  settings = dict(attention=resolve_attention(config.model.attention, platform),
                  layer_loop=resolve_layer_loop(config.model.layer_loop, platform))
  path = config.model.path
  if config.model.source == "hf" and not os.path.isdir(path):
    cfg = ModelConfig.from_hf_config(published.hf_config(path), param_dtype=config.model.dtype,
                                     **policies.run_settings(settings_lib.policy(config)),
                                     **policies.lora_settings(settings_lib.policy(config)))
  else:
    cfg = policies.policy_config(settings_lib.policy(config), tok)
  return dataclasses.replace(cfg, **settings)


def _abstract(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      tree, shardings)


def per_chip_bytes(tree: Any) -> int:
  """Bytes one device holds of the abstract arrays of `tree` (sharded ShapeDtypeStructs)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


@dataclasses.dataclass
class Run:
  """The abstract pieces of one training run on a mesh."""

  config: ml_collections.ConfigDict
  cfg: ModelConfig
  end_ids: tuple[int, ...]  # the tokenizer's end-of-turn ids, which end a sampled reply
  mesh: Mesh
  platform: str  # of the mesh's devices: "tpu", "cpu", "gpu"
  spec: AlgorithmSpec
  update_cfg: update_lib.UpdateConfig
  policy_def: nnx.GraphDef
  critic_def: nnx.GraphDef | None
  optimizers: state_lib.Optimizers
  shardings: state_lib.TrainState
  state: state_lib.TrainState  # of sharded ShapeDtypeStructs
  # Asynchronous rollout's settings and, with devices of its own, the rollout group's mesh.
  settings: asynchronous.AsyncSettings = asynchronous.AsyncSettings()
  rollout_mesh: Mesh | None = None

  @classmethod
  def build(cls, config: ml_collections.ConfigDict, devices: list[Any]) -> "Run":
    """The mesh, algorithm and abstract train state of `config` on `devices` (on the train
    group's devices with `rollout.devices`, as the trainer splits them)."""
    platform = devices[0].platform
    tok = run_tokenizer(config)
    cfg = model_config(config, tok, platform)
    settings = asynchronous.AsyncSettings.from_config(config)
    train, rollout = asynchronous.device_groups(settings, devices)
    mesh = sharding_lib.make_mesh(config.mesh, devices if train is None else train)
    rollout_mesh = None if rollout is None else sharding_lib.make_mesh(config.mesh, rollout)
    batches.check_layout(config, mesh, rollout_mesh)  # the trainer's own start-up checks
    update_cfg = update_lib.UpdateConfig.from_config(config)
    spec = update_cfg.algo
    policy = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    critic = (nnx.eval_shape(lambda: ValueModel(cfg, rngs=nnx.Rngs(1)))
              if spec.use_critic else None)
    optimizers = state_lib.Optimizers.from_config(config, with_critic=critic is not None)
    split = state_lib.split_models(policy, critic, keep_reference=spec.keep_reference,
                                   optimizers=optimizers, mesh=mesh)
    state = jax.eval_shape(lambda p, c: state_lib.init_train_state(
        policy=p, critic=c, keep_reference=spec.keep_reference, optimizers=optimizers,
        seed=0, shardings=split.shardings), split.policy, split.critic)
    return cls(config, cfg, tuple(tok.end_of_turn_ids), mesh, platform, spec, update_cfg,
               split.policy_def, split.critic_def, optimizers, split.shardings,
               _abstract(state, split.shardings), settings=settings,
               rollout_mesh=rollout_mesh)

  @property
  def rows(self) -> int:
    return self.config.data.batch_tasks * self.config.data.group_size

  @property
  def programs(self) -> tuple[str, ...]:
    """The programs a step runs (train/batches.py): behaviour cloning only the update, on the
    expert's demonstrations; RL its rollout, log-probs when it scores any (old ones unless the
    update's own forward gives them, `old_logprobs_from_update`, or the reference's), values
    with a critic, and the update."""
    if self.config.mode == "bc":
      return ("update",)
    logprobs = not self.spec.old_logprobs_from_update or self.spec.keep_reference
    return ("rollout_extend", "rollout_decode", *("score_logprobs",) * logprobs,
            *("score_values",) * self.spec.use_critic, "update")

  @property
  def length(self) -> int:
    """Tokens per row of the update's batch at the longest episode (`build_trajectory`'s
    bucket of `rollout.max_context`)."""
    return bucket_length(self.config.rollout.max_context)

  def batch(self) -> update_lib.Batch:
    """The update's batch at its largest shape, rows split over the data-parallel axes."""
    rows = NamedSharding(self.mesh, P(sharding_lib.BATCH_AXES))
    shape = (self.rows, self.length)
    array = lambda dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rows)
    floats = array(jnp.float32)
    return update_lib.build_batch(
        self.spec, tokens=array(jnp.int32), valid=array(jnp.bool_), loss_mask=array(jnp.bool_),
        old_logprobs=floats, advantages=floats, ref_logprobs=floats, returns=floats,
        values=floats, rollout_logprobs=floats, packed=self.packed(rows))

  def packed(self, rows: NamedSharding) -> dict[str, Any] | None:
    """The batch's packed rows (`algo.pack_rows`) at their largest: no shared opening, every
    row full, k rows in one."""
    k = self.update_cfg.pack_rows
    if k == 1:
      return None
    shape = (self.rows // k, bucket_length(k * self.length))
    array = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rows)
    fields = {"tokens": jnp.int32, "valid": jnp.bool_, "positions": jnp.int32,
              "starts": jnp.int32, "shared_start": jnp.int32, "shared_end": jnp.int32}
    return {"packed_index": array((self.rows, self.length), jnp.int32),
            "packed": {name: array(shape, dtype) for name, dtype in fields.items()}}


# ----- FLOPs by formula ---------------------------------------------------------------------


def forward_flops(cfg: ModelConfig, tokens: int, context: float, lm_head: bool = True) -> float:
  """Matmul FLOPs of a forward pass over `tokens` tokens that attend to `context` keys each
  on average: 2 per multiply-add of every weight, and QK^T plus AV (2 * 2 * H * Dh * context
  per token and layer); the LM head only when `lm_head`."""
  d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  qkv = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * dh
  per_layer = qkv + cfg.num_heads * dh * d + 3 * d * f
  weights = cfg.num_layers * per_layer + (d * cfg.vocab_size if lm_head else d)
  attention = cfg.num_layers * 4 * cfg.num_heads * dh * context
  return 2.0 * tokens * weights + tokens * attention


def step_flops(run: Run) -> dict[str, float]:
  """FLOPs of one step's programs at full rows (every episode at `length` tokens).

  Rollout: one forward over every token (the cache makes each token's forward count once).
  Scoring: a forward per scorer (old log-probs, reference log-probs, values). Update: per
  epoch, forward + backward (twice the forward) + the forward remat recomputes, for the
  policy and the critic.
  """
  cfg, tokens = run.cfg, run.rows * run.length
  fwd = forward_flops(cfg, tokens, run.length / 2)
  critic_fwd = forward_flops(cfg, tokens, run.length / 2, lm_head=False)
  scorers = int(not run.spec.old_logprobs_from_update) + int(run.spec.keep_reference)
  passes = 4 if cfg.remat else 3
  models = fwd + (critic_fwd if run.spec.use_critic else 0.0)
  ran = run.programs
  return {
      "rollout": fwd if "rollout_decode" in ran else 0.0,
      "score_logprobs": scorers * fwd if "score_logprobs" in ran else 0.0,
      "score_values": critic_fwd if "score_values" in ran else 0.0,
      "update": run.update_cfg.epochs * passes * models,
  }


# ----- compiling ----------------------------------------------------------------------------


@dataclasses.dataclass
class Program:
  """One compiled program's per-device bytes, or why it did not compile."""

  name: str
  arguments: int = 0
  outputs: int = 0
  temporaries: int = 0
  code: int = 0
  resident: int = 0
  needed: int | None = None  # what libtpu said it needs when it did not fit
  seconds: float = 0.0  # compile time
  group: str = ""  # with asynchronous rollout's device groups: which, and its chips

  @property
  def total(self) -> int:
    if self.needed is not None:
      return self.needed + self.resident
    return self.arguments + self.outputs + self.temporaries + self.code + self.resident


# libtpu's two ways of saying a program does not fit: the total it used, or its temporaries.
_EXCEEDS = re.compile(r"Used ([\d.]+)([KMGT]) of [\d.]+[KMGT] hbm|"
                      r"temporaries \(([\d.]+)([KMGT])\) exceeds available HBM")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# libtpu's refusal of a program over some of the chips of several hosts, on a slice with
# "limited ICI routing" (the asynchronous rollout's train group with rollout.devices > 0):
# v5e-64 refuses it, v5e-16 and v4-32 compile it; one host's chips always compile.
_PART_OF_THE_SLICE = "device assignment should include all slice devices"


def _compile(name: str, lower: Callable[[], Any], resident: int = 0) -> Program:
  """Compiles `lower()` (a jax Lowered) and reads its per-device memory.

  A program too big for the chip comes back with `needed` (libtpu's count) instead of
  raising; a program that libtpu refuses to place on part of the slice raises ValueError,
  in one line; any other compile error is raised.
  """
  start = time.perf_counter()
  try:
    compiled = lower().compile()
  except Exception as exc:  # pylint: disable=broad-except
    if _PART_OF_THE_SLICE in str(exc):
      raise ValueError(
          f"{name}: libtpu compiles no program over part of this slice's hosts' chips "
          f"('{_PART_OF_THE_SLICE}'); run the asynchronous rollout on the trainer's chips on "
          "this slice (rollout.devices=0)") from exc
    found = _EXCEEDS.search(str(exc))
    if "RESOURCE_EXHAUSTED" not in str(exc) or not found:
      raise
    number, unit = [g for g in found.groups() if g is not None]
    needed = int(float(number) * _UNITS[unit])
    return Program(name, resident=resident, needed=needed,
                   seconds=time.perf_counter() - start)
  stats = compiled.memory_analysis()
  return Program(
      name, arguments=stats.argument_size_in_bytes,
      # A donated argument's buffer holds the output that reuses it: counted once.
      outputs=stats.output_size_in_bytes - stats.alias_size_in_bytes,
      temporaries=stats.temp_size_in_bytes, code=stats.generated_code_size_in_bytes,
      resident=resident, seconds=time.perf_counter() - start)


def rollout_programs(run: Run, host_devices: list[Any], hosts: int,
                     compile_program: Callable[..., None]) -> None:
  """rollout_extend and rollout_decode for one host, passed to `compile_program(name, lower,
  resident)`: its share of the rows, the params on its chips as the rollout holds them (its
  rollout mesh, `state.rollout_layout`), the KV cache at the context limit."""
  config, cfg = run.config, run.cfg
  # The rollout's copy of the policy, in the compute dtype, laid out on the host's rollout
  # mesh (`batches.rollout_params`).
  compute = jnp.dtype(run.update_cfg.compute_dtype)
  cast = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, compute), run.state.policy)
  local, shardings = state_lib.rollout_layout(run.policy_def, cast,
                                              host_mesh(run.rollout_mesh or run.mesh, host_devices))
  params = _abstract(cast, shardings)
  shards = sharding_lib.data_parallel_size(local)
  rows = -(-run.rows // hosts // shards) * shards
  slots = -(-config.rollout.max_context // 128) * 128  # as run_episodes' limit
  width = min(bucket_length(512, 16), bucket_length(config.rollout.max_context, 16))
  cfg = dataclasses.replace(cfg, param_dtype=compute.name)  # the cache follows the weights
  # On one host in float32 on the train mesh's own layout the rollout reads the train state's
  # own params; otherwise a copy (gathered, cast or resharded), while the whole state stays
  # in HBM.
  own = hosts == 1 and compute == jnp.float32 and local.shape == run.mesh.shape
  resident = per_chip_bytes(run.state) - (per_chip_bytes(run.state.policy) if own else 0)
  if run.rollout_mesh is not None:  # a group of its own: the board's other versions only
    resident = run.settings.max_staleness * per_chip_bytes(params)
  # The rows' arrays sharded as the rollout puts them (`shard_batch`), so that the programs
  # are the ones it compiles.
  rows_of = lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=sharding_lib.batch_sharding(x.shape, local))
  cache = jax.eval_shape(lambda: KVCache.init(cfg, rows, slots, platform=run.platform))
  cache = _abstract(cache, cache.shardings(local))
  logits = rows_of(jax.ShapeDtypeStruct((rows, cfg.vocab_size), jnp.float32))
  ints = lambda *shape: rows_of(jax.ShapeDtypeStruct(shape, jnp.int32))
  sampling = sampler.SamplingConfig(
      temperature=config.rollout.temperature, top_p=config.rollout.top_p,
      top_k=config.rollout.top_k, max_reply_tokens=config.rollout.max_reply_tokens)
  turn = jax.tree.map(rows_of, jax.eval_shape(lambda: sampler.Turn.idle(
      jax.random.split(jax.random.key(0), rows), sampling.max_reply_tokens)))

  def under_mesh(fn):
    def lower():
      with jax.sharding.use_abstract_mesh(local.abstract_mesh):
        return fn()
    return lower

  compile_program("rollout_extend", under_mesh(lambda: sampler.extend.lower(
      run.policy_def, params, cache, logits, ints(rows, width), ints(rows))), resident)
  compile_program("rollout_decode", under_mesh(lambda: sampler.decode.lower(
      run.policy_def, params, cache, logits, turn, ints(rows), run.end_ids, sampling)),
                  resident)


def host_mesh(mesh: Mesh, host_devices: list[Any]) -> Mesh:
  """One host's part of `mesh`, on `host_devices`: the same axes, `tensor` whole (it never
  spans hosts), the data-parallel axes cut to what the host's chips hold, `fsdp` first."""
  left = len(host_devices) // mesh.shape["tensor"]
  fsdp = math.gcd(mesh.shape["fsdp"], left)
  sizes = {"data": left // fsdp, "fsdp": fsdp, "tensor": mesh.shape["tensor"]}
  return sharding_lib.make_mesh([(a, sizes[a]) for a in mesh.axis_names], host_devices)


PROGRAMS = ("rollout_extend", "rollout_decode", "score_logprobs", "score_values", "update")


def plan(config: ml_collections.ConfigDict, target: Target,
         report: Callable[[Program], None] = lambda p: None,
         only: tuple[str, ...] = PROGRAMS) -> tuple[list[Program], dict[str, float]]:
  """Compiles the programs one step of `config` runs on `target` (those named in `only`):
  (the programs, the step's FLOPs per stage). `report` sees each program as it finishes (a 7B
  update takes minutes)."""
  run = Run.build(config, target.devices())
  state_bytes = per_chip_bytes(run.state)
  programs = []

  host = target.devices(one_host=True)
  _, host_rollout = asynchronous.device_groups(run.settings, host)
  groups = {} if host_rollout is None else {
      "train": f"train, {run.mesh.size} chips",
      "rollout": f"rollout, {len(host_rollout)} of each host's {len(host)} chips"}

  def compile_program(name, lower, resident=0):  # pylint: disable=redefined-outer-name
    if name in only and name in run.programs:
      group = groups.get("rollout" if name.startswith("rollout") else "train", "")
      programs.append(dataclasses.replace(_compile(name, lower, resident), group=group))
      report(programs[-1])

  rollout_programs(run, host if host_rollout is None else host_rollout, target.hosts,
                   compile_program)
  batch = run.batch()
  score_logprobs, score_values = update_lib.make_scorers(run.policy_def, run.critic_def,
                                                         run.update_cfg, run.mesh)
  forward = update_lib.forward_inputs(batch)
  compile_program(
      "score_logprobs", lambda: score_logprobs.lower(run.state.policy, forward),
      resident=state_bytes - per_chip_bytes(run.state.policy) + per_chip_bytes(batch))
  if score_values is not None:
    compile_program(
        "score_values", lambda: score_values.lower(run.state.critic, forward),
        resident=state_bytes - per_chip_bytes(run.state.critic) + per_chip_bytes(batch))
  update_step = update_lib.make_update_step(run.policy_def, run.critic_def, run.optimizers,
                                            run.update_cfg, run.mesh, run.shardings)
  compile_program("update", lambda: update_step.lower(run.state, batch))
  return programs, step_flops(run)


# ----- the report ---------------------------------------------------------------------------


def header(config_name: str, target: Target) -> str:
  return f"{config_name} on {target.describe()}"


def columns(target: Target) -> tuple[str, ...]:
  return ("program", "arguments", "outputs", "temporaries", "code", "resident", "total",
          f"of {target.memory}", "fits")


def fits(program: Program, target: Target) -> bool:
  return program.needed is None and program.total <= target.usable_bytes


def row(program: Program, target: Target) -> list[str]:
  """The program's table row, GiB per device ("-" where a program too big has no breakdown)."""
  gib = lambda n: f"{n / GiB:.2f}"
  parts = [program.arguments, program.outputs, program.temporaries, program.code]
  name = f"{program.name} [{program.group}]" if program.group else program.name
  return [name, *(["-"] * 4 if program.needed is not None else map(gib, parts)),
          gib(program.resident), gib(program.total),
          f"{program.total / target.usable_bytes:.0%}",
          "yes" if fits(program, target) else "NO"]


def format_table(rows: list[list[str]], names: tuple[str, ...]) -> str:
  table = [list(names)] + rows
  widths = [max(len(r[i]) for r in table) for i in range(len(names))]
  return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths))) for r in table)


def flops_line(flops: dict[str, float], target: Target) -> str:
  """Model FLOPs of one step per stage, and the time they take on every device at peak where
  the target's peak is known."""
  total = sum(flops.values())
  # PFLOP for a slice's step, TFLOP or GFLOP for the small models a CPU trains.
  scale, unit = next(((s, u) for s, u in ((1e15, "PFLOP"), (1e12, "TFLOP")) if total >= s),
                     (1e9, "GFLOP"))
  stages = ", ".join(f"{name} {value / scale:.2f}" for name, value in flops.items() if value)
  line = f"Model FLOPs per step: {total / scale:.2f} {unit} ({stages})"
  if target.peak_flops is None:
    return line
  return (f"{line}; {total / target.peak_flops:.1f} s on {len(target.devices())} "
          f"{target.unit}s at peak")


def to_json(config_name: str, target: Target, programs: list[Program],
            flops: dict[str, float]) -> dict[str, Any]:
  """The plan as data (docs/make_tpu_table.py reads it): bytes per device of each program."""
  return {"config": config_name, "target": target.name, "platform": target.platform,
          "usable_bytes": target.usable_bytes, "peak_flops": target.peak_flops,
          "flops": flops,
          "programs": [dict(dataclasses.asdict(p), total=p.total, fits=fits(p, target))
                       for p in programs]}


def misfit_line(program: Program, target: Target) -> str:
  """The one line of a program that does not fit."""
  return (f"{program.name} needs {program.total / GiB:.2f} GiB per {target.unit} on "
          f"{target.name}, which has {target.usable_bytes / GiB:.4g} GiB usable "
          f"{target.memory}: use {target.larger}, more algo.microbatches or a shorter "
          "rollout.max_context")


def saved_line(cache_dir: str, target: Target) -> str:
  """Where the compiled programs went, and what loads them."""
  where = "this machine" if target.platform in targets.LOCAL else f"a {target.name} slice"
  return (f"Compiled programs saved in {cache_dir}: a run of this config on {where} with "
          f"--config.compile.cache_dir={cache_dir} loads them instead of compiling them.")


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = cli.config_from_flag()
  # Before anything compiles: the programs go there.
  cli.use_compilation_cache(config.compile.cache_dir)
  try:
    target = targets.parse(flags.FLAGS.topology, flags.FLAGS.memory_gib)
    target.devices(one_host=True)
  except ValueError as exc:
    cli.fatal(str(exc))
  except (ImportError, RuntimeError) as exc:  # libtpu's, for a slice's devices
    cli.fatal(f"--topology: {exc} (libtpu comes with pip install -e '.[tpu]')")
  print(header(flags.FLAGS["config"].config_filename, target), flush=True)
  done = []

  def report(program: Program) -> None:
    done.append(row(program, target))
    print(f"  compiled {program.name} in {program.seconds:.0f} s", flush=True)

  only = tuple(flags.FLAGS.only) or PROGRAMS
  unknown = sorted(set(only) - set(PROGRAMS))
  if unknown:
    cli.fatal(f"--only: no programs {unknown}; the programs are {list(PROGRAMS)}")
  try:
    programs, flops = plan(config, target, report, only)
  except ValueError as exc:
    cli.fatal(str(exc))
  print(format_table(done, columns(target)))
  print(flops_line(flops, target))
  if config.compile.cache_dir:
    print(saved_line(config.compile.cache_dir, target))
  misfits = [p for p in programs if not fits(p, target)]
  if flags.FLAGS.json:
    with open(flags.FLAGS.json, "w") as f:
      json.dump(to_json(flags.FLAGS["config"].config_filename, target, programs, flops), f,
                indent=1)
  if misfits:
    cli.fatal(misfit_line(misfits[0], target))


if __name__ == "__main__":
  # Defined here, not at import: the trainer's command defines its own --config.
  cli.define_config_flag("Experiment config file (and :arguments).")
  flags.DEFINE_string("topology", None, "A TPU slice (v5e-16, v4-32, v5p-128, v6e-8, ...), or "
                      "cpu or gpu: this process's own devices.")
  flags.DEFINE_float("memory_gib", None, "Plan against this much memory instead of the "
                     "target's: the host's RAM for cpu (shared by its devices), one device's "
                     "for gpu or a TPU chip; e.g. what other jobs leave free.")
  flags.DEFINE_string("json", None, "Also write the plan to this JSON file.")
  flags.DEFINE_list("only", [], f"Compile only these programs (default all: {PROGRAMS}).")
  flags.mark_flags_as_required(["config", "topology"])
  app.run(main, flags_parser=cli.parse_flags)
