"""Value model for PPO: the decoder backbone with a scalar head instead of the LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import Backbone, Segments, _param


class ValueModel(nnx.Module):
  """Per-token state values V(s_t) from a transformer backbone.

  The head starts at zero, so a fresh critic predicts 0 everywhere and its first updates come
  from the head alone instead of from a random projection of the features.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    """A fresh backbone from `rngs` (`train.sources.build_critic` then copies the policy's
    weights into it)."""
    self.cfg = cfg
    self.backbone = Backbone(cfg, rngs=rngs)
    self.head = _param(jnp.zeros((cfg.hidden_size,), cfg.dtype), ("embed",))
    self.head_bias = _param(jnp.zeros((), jnp.float32), ())

  def __call__(self, tokens: jax.Array, valid: jax.Array, segments: Segments | None = None
               ) -> jax.Array:
    """tokens [B, T] int32, valid [B, T] bool, optional packed rows' `Segments` -> values
    [B, T] float32."""
    hidden = self.backbone(tokens, valid, segments)
    values = jnp.einsum("btd,d->bt", hidden, self.head[...],
                        preferred_element_type=jnp.float32)
    return values + self.head_bias[...]
