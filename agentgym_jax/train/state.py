"""The train state pytree, the optimizers, and their sharded creation.

Parameters are held as plain nested dicts (`nnx.State.to_pure_dict()`); a model is rebuilt
inside jit with `nnx.merge(graphdef, params)`. Plain dicts keep the optimizer state, the
checkpoint tree and the sharding tree free of NNX variable wrappers.

With LoRA (`model.lora_rank` > 0, models/lora.py) the policy's parameters are the frozen base
and its adapters: the optimizer updates (and keeps moments of) the adapters only, and the KL
reference is the policy with its adapters off (`reference_params`), not a copy of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentgym_jax import sharding as sharding_lib
from agentgym_jax.models import lora

Params = Any  # nested dict of arrays


@struct.dataclass
class TrainState:
  """Everything that changes during training, as one pytree.

  Attributes:
    step: int32 scalar, trainer steps completed (the next step to run).
    rng: uint32[2] raw PRNG key data of the run; each step derives its keys with fold_in, so
      the state never needs to be split and a resumed run draws the same numbers.
    policy: policy parameters.
    opt_state: optax state of the policy optimizer.
    ref: frozen reference-policy parameters for the KL term, or None without a KL term or
      when the reference is the policy with its LoRA adapters off (`reference_params`).
    critic: value-model parameters (gae), or None.
    critic_opt_state: optax state of the critic optimizer, or None.
    reference_is_base: (static) the KL reference is the policy's base weights, its LoRA
      adapters off.
  """

  step: jax.Array
  rng: jax.Array
  policy: Params
  opt_state: optax.OptState
  ref: Params | None = None
  critic: Params | None = None
  critic_opt_state: optax.OptState | None = None
  reference_is_base: bool = struct.field(pytree_node=False, default=False)


def reference_params(state: TrainState) -> Params | None:
  """The KL reference's parameters: `state.ref`, or the policy with its LoRA adapters off
  (B = 0; the base arrays themselves, no copy); None when the run keeps no reference."""
  return lora.adapters_off(state.policy) if state.reference_is_base else state.ref


def has_adapters(params: Params) -> bool:
  """Whether a plain parameter dict holds LoRA adapters."""
  paths = jax.tree_util.tree_flatten_with_path(params)[0]
  return any(lora.is_adapter(path) for path, _ in paths)


# The random streams of a trainer step (`step_key`); evaluations use `evaluate.eval_key`.
ROLLOUT_STREAM = 0
UPDATE_STREAM = 1


def step_key(rng: jax.Array, step: jax.Array | int, stream: int) -> jax.Array:
  """The key of stream `stream` (rollout, update, ...) at trainer step `step`, from the
  state's raw key data `rng`: fold_in(fold_in(key, step), stream), inside jit or out."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(rng), step), stream)


def split_params(module: nnx.Module) -> tuple[nnx.GraphDef, Params]:
  """(graphdef, parameters as a plain dict); fails if the module holds non-parameter state."""
  graphdef, params = nnx.split(module, nnx.Param)
  return graphdef, params.to_pure_dict()


def lr_schedule(optim: ml_collections.ConfigDict, lr: float, total_steps: int,
                updates_per_step: int) -> optax.Schedule:
  """Warm-up then constant/cosine/linear decay, counted in optimizer updates.

  The config gives durations in trainer steps; each trainer step makes `updates_per_step`
  (= epochs x minibatches) optimizer updates, so both are scaled by it here.
  """
  warmup = optim.warmup_steps * updates_per_step
  total = max(total_steps * updates_per_step, warmup + 1)
  end = lr * optim.end_lr_fraction
  if optim.decay == "constant":
    if warmup == 0:
      return optax.constant_schedule(lr)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup])
  if optim.decay == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, total, end)
  if optim.decay == "linear":
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup), optax.linear_schedule(lr, end, total - warmup)],
        [warmup])
  raise ValueError(f"optim.decay must be 'constant', 'cosine' or 'linear', got {optim.decay!r}.")


