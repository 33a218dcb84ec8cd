"""The jitted, sharded PPO-style update and the scoring forward passes.

One call of the update runs `epochs x minibatches` optimizer updates over a rollout batch:

  for each epoch: shuffle the rows, cut them into minibatches
    for each minibatch:
      denominators of the loss aggregation from the WHOLE minibatch's mask
      gradient = Σ over micro-batches of grad(aggregate(token loss, micro mask, denominator))
      if loss and gradient norm are finite: clip, AdamW step; else keep params and moments

so the gradient of a minibatch does not depend on how many micro-batches it is cut into
(`rl.losses.aggregation_denominator`). The policy loss per token is

  ppo_clip(logπ, logπ_old, A) + kl_coef · KL(π || π_ref) - entropy_coef · H(π)

(the KL term only when it is not in the reward; behaviour cloning, `config.mode = "bc"`,
replaces the surrogate with the cross-entropy -logπ of the demonstrated tokens and drops KL;
`rl.algorithm.AlgorithmSpec` says which), and with a critic (gae) the clipped value loss
`value_coef · ½ max((V - R)², (clip(V, V_old ± c) - R)²)` trains the value model with its own
optimizer in the same minibatch loop.

Alignment: log-probabilities and entropies sit on the token they score (`rl.logprobs`), and so
do values: `values[:, t] = V(tokens[<t])`, the value of the state in which token t was chosen
(verl's convention). Position 0 is never an agent token and gets 0.

Scored positions: every loss term, metric and estimator reads log-probs and entropies on the
loss mask only, so the LM head scores only each row's agent tokens (`scored_positions`, built
on the host with the batch); the [R, L] results hold 0 elsewhere. Rows mostly of agent tokens
(past half the row) are scored at every position, as before.

Old log-probs: scored before the update (`make_scorers`), or, when the update makes one
optimizer step per batch and nothing before it reads them
(`AlgorithmSpec.old_logprobs_from_update`), its own forward's log-probs held constant: that
forward runs, in every micro-batch, the parameters the old log-probs would be scored with, so
the loss is the same (ratio exactly 1) and the step saves a forward pass over the batch.

Rows of a micro-batch are strided (micro-batch k holds rows k, k + K, k + 2K, ...), so with the
row axis split over the data-parallel devices every micro-batch spans all of them.

Micro-batch lengths: a batch's rows are as long as its longest episode (bucketed), and most
episodes are shorter. With `micro_lengths` = k > 1 each micro-batch of the update and of the
scoring passes runs at the shortest of k row lengths (the batch's and the k - 1 bucket lengths
below it, `micro_length_choices`) that holds its tokens, a `lax.switch` between k copies of
the forward and backward in one program: a causal model's first n positions do not depend on
the rest, so the losses and log-probs are those of the whole row. The cost is k branches to
compile.

Packed rows: with `pack_rows` = k > 1 the model runs on packed rows (`train.packing`), each
block of k consecutive rows as one row holding each group's common opening once, and its
hidden states are gathered back to the batch's rows (`row_hidden`): every loss, metric and
returned array is on the [R, L] rows as without packing. A micro-batch then holds whole
blocks (`split_micro`'s `rows_per_item`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, TypedDict

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentgym_jax import settings as settings_lib
from agentgym_jax import sharding as sharding_lib
from agentgym_jax.models.attention import Segments
from agentgym_jax.rl import logprobs as logprobs_lib
from agentgym_jax.rl import losses
from agentgym_jax.rl.algorithm import AlgorithmSpec
from agentgym_jax.rollout.trajectory import bucket_length
from agentgym_jax.train.state import UPDATE_STREAM, Optimizers, Params, TrainState, step_key


class Batch(TypedDict, total=False):
  """The update's batch, built by `build_batch`: [R, L] arrays, rows split over the data axes.

  tokens, valid, loss_mask and advantages always; old_logprobs unless the update's own forward
  gives them (`spec.old_logprobs_from_update`); ref_logprobs when the KL term is in the loss;
  returns and old_values with a critic; seq_tokens [R] where rows are turns of episodes (the
  agent tokens of each row's episode: `losses.aggregate`'s sequences); rollout_logprobs (the
  sampler's log-probs, `Trajectory.sample_logprobs`) with truncated importance sampling
  (`spec.tis_cap` > 0) and when the update measures the sampler/trainer gap (its old log-probs
  are its own); scored_positions [R, P] int32, the positions the LM head scores
  (`scored_positions`), unless it scores every position. With packed rows (`pack_rows` > 1):
  packed_index [R, L], where each row's tokens sit in its block's packed row, and packed, the
  packed rows [G, Lp] (`packing.PackedRows` but index: tokens, valid, positions, starts,
  shared_start, shared_end).
  """

  tokens: jax.Array
  valid: jax.Array
  loss_mask: jax.Array
  old_logprobs: jax.Array
  advantages: jax.Array
  ref_logprobs: jax.Array
  returns: jax.Array
  old_values: jax.Array
  seq_tokens: jax.Array
  rollout_logprobs: jax.Array
  scored_positions: jax.Array
  packed_index: jax.Array
  packed: dict[str, jax.Array]


# The fewest positions a row's LM head scores (`bucket_length`'s minimum, a power of two): the
# main job's rows hold at most 5 turns x 48 sampled tokens = 240, so they compile one shape.
SCORED_POSITIONS_MINIMUM = 256


def scored_positions(loss_mask: np.ndarray) -> np.ndarray | None:
  """The positions of each row whose log-probs the update reads: host loss mask [R, L] ->
  [R, P] int32, each row's agent tokens in order, then 0 (position 0 scores nothing), or None
  when the head should score every position.

  P = `bucket_length(most agent tokens in a row, SCORED_POSITIONS_MINIMUM)`, so a run sees few
  shapes and never drops an agent token; None when P >= L / 2, where another program's compile
  would cost more than the head it saves. Position 0 is left out: no logits precede it, and its
  log-prob is 0 either way.
  """
  mask = np.asarray(loss_mask, bool).copy()
  if mask.ndim != 2:
    raise ValueError(f"scored_positions: the loss mask must be [rows, length], got {mask.shape}.")
  mask[:, 0] = False
  counts = mask.sum(axis=1)
  size = bucket_length(int(counts.max(initial=0)), minimum=SCORED_POSITIONS_MINIMUM)
  if 2 * size >= mask.shape[1]:
    return None
  rows, columns = np.nonzero(mask)  # row-major: each row's positions in increasing order
  slots = np.arange(rows.size) - (np.cumsum(counts) - counts)[rows]
  positions = np.zeros((mask.shape[0], size), np.int32)
  positions[rows, slots] = columns
  return positions


def build_batch(spec: AlgorithmSpec, *, tokens: jax.Array, valid: jax.Array,
                loss_mask: jax.Array, old_logprobs: jax.Array | None = None,
                advantages: jax.Array | None = None, ref_logprobs: jax.Array | None = None,
                returns: jax.Array | None = None, values: jax.Array | None = None,
                seq_tokens: jax.Array | None = None,
                rollout_logprobs: jax.Array | None = None,
                scored_positions: jax.Array | None = None,
                packed: dict[str, Any] | None = None) -> Batch:
  """The batch of the update step, holding exactly the fields `spec` trains with (and
  `seq_tokens` when the rows are per-turn rows, `scored_positions` when the head scores only
  those: `scored_positions(loss_mask)`, `packed`'s fields with packed rows:
  `packed_fields`); all [R, L] but seq_tokens [R] and scored_positions [R, P].

  Behaviour cloning (cross-entropy) reads tokens, valid and loss_mask only: old_logprobs and
  advantages are then zeros when not given. With `spec.old_logprobs_from_update` the batch
  has no old_logprobs (the update computes them; any given are left out) and holds
  rollout_logprobs, which the update's gap metrics compare its log-probs with.

  Raises ValueError when a field the algorithm trains with is missing (e.g. truncated
  importance sampling without `rollout_logprobs`)."""
  rl = spec.policy_loss != "cross_entropy"
  zeros = lambda: jnp.zeros(tokens.shape, jnp.float32, device=tokens.sharding)
  trained = {"advantages": advantages if rl else zeros()}
  if not spec.old_logprobs_from_update:
    trained["old_logprobs"] = old_logprobs if rl else zeros()
  if spec.kl_in_loss:
    trained["ref_logprobs"] = ref_logprobs
  if spec.use_critic:
    trained.update(returns=returns, old_values=values)
  if spec.trains_with_rollout_logprobs:
    trained["rollout_logprobs"] = rollout_logprobs
  missing = [name for name, x in trained.items() if x is None]
  if missing:
    raise ValueError(f"build_batch: {spec.estimator or spec.policy_loss} with these options "
                     f"trains with {missing}; pass them (rollout_logprobs is "
                     "Trajectory.sample_logprobs, old_values the critic's values).")
  batch = Batch(tokens=tokens, valid=valid, loss_mask=loss_mask, **trained)
  if seq_tokens is not None:
    batch["seq_tokens"] = seq_tokens
  if scored_positions is not None:
    batch["scored_positions"] = scored_positions
  batch.update(packed or {})
  return batch


# The batch's fields a forward pass reads (the scorers' rows, `make_scorers`).
FORWARD_FIELDS = ("tokens", "valid", "scored_positions", "packed_index", "packed")


def forward_inputs(batch: Batch) -> dict[str, Any]:
  """What the scorers read of a batch: its `FORWARD_FIELDS`."""
  return {k: v for k, v in batch.items() if k in FORWARD_FIELDS}


def packed_fields(packed: Any, put: Callable[[np.ndarray], jax.Array]) -> dict[str, Any]:
  """A host `packing.PackedRows` as the batch's packed_index and packed fields, each array
  through `put` (host -> global array, leading axis over the data axes)."""
  return {"packed_index": put(packed.index),
          "packed": {name: put(getattr(packed, name))
                     for name in ("tokens", "valid", "positions", "starts", "shared_start",
                                  "shared_end")}}


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
  """The static (hashable) settings of the update: the algorithm and how a batch is cut."""

  algo: AlgorithmSpec
  epochs: int
  minibatches: int
  microbatches: int
  temperature: float
  compute_dtype: str = "float32"  # the forward's: "bfloat16" is mixed precision (`as_compute`)
  micro_lengths: int = 1  # row lengths a micro-batch may run at (`micro_length_choices`)
  pack_rows: int = 1  # rows packed into one, their common opening once (`train.packing`)

  def __post_init__(self):
    if self.pack_rows > 1 and self.micro_lengths > 1:
      raise ValueError("UpdateConfig: packed rows are as long as their tokens already; set "
                       f"algo.microbatch_lengths=1 (got {self.micro_lengths}) or "
                       "algo.pack_rows=1.")
    if self.algo.old_logprobs_from_update and self.updates_per_step != 1:
      raise ValueError("UpdateConfig: old log-probs from the update's own forward need one "
                       f"optimizer update per batch, got epochs={self.epochs} x "
                       f"minibatches={self.minibatches}.")

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> "UpdateConfig":
    """Raises ValueError (naming the field) on an invalid algorithm or batch split."""
    if config.rollout.temperature <= 0:
      raise ValueError("rollout.temperature must be > 0 for training: the policy's log-probs "
                       f"are those of the sampling distribution, got {config.rollout.temperature}.")
    for name in ("epochs", "minibatches", "microbatches", "microbatch_lengths", "pack_rows"):
      if config.algo[name] < 1:
        raise ValueError(f"algo.{name} must be >= 1, got {config.algo[name]}.")
    return cls(algo=settings_lib.algorithm(config), epochs=config.algo.epochs,
               minibatches=config.algo.minibatches, microbatches=config.algo.microbatches,
               temperature=config.rollout.temperature,
               compute_dtype=config.model.compute_dtype,
               micro_lengths=config.algo.microbatch_lengths,
               pack_rows=config.algo.pack_rows)

  @property
  def updates_per_step(self) -> int:
    return self.epochs * self.minibatches


# ----- token scoring -------------------------------------------------------------------------


def as_compute(params: Params, dtype: str) -> Params:
  """`params` in the forward's compute dtype: floating arrays cast, so a "bfloat16" forward
  of float32 parameters is mixed precision (upstream verl's FSDP default: bf16 compute,
  float32 master weights and optimizer); gradients flow back through the cast as float32.
  A no-op when the parameters already have that dtype."""
  dtype = jnp.dtype(dtype)
  cast = lambda x: (x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype
                    else x)
  return jax.tree.map(cast, params)


def unpack(x: jax.Array, index: jax.Array) -> jax.Array:
  """Per-token results of packed rows back on the rows: x [G, Lp, ...], index [G * k, L]
  (`packing.PackedRows.index`, row r in packed row r // k) -> [G * k, L, ...]."""
  g, length = x.shape[0], index.shape[1]
  index = index.reshape(g, -1)
  out = jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)
  return out.reshape((-1, length) + x.shape[2:])


def row_hidden(backbone: Callable, rows: dict[str, jax.Array]) -> jax.Array:
  """backbone(tokens, valid[, segments]) -> [.., D] (a `Backbone`, or a `ValueModel` ->
  [..]) of `rows`' tokens [m, L]: on the rows themselves, or on their packed rows
  (rows["packed"], `packed_fields`) gathered back to them; [m, L, ...] either way."""
  packed = rows.get("packed")
  if packed is None:
    return backbone(rows["tokens"], rows["valid"])
  segments = Segments(**{k: v for k, v in packed.items() if k not in ("tokens", "valid")})
  return unpack(backbone(packed["tokens"], packed["valid"], segments), rows["packed_index"])


def sequence_logprobs_and_entropy(model: Any, rows: dict[str, jax.Array],
                                  temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Log-probs and entropies of rows["tokens"] [B, L] (with rows["valid"] [B, L]) under the
  decoder `model`: two [B, L] float32, aligned as `rl.logprobs.token_logprobs_and_entropy`;
  with rows["scored_positions"] ([B, P], `scored_positions`) at those positions only, 0
  elsewhere; with packed rows (`row_hidden`) computed on them.

  The LM head runs through `rl.logprobs.head_logprobs_and_entropy`, so a long row's logits
  are made a block of positions at a time.
  """
  return logprobs_lib.head_logprobs_and_entropy(
      row_hidden(model.backbone, rows), rows["tokens"], model.logits_from_hidden, temperature,
      rows.get("scored_positions"))


def split_micro(tree: Any, num: int, rows_per_item: int = 1) -> Any:
  """Items of `rows_per_item` consecutive rows [R, ...] -> [num, R // num, ...], micro-batch k
  holding items k, k + num, ... (rows k, k + num, ... for single rows). Packed rows
  (tree["packed"], one item each) go with the rows of their blocks (`rows_per_item` = k)."""
  def one(x, per_item):
    items = x.shape[0] // per_item
    if x.shape[0] % per_item or items % num:
      raise ValueError(f"{x.shape[0]} rows in items of {per_item} do not split into {num} "
                       "micro-batches.")
    x = x.reshape(items // num, num, per_item, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape(num, (items // num) * per_item, *x.shape[3:])
  return _map_rows(tree, lambda x: one(x, rows_per_item), lambda x: one(x, 1))


def _map_rows(tree: Any, on_rows: Callable, on_packed: Callable) -> Any:
  """`on_rows` over a batch's row fields [R, ...], `on_packed` over its packed rows [G, ...]
  (tree["packed"], when it has them)."""
  if not (isinstance(tree, dict) and "packed" in tree):
    return jax.tree.map(on_rows, tree)
  rest = {k: v for k, v in tree.items() if k != "packed"}
  return {**jax.tree.map(on_rows, rest), "packed": jax.tree.map(on_packed, tree["packed"])}


def rows_per_item(rows: dict[str, Any]) -> int:
  """How many of `rows`' rows each packed row holds (1 without packed rows)."""
  packed = rows.get("packed")
  return 1 if packed is None else rows["tokens"].shape[0] // packed["tokens"].shape[0]


def merge_micro(tree: Any, rows_per_item: int = 1) -> Any:
  """Inverse of `split_micro` for rows: [num, m, ...] -> [m * num, ...] in the original order."""
  def one(x):
    num, m = x.shape[:2]
    x = x.reshape(num, m // rows_per_item, rows_per_item, *x.shape[2:])
    return jnp.swapaxes(x, 0, 1).reshape(num * m, *x.shape[3:])
  return jax.tree.map(one, tree)


# The shortest length a micro-batch is cut to (`bucket_length`'s default minimum).
MICRO_LENGTH_MINIMUM = 64


def micro_length_choices(length: int, count: int) -> tuple[int, ...]:
  """The row lengths, shortest first, a micro-batch of [m, length] rows may run at: `length`
  and the count - 1 largest `bucket_length` sizes below it (64, 96, 128, 192, ...).

  1,536 with count 3 -> (768, 1024, 1536); count 1 -> (length,)."""
  below, size = [], MICRO_LENGTH_MINIMUM
  while size < length:
    below.append(size)
    size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
  return tuple(below[len(below) - count + 1:] if count > 1 else []) + (length,)


# Per-row inputs [m, L] cut to a micro-batch's length; the others ([m], and scored_positions
# [m, P], positions inside the cut) pass whole.
_NOT_CUT = ("scored_positions",)


def at_used_length(fn: Callable, lengths: tuple[int, ...]) -> Callable:
  """fn(micro) run on the micro-batch's rows cut to the shortest of `lengths` that holds every
  valid token.

  micro: a dict of [m, L] arrays holding "valid" (L = lengths[-1]), and others that pass
  whole ([m], and scored_positions, whose positions lie inside the cut). fn returns
  (per-row [m, n, ...] arrays, anything else): the first are padded back to [m, L, ...] with
  0, the rest is returned as it is. One `lax.switch` branch per length: only the chosen one
  runs. With one length, fn itself.
  """
  if len(lengths) == 1:
    return fn

  def cut_to(n, micro):
    full = micro["valid"].shape
    cut = {k: v if k in _NOT_CUT or v.shape[:2] != full else v[:, :n] for k, v in micro.items()}
    rows, rest = fn(cut)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, full[1] - n)] + [(0, 0)] * (x.ndim - 2))
    return jax.tree.map(pad, rows), rest

  def run(micro):
    valid = micro["valid"]
    used = jnp.max(jnp.where(valid, jnp.arange(valid.shape[1]) + 1, 0))
    index = jnp.sum(jnp.asarray(lengths[:-1]) < used)
    return jax.lax.switch(index, [functools.partial(cut_to, n) for n in lengths], micro)
  return run


def _constrain_rows(tree: Any, mesh: Mesh | None, row_axis: int) -> Any:
  """Keeps axis `row_axis` split over the data-parallel mesh axes (no-op without a mesh)."""
  if mesh is None:
    return tree
  def one(x):
    names = [None] * x.ndim
    names[row_axis] = "batch"
    spec = sharding_lib.logical_to_spec(names, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  return jax.tree.map(one, tree)


# ----- losses of one micro-batch ---------------------------------------------------------------


def policy_loss(params: Params, micro: Batch, denominator: jax.Array, *,
                graphdef: nnx.GraphDef, cfg: UpdateConfig) -> tuple[jax.Array, dict]:
  """Aggregated policy loss of one micro-batch and token sums of its diagnostics.

  Args:
    params: policy parameters.
    micro: tokens, valid, loss_mask, advantages [m, L], old_logprobs unless
      `cfg.algo.old_logprobs_from_update` (+ ref_logprobs when the KL term is in the loss,
      rollout_logprobs with truncated importance sampling: the surrogate of each token is then
      weighted by `losses.tis_weights`; scored_positions [m, P] when the head scores only
      those, which must hold every position of loss_mask).
    denominator: `losses.aggregation_denominator` of the whole minibatch.
  Returns:
    (loss scalar, aux): aux holds `pg_loss` (the aggregated surrogate alone) and masked token
    sums of entropy, kl, clip_frac, clip_frac_lower, approx_kl (tis_weight, tis_capped with
    truncated importance sampling), plus the token count `tokens`,
    so that sums over micro-batches give exact minibatch means; with
    `old_logprobs_from_update` also `logprobs` [m, L], this forward's (the old log-probs).
  """
  model = nnx.merge(graphdef, as_compute(params, cfg.compute_dtype))
  mask = micro["loss_mask"]
  logp, entropy = sequence_logprobs_and_entropy(model, micro, cfg.temperature)
  # One optimizer step per batch: these parameters are the ones the old log-probs would be
  # scored with, so this forward's log-probs, held constant, are them (ratio exactly 1).
  old = (jax.lax.stop_gradient(logp) if cfg.algo.old_logprobs_from_update
         else micro["old_logprobs"])
  pg, pg_metrics = losses.POLICY_LOSSES[cfg.algo.policy_loss](
      logp, old, micro["advantages"], mask, clip_ratio_low=cfg.algo.clip_low,
      clip_ratio_high=cfg.algo.clip_high, clip_ratio_c=cfg.algo.clip_dual or None)
  if cfg.algo.tis_cap > 0:
    weights, tis_metrics = losses.tis_weights(old, micro["rollout_logprobs"], mask,
                                              cfg.algo.tis_cap)
    pg = pg * weights
    pg_metrics = {**pg_metrics, **tis_metrics}
  token_loss = pg - cfg.algo.entropy_coef * entropy
  tokens = jnp.sum(mask, dtype=jnp.float32)
  aux = {k: v * tokens for k, v in pg_metrics.items()}
  aux["entropy"] = jnp.sum(jnp.where(mask, entropy, 0.0))
  if cfg.algo.kl_in_loss:
    kl = losses.kl_penalty(logp, micro["ref_logprobs"], mask, cfg.algo.kl_estimator)
    token_loss = token_loss + cfg.algo.kl_coef * kl
    aux["kl"] = jnp.sum(kl)
  seq_tokens = micro.get("seq_tokens")
  aux["pg_loss"] = losses.aggregate(pg, mask, cfg.algo.loss_agg_mode, denominator, seq_tokens)
  aux["tokens"] = tokens
  if cfg.algo.old_logprobs_from_update:
    aux["logprobs"] = old
  return losses.aggregate(token_loss, mask, cfg.algo.loss_agg_mode, denominator,
                          seq_tokens), aux


def critic_values(params: Params, graphdef: nnx.GraphDef, rows: dict[str, jax.Array],
                  compute_dtype: str = "float32") -> jax.Array:
  """V(tokens[<t]) aligned with token t of rows["tokens"] [B, L] (valid, and packed rows as
  `row_hidden` reads them) -> [B, L] float32 (0 at position 0)."""
  values = row_hidden(nnx.merge(graphdef, as_compute(params, compute_dtype)), rows)
  return logprobs_lib.shift_right(values[:, :-1])


def critic_loss(params: Params, micro: Batch, denominator: jax.Array, *,
                graphdef: nnx.GraphDef, cfg: UpdateConfig) -> tuple[jax.Array, dict]:
  """Clipped value loss of one micro-batch (needs returns, old_values [m, L]); see policy_loss."""
  mask = micro["loss_mask"]
  values = critic_values(params, graphdef, micro, cfg.compute_dtype)
  token_loss, metrics = losses.value_loss(values, micro["old_values"], micro["returns"], mask,
                                          cliprange_value=cfg.algo.value_clip)
  loss = losses.aggregate(token_loss, mask, cfg.algo.loss_agg_mode, denominator,
                         micro.get("seq_tokens"))
  tokens = jnp.sum(mask, dtype=jnp.float32)
  aux = {k: v * tokens for k, v in metrics.items()}
  aux["value_loss"] = loss
  aux["tokens"] = tokens
  return cfg.algo.value_coef * loss, aux


def accumulate_gradients(loss_fn: Callable, params: Params, minibatch: Batch,
                         denominator: jax.Array, num_micro: int, mesh: Mesh | None = None,
                         micro_lengths: int = 1) -> tuple[jax.Array, Params, dict]:
  """Σ over micro-batches of (loss, grad, aux) of loss_fn(params, micro, denominator).

  With a denominator computed from the whole minibatch, the sum equals the loss and gradient
  of the minibatch in one piece; only peak memory depends on `num_micro`.

  Args:
    loss_fn: (params, micro-batch, denominator) -> (scalar loss, aux): aux a dict of scalar
      sums and of per-row arrays [m, ...] (e.g. `policy_loss`'s logprobs).
    params: parameters to differentiate.
    minibatch: dict of [M, ...] arrays, M divisible by num_micro.
    denominator: scalar, the global aggregation denominator.
    num_micro: micro-batches.
    mesh: when given, micro-batch rows stay split over its data-parallel axes.
    micro_lengths: row lengths a micro-batch may run at (`micro_length_choices`); aux's
      per-row arrays are then [m, L, ...].
  Returns:
    (loss, grads like params, aux): the scalars summed over micro-batches, the per-row arrays
    [M, ...] in the minibatch's row order.
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  per_item = rows_per_item(minibatch)
  micros = _constrain_rows(split_micro(minibatch, num_micro, per_item), mesh, row_axis=1)
  # (scalar sums, per-row arrays) of an aux dict
  split_aux = lambda aux: ({k: v for k, v in aux.items() if not v.ndim},
                           {k: v for k, v in aux.items() if v.ndim})

  def micro_gradients(micro):
    (loss, aux), grads = grad_fn(params, micro, denominator)
    sums, rows = split_aux(aux)
    return rows, (loss, grads, sums)

  lengths = micro_length_choices(minibatch["valid"].shape[1], micro_lengths)
  gradients = at_used_length(micro_gradients, lengths)

  def body(carry, micro):
    rows, summed = gradients(micro)
    return jax.tree.map(jnp.add, carry, summed), rows

  loss0, aux0 = jax.eval_shape(loss_fn, params, jax.tree.map(lambda x: x[0], micros),
                               denominator)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                       (loss0, params, split_aux(aux0)[0]))
  (loss, grads, sums), rows = jax.lax.scan(body, zeros, micros)
  return loss, grads, {**sums, **merge_micro(rows, per_item)}


def take_items(batch: Batch, items: jax.Array) -> Batch:
  """The rows of `batch` in items `items` [n] (rows_per_item rows each, in order), with their
  packed rows when the batch has them."""
  per_item = rows_per_item(batch)
  rows = (items[:, None] * per_item + jnp.arange(per_item)).reshape(-1)
  return _map_rows(batch, lambda x: jnp.take(x, rows, axis=0),
                   lambda x: jnp.take(x, items, axis=0))


@functools.partial(jax.jit, static_argnums=0)
def _optimizer_step(tx: optax.GradientTransformation, grads: Params, params: Params,
                    opt_state: Any) -> tuple[Params, Any]:
  """(params, opt_state) after one step of `tx` on `grads`. Jitted so that the two forms of
  `_apply_if_finite`, both traced, share one trace of the optimizer (a few hundred leaves)."""
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def step_unless(tx: optax.GradientTransformation, finite: jax.Array, grads: Params,
                params: Params, opt_state: Any, *, form: str) -> tuple[Params, Any]:
  """(params, opt_state) after one step of `tx` on `grads`, or unchanged where `finite` is
  False, in one of two forms that compute the same: "cond" (`lax.cond`) or "select" (the step,
  then a `jnp.where` of the new state and the old)."""
  step = lambda params, opt_state: _optimizer_step(tx, grads, params, opt_state)
  if form == "cond":
    return jax.lax.cond(finite, step, lambda *state: state, params, opt_state)
  keep = lambda new, old: jnp.where(finite, new, old)
  return jax.tree.map(keep, step(params, opt_state), (params, opt_state))


def _apply_if_finite(tx: optax.GradientTransformation, params: Params, opt_state: Any,
                     grads: Params, loss: jax.Array) -> tuple[Params, Any, jax.Array, jax.Array]:
  """One optimizer step, or none when the loss or the gradient is not finite.

  Returns (params, opt_state, grad_norm before clipping, skipped as float 0/1). A skipped step
  leaves parameters AND moments untouched (the optimizer's count does not advance either).
  """
  grad_norm = optax.global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  form = lambda name: functools.partial(step_unless, tx, finite, grads, form=name)
  # The form each compiler keeps one copy of the state with: XLA:CPU the cond (with the select,
  # which reads the old state after the new one exists, it copied both AdamW moments first:
  # 0.3 GiB more at 8,192 tokens of SmolLM2-135M), XLA:TPU the select (the cond held 2.4 GiB
  # more per chip for 7B ScalingInter's update on v4-32). Chosen when lowered for a platform.
  params, opt_state = jax.lax.platform_dependent(params, opt_state, cpu=form("cond"),
                                                 default=form("select"))
  return params, opt_state, grad_norm, 1.0 - finite.astype(jnp.float32)


def logprob_gap(logprobs: jax.Array, rollout_logprobs: jax.Array, mask: jax.Array
                ) -> dict[str, jax.Array]:
  """How far the trainer's log-probs are from the sampler's, over the agent tokens.

  Args:
    logprobs: [B, L] the trainer's forward (the old log-probs).
    rollout_logprobs: [B, L] the sampler's of the same tokens.
    mask: [B, L] agent tokens.
  Returns:
    `rollout/logprob_gap`, the mean |logprobs - rollout_logprobs|, and
    `rollout/logprob_gap_max`, its max (the token `algo.tis_cap` would weigh most); both 0
    without an agent token.
  """
  mask = jnp.asarray(mask).astype(bool)
  gap = jnp.where(mask, jnp.abs(jnp.asarray(logprobs, jnp.float32) - rollout_logprobs), 0.0)
  count = jnp.maximum(jnp.sum(mask, dtype=jnp.float32), 1.0)
  return {"rollout/logprob_gap": jnp.sum(gap) / count, "rollout/logprob_gap_max": jnp.max(gap)}


# ----- the update ------------------------------------------------------------------------------


def make_update_step(policy_def: nnx.GraphDef, critic_def: nnx.GraphDef | None,
                     optimizers: Optimizers, cfg: UpdateConfig, mesh: Mesh,
                     state_shardings: TrainState) -> Callable[[TrainState, Batch],
                                                              tuple[TrainState, dict]]:
  """The jitted update: (state, batch) -> (state after one trainer step, metrics).

  The state is donated (its buffers are reused for the new state), parameters keep the
  shardings of `state_shardings`, and the batch's rows are split over the data axes.

  Batch fields, each [R, L] with R divisible by minibatches x microbatches x data shards:
  tokens, valid, loss_mask, advantages; old_logprobs, or rollout_logprobs when the update's
  forward gives them (`AlgorithmSpec.old_logprobs_from_update`); ref_logprobs when the KL term
  is in the loss; returns, old_values with a critic; seq_tokens [R] with per-turn rows;
  scored_positions [R, P] when the LM head scores only the agent tokens (`Batch`). Rows are
  either layout: one packed row per episode, or one row per turn (rollout/window.py).

  Metrics (means over the step's optimizer updates): actor/{loss, pg_loss, entropy,
  clip_frac, clip_frac_lower, approx_kl, grad_norm, lr, skipped}, actor/kl with the KL term in
  the loss; with a critic critic/{value_loss, vf_clip_frac, grad_norm, lr, skipped}; when the
  old log-probs are the update's own, rollout/{logprob_gap, logprob_gap_max} (`logprob_gap`
  over the loss mask: the scoring pass that logs them otherwise did not run).
  `skipped` is the fraction of updates dropped for a non-finite loss or gradient; `lr` is the
  schedule at the update's index (steps done x updates per step + i), grad_norm is before
  clipping.
  """
  rows_spec = NamedSharding(mesh, P(sharding_lib.BATCH_AXES))
  policy_fn = functools.partial(policy_loss, graphdef=policy_def, cfg=cfg)
  critic_fn = (functools.partial(critic_loss, graphdef=critic_def, cfg=cfg)
               if cfg.algo.use_critic else None)

  def minibatch_update(batch: Batch, carry, xs):
    index, items = xs
    policy, opt_state, critic, critic_opt_state = carry
    minibatch = _constrain_rows(take_items(batch, items), mesh, row_axis=0)
    denominator = losses.aggregation_denominator(minibatch["loss_mask"], cfg.algo.loss_agg_mode,
                                                 seq_tokens=minibatch.get("seq_tokens"))
    loss, grads, aux = accumulate_gradients(policy_fn, policy, minibatch, denominator,
                                            cfg.microbatches, mesh, cfg.micro_lengths)
    policy, opt_state, grad_norm, skipped = _apply_if_finite(
        optimizers.policy, policy, opt_state, grads, loss)
    gap = (logprob_gap(aux.pop("logprobs"), minibatch["rollout_logprobs"],
                       minibatch["loss_mask"]) if cfg.algo.old_logprobs_from_update else {})
    tokens = jnp.maximum(aux.pop("tokens"), 1.0)
    metrics = {f"actor/{k}": v / tokens for k, v in aux.items() if k != "pg_loss"}
    metrics.update(gap)
    metrics.update({"actor/pg_loss": aux["pg_loss"], "actor/loss": loss,
                    "actor/grad_norm": grad_norm, "actor/skipped": skipped,
                    "actor/lr": optimizers.policy_lr(index)})
    if critic_fn is not None:
      loss, grads, aux = accumulate_gradients(critic_fn, critic, minibatch, denominator,
                                              cfg.microbatches, mesh, cfg.micro_lengths)
      critic, critic_opt_state, grad_norm, skipped = _apply_if_finite(
          optimizers.critic, critic, critic_opt_state, grads, loss)
      tokens = jnp.maximum(aux.pop("tokens"), 1.0)
      metrics.update({"critic/value_loss": aux["value_loss"],
                      "critic/vf_clip_frac": aux["vf_clip_frac"] / tokens,
                      "critic/grad_norm": grad_norm, "critic/skipped": skipped,
                      "critic/lr": optimizers.critic_lr(index)})
    return (policy, opt_state, critic, critic_opt_state), metrics

  def update(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
    # Rows are shuffled whole items at a time (a packed row's block stays together).
    num_items = batch["tokens"].shape[0] // rows_per_item(batch)
    key = step_key(state.rng, state.step, UPDATE_STREAM)
    orders = jnp.stack([jax.random.permutation(jax.random.fold_in(key, epoch), num_items)
                        for epoch in range(cfg.epochs)])
    orders = orders.reshape(cfg.updates_per_step, num_items // cfg.minibatches)
    # Optimizer updates made before this step: the learning-rate schedule's position.
    first = state.step * cfg.updates_per_step
    indices = first + jnp.arange(cfg.updates_per_step)
    carry = (state.policy, state.opt_state, state.critic, state.critic_opt_state)
    carry, metrics = jax.lax.scan(functools.partial(minibatch_update, batch), carry,
                                  (indices, orders))
    policy, opt_state, critic, critic_opt_state = carry
    new_state = state.replace(step=state.step + 1, policy=policy, opt_state=opt_state,
                              critic=critic, critic_opt_state=critic_opt_state)
    return new_state, jax.tree.map(jnp.mean, metrics)

  return jax.jit(sharding_lib.traced_under(mesh, update),
                 in_shardings=(state_shardings, rows_spec),
                 out_shardings=(state_shardings, NamedSharding(mesh, P())),
                 donate_argnums=(0,))


# ----- scoring passes ------------------------------------------------------------------------


def make_scorers(policy_def: nnx.GraphDef, critic_def: nnx.GraphDef | None, cfg: UpdateConfig,
                 mesh: Mesh) -> tuple[Callable, Callable | None]:
  """Jitted forward passes over a rollout batch, as many micro-batches at a time as the
  update's minibatches x microbatches, each at its own length (`cfg.micro_lengths`), in the
  update's compute dtype (so old log-probs are the update's at its first step).

  Both take (params, rows): rows a dict of the batch's tokens and valid [R, L], and
  scored_positions [R, P] when the head scores only those (`scored_positions`), the packed
  rows when the update has them (`packed_fields`); arrays split over the data axes.

  Returns:
    logprobs(params, rows) -> [R, L] float32, for reference and (unless the update's forward
      gives them, `AlgorithmSpec.old_logprobs_from_update`) old log-probs, at the rows'
      scored positions only (0 elsewhere), or at every position without them;
    values(params, rows) -> [R, L] float32 (None without a critic).
  """
  rows_spec = NamedSharding(mesh, P(sharding_lib.BATCH_AXES))
  chunks = cfg.minibatches * cfg.microbatches

  def scan_rows(fn, params, rows):
    per_item = rows_per_item(rows)
    micros = _constrain_rows(split_micro(rows, chunks, per_item), mesh, row_axis=1)
    run = at_used_length(lambda micro: (fn(params, micro), None),
                         micro_length_choices(rows["tokens"].shape[1], cfg.micro_lengths))
    _, out = jax.lax.scan(lambda c, micro: (c, run(micro)[0]), None, micros)
    return merge_micro(out, per_item)

  def logprob_fn(params, micro):
    model = nnx.merge(policy_def, as_compute(params, cfg.compute_dtype))
    return sequence_logprobs_and_entropy(model, micro, cfg.temperature)[0]

  def scorer(fn):
    return jax.jit(sharding_lib.traced_under(mesh, functools.partial(scan_rows, fn)),
                   in_shardings=(None, rows_spec), out_shardings=rows_spec)

  if critic_def is None:
    return scorer(logprob_fn), None
  return scorer(logprob_fn), scorer(
      lambda params, micro: critic_values(params, critic_def, micro, cfg.compute_dtype))
