"""Value model for PPO: the decoder backbone with a scalar head instead of the LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import Backbone, Decoder, _param


class ValueModel(nnx.Module):
  """Per-token state values V(s_t) from a transformer backbone.

  The head starts at zero, so a fresh critic predicts 0 everywhere and its first updates come
  from the head alone instead of from a random projection of the features.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, backbone: Backbone | None = None):
    """A fresh backbone from `rngs`, or the given `backbone` (used as is, not copied)."""
    self.cfg = cfg
    self.backbone = Backbone(cfg, rngs=rngs) if backbone is None else backbone
    self.head = _param(jnp.zeros((cfg.hidden_size,), cfg.dtype), ("embed",))
    self.head_bias = _param(jnp.zeros((), jnp.float32), ())

  def __call__(self, tokens: jax.Array, valid: jax.Array) -> jax.Array:
    """tokens [B, T] int32, valid [B, T] bool -> values [B, T] float32."""
    hidden = self.backbone(tokens, valid)
    values = jnp.einsum("btd,d->bt", hidden, self.head[...],
                        preferred_element_type=jnp.float32)
    return values + self.head_bias[...]

  @classmethod
  def from_policy(cls, policy: Decoder, *, rngs: nnx.Rngs) -> "ValueModel":
    """A value model whose backbone starts as a copy of `policy`'s.

    The weights are copied, not shared, so donating one model's buffers in a jitted update
    never invalidates the other's.
    """
    graphdef, state = nnx.split(policy.backbone)
    backbone = nnx.merge(graphdef, jax.tree.map(lambda x: jnp.array(x, copy=True), state))
    return cls(policy.cfg, rngs=rngs, backbone=backbone)
