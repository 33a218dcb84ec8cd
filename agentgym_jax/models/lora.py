"""LoRA adapters of the decoder's projections (Hu et al. 2021, arXiv 2106.09685).

A block's projection y = x @ W (`decoder.Block`: the fused qkv, o, gate_up and down kernels)
becomes y = x @ W + (alpha / r) * (x @ A) @ B, with A [in, r] (He-uniform) and B [r, out]
(zeros), so fresh adapters leave the model's function unchanged. The adapters are flax NNX's
own `nnx.LoRA` modules without a base module (the block applies W and the adapter in
`Block._project`, through the same 2-D matmuls), their variables `nnx.LoRAParam`s with logical
axis names: A (in-axis, None), B (None, out-axis), so `agentgym_jax.sharding` places them like
their kernel (a rank-r axis is never split).

Training with adapters (train/state.py): the optimizer updates the LoRAParams only, the base
weights are frozen (the decoder reads them through `stop_gradient`), and the KL reference is
the same parameters with the adapters off (`adapters_off`: B = 0), so no second copy of the
weights exists. The export merges them (`merged`): W + (alpha / r) * A @ B.

A train state holds parameters as plain dicts, which keep no variable types: there an adapter
is a leaf named `lora_a` or `lora_b`, the names `nnx.LoRA` gives its LoRAParams
(`is_adapter`; a test checks it against the variable types).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# The leaf names of `nnx.LoRA`'s two LoRAParams.
A, B = "lora_a", "lora_b"


class Adapters(nnx.Module):
  """One `nnx.LoRA` per projection, as attributes named like the projections' kernels.

  Args:
    kernels: projection name -> (kernel shape [in, out], logical axis names (in, out)).
    rank: r.
  Adapters are float32 whatever the base dtype: they are what the optimizer trains.
  """

  def __init__(self, kernels: dict[str, tuple[tuple[int, int], tuple[str, str]]], rank: int,
               *, rngs: nnx.Rngs):
    for name, ((fan_in, fan_out), (in_axis, out_axis)) in kernels.items():
      setattr(self, name, nnx.LoRA(
          fan_in, rank, fan_out, param_dtype=jnp.float32, rngs=rngs,
          a_metadata={"out_sharding": (in_axis, None), "eager_sharding": False},
          b_metadata={"out_sharding": (None, out_axis), "eager_sharding": False}))


def is_adapter(path: tuple) -> bool:
  """Whether a pytree key path of a plain parameter dict ends at an adapter (A or B)."""
  last = path[-1]
  return getattr(last, "key", last) in (A, B)


# The top-level parameters of a decoder's (or a value model's) base transformer, which the
# decoder freezes when it has adapters; a value model's head is outside them and trains.
BASE_MODULES = ("backbone", "lm_head")


def trainable_labels(params: Any) -> Any:
  """A tree like `params` (a plain dict of a model with adapters) labelling each leaf
  "trained" (an adapter, or outside the base transformer, as a value head) or "frozen" (the
  base weights), for `optax.multi_transform`."""
  def label(path, _):
    base = getattr(path[0], "key", path[0]) in BASE_MODULES
    return "trained" if is_adapter(path) or not base else "frozen"
  return jax.tree_util.tree_map_with_path(label, params)


def adapters_off(params: Any) -> Any:
  """`params` (a plain dict) with every B zeroed: the base model's function. The base arrays
  are the same buffers, not copies."""
  def off(path, x):
    last = path[-1]
    return jnp.zeros_like(x) if getattr(last, "key", last) == B else x
  return jax.tree_util.tree_map_with_path(off, params)


def merged_kernel(kernel: jax.Array, adapter: nnx.LoRA, scale: float) -> jax.Array:
  """W + scale * A @ B [in, out], computed in float32 and returned in W's dtype."""
  delta = adapter.lora_a[...].astype(jnp.float32) @ adapter.lora_b[...].astype(jnp.float32)
  return (kernel.astype(jnp.float32) + scale * delta).astype(kernel.dtype)
