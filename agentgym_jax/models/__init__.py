"""Decoder models (Qwen2/2.5, Qwen3, Llama 3.x, SmolLM2), value model, KV cache, checkpoint IO.

    cfg = ModelConfig.from_hf_config(checkpoint_dir)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    logits = model(tokens, valid)                    # [B, T] -> [B, T, V] float32
    logits, cache = model.extend(tokens, num_new, cache)

`cfg.attention` picks the attention implementation ("auto": a Pallas kernel on TPU, else XLA);
a program compiled ahead of time for TPU on another host resolves it with
`resolve_attention(cfg.attention, "tpu")` (see `models.attention`).
"""

from agentgym_jax.models.attention import resolve_attention
from agentgym_jax.models.cache import KVCache
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import Decoder
from agentgym_jax.models.gguf_io import load_gguf
from agentgym_jax.models.hf_io import load_hf, save_hf
from agentgym_jax.models.value import ValueModel

__all__ = ["Decoder", "KVCache", "ModelConfig", "ValueModel", "load_gguf", "load_hf",
           "resolve_attention", "save_hf"]