def make_optimizer(optim: ml_collections.ConfigDict, schedule: optax.Schedule
                   ) -> optax.GradientTransformation:
  """Global-norm clipping then AdamW with decoupled weight decay (AgentGym-RL's recipe)."""
  adamw = optax.adamw(schedule, b1=optim.b1, b2=optim.b2, weight_decay=optim.weight_decay)
  if optim.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(optim.grad_clip), adamw)
  return adamw


def adapters_only(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` over the LoRA adapters (and a value model's head; clipping included: the norm is
  theirs), zero updates and no state for the frozen base weights, which stay bit for bit as
  they were (`lora.trainable_labels`)."""
  return optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()},
                               lora.trainable_labels)


def opt_state_shardings(tx: optax.GradientTransformation, params: Params,
                        param_shardings: Any, mesh: Mesh) -> Any:
  """Shardings of tx.init(params): moments follow their parameter, scalars are replicated.
  A masked optimizer's placeholders for the parameters it leaves alone (`adapters_only`'s
  frozen ones) stay placeholders: they hold no array."""
  abstract = jax.eval_shape(tx.init, params)
  replicated = NamedSharding(mesh, P())
  masked = lambda x: isinstance(x, optax.MaskedNode)
  return optax.tree_map_params(tx, lambda x, sh: x if masked(x) else sh, abstract,
                               param_shardings, transform_non_params=lambda _: replicated,
                               is_leaf=masked)


def param_shardings(module: nnx.Module, mesh: Mesh) -> Any:
  """NamedShardings of `module`'s parameters (plain dict), from their logical axis names."""
  return sharding_lib.state_shardings(nnx.state(module, nnx.Param), mesh).to_pure_dict()


def rollout_layout(policy_def: nnx.GraphDef, params: Params, mesh: Mesh | None
                   ) -> tuple[Mesh | None, Any]:
  """Where a process samples with `params` (the policy's, concrete or abstract) and how they
  are laid out there: `sharding.rollout_mesh` of its devices `mesh` (tensor-parallel where the
  train mesh is FSDP) and the parameters' NamedShardings on it, from their logical axis
  names. The trainer reshards its copy once a step (`batches.rollout_params`); the TPU plan
  compiles the rollout's programs for the same layout."""
  if mesh is None:
    return None, None
  model = nnx.eval_shape(lambda: nnx.merge(policy_def, params))
  rollout = sharding_lib.rollout_mesh(mesh, model.cfg.num_kv_heads)
  return rollout, param_shardings(model, rollout)


@dataclasses.dataclass(frozen=True)
class Optimizers:
  """The policy's and (for gae) the critic's optimizer, with their learning-rate schedules."""

  policy: optax.GradientTransformation
  policy_lr: optax.Schedule
  critic: optax.GradientTransformation | None = None
  critic_lr: optax.Schedule | None = None

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, with_critic: bool) -> "Optimizers":
    """Both optimizers from `config.optim`, durations scaled to optimizer updates."""
    updates = config.algo.epochs * config.algo.minibatches
    policy_lr = lr_schedule(config.optim, config.optim.lr, config.total_steps, updates)
    policy = make_optimizer(config.optim, policy_lr)
    # With LoRA the critic (its backbone a copy of the policy's, adapters included) trains
    # its adapters and its head.
    trains = adapters_only if config.model.lora_rank else (lambda tx: tx)
    if not with_critic:
      return cls(trains(policy), policy_lr)
    critic_lr = lr_schedule(config.optim, config.optim.critic_lr, config.total_steps, updates)
    return cls(trains(policy), policy_lr, trains(make_optimizer(config.optim, critic_lr)),
               critic_lr)


def init_train_state(*, policy: Params, critic: Params | None, keep_reference: bool,
                     optimizers: Optimizers, seed: int, shardings: "TrainState"
                     ) -> TrainState:
  """Builds step 0 of the train state, already laid out with `shardings`.

  The reference is a copy of the initial policy (its own buffers, so donating the state in
  the update never invalidates it), or with LoRA adapters the policy itself with its adapters
  off (`reference_params`), and optimizer states are created by a jitted init with their final
  shardings, so no moment buffer is ever whole on one device.
  """
  base_reference = keep_reference and has_adapters(policy)

  def build(policy, critic):
    ref = jax.tree.map(jnp.copy, policy) if keep_reference and not base_reference else None
    critic_opt = optimizers.critic.init(critic) if critic is not None else None
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        rng=jax.random.key_data(jax.random.key(seed)),
        policy=policy,
        opt_state=optimizers.policy.init(policy),
        ref=ref,
        critic=critic,
        critic_opt_state=critic_opt,
        reference_is_base=base_reference)

  return jax.jit(build, out_shardings=shardings)(policy, critic)


def train_state_shardings(*, policy_shardings: Any, critic_shardings: Any | None,
                          keep_reference: bool, optimizers: Optimizers, policy: Params,
                          critic: Params | None, mesh: Mesh) -> TrainState:
  """A TrainState-shaped tree of NamedShardings for the update's in/out shardings."""
  replicated = NamedSharding(mesh, P())
  base_reference = keep_reference and has_adapters(policy)
  critic_opt = None
  if critic is not None:
    critic_opt = opt_state_shardings(optimizers.critic, critic, critic_shardings, mesh)
  return TrainState(
      step=replicated,
      rng=replicated,
      policy=policy_shardings,
      opt_state=opt_state_shardings(optimizers.policy, policy, policy_shardings, mesh),
      ref=policy_shardings if keep_reference and not base_reference else None,
      critic=critic_shardings if critic is not None else None,
      critic_opt_state=critic_opt,
      reference_is_base=base_reference)


@dataclasses.dataclass(frozen=True)
class Split:
  """Models split for the train state: graphdefs, parameters (plain dicts) and the state's
  shardings (`split_models`)."""

  policy_def: nnx.GraphDef
  critic_def: nnx.GraphDef | None
  policy: Params
  critic: Params | None
  shardings: TrainState


def split_models(policy: nnx.Module, critic: nnx.Module | None, *, keep_reference: bool,
                 optimizers: Optimizers, mesh: Mesh) -> Split:
  """The policy's and critic's graphdefs and parameters, and the shardings of the train state
  built from them; the modules may be abstract (`nnx.eval_shape`), as the TPU plan's are."""
  policy_def, policy_params = split_params(policy)
  critic_def, critic_params = split_params(critic) if critic is not None else (None, None)
  shardings = train_state_shardings(
      policy_shardings=param_shardings(policy, mesh),
      critic_shardings=param_shardings(critic, mesh) if critic is not None else None,
      keep_reference=keep_reference, optimizers=optimizers, policy=policy_params,
      critic=critic_params, mesh=mesh)
  return Split(policy_def, critic_def, policy_params, critic_params, shardings)


def create(config: ml_collections.ConfigDict, policy: nnx.Module, critic: nnx.Module | None, *,
           keep_reference: bool, mesh: Mesh) -> tuple[TrainState, Split, Optimizers]:
  """Step 0 of a run: the train state built from the models (sharded on `mesh`), the split
  without its parameters (graphdefs and the state's shardings: the state owns the
  parameters), and the optimizers of `config.optim`."""
  optimizers = Optimizers.from_config(config, with_critic=critic is not None)
  split = split_models(policy, critic, keep_reference=keep_reference, optimizers=optimizers,
                       mesh=mesh)
  state = init_train_state(policy=split.policy, critic=split.critic,
                           keep_reference=keep_reference, optimizers=optimizers,
                           seed=config.seed, shardings=split.shardings)
  return state, dataclasses.replace(split, policy=None, critic=None), optimizers
