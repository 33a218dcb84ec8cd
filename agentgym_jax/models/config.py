"""Model hyper-parameters, read from a Hugging Face `config.json` or written by hand.

One `ModelConfig` describes every supported family: Qwen2/Qwen2.5 (q/k/v biases), Qwen3 (q/k
RMSNorm over head_dim, head_dim independent of hidden_size), Llama 3.x (llama3 RoPE frequency
scaling) and SmolLM2 (Llama architecture). Features another checkpoint would need (sliding-window
attention, other RoPE types, MLP/output biases) are rejected with a message rather than silently
ignored, because ignoring them gives a model that loads but computes something else.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from agentgym_jax.models import attention

# model_type -> (q/k/v biases, q/k RMSNorm)
_FAMILIES = {
    "qwen2": (True, False),
    "qwen3": (False, True),
    "llama": (False, False),
}
_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}
_DTYPES = ("float32", "bfloat16")
# How the training forward runs the blocks: "auto" (scan on accelerators, unrolled on CPU),
# "scan" or "unroll" (`decoder.resolve_layer_loop`).
LAYER_LOOPS = ("auto", "scan", "unroll")
MATMUL_PRECISIONS = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder hyper-parameters (hashable, so it can be a static jit argument).

  Attributes:
    vocab_size: rows of the embedding table.
    hidden_size: model width D.
    intermediate_size: SwiGLU width F.
    num_layers: decoder blocks.
    num_heads: query heads H.
    num_kv_heads: key/value heads K (H must be a multiple of K; GQA).
    head_dim: per-head width Dh (Qwen3 decouples it from D / H).
    rope_theta: RoPE base.
    rope_scaling: None or a sorted tuple of (key, value) pairs of llama3 scaling parameters
      (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
    rms_norm_eps: epsilon of every RMSNorm.
    tie_embeddings: LM head shares the embedding matrix.
    qkv_bias: q/k/v projections have biases (Qwen2).
    qk_norm: RMSNorm over head_dim on queries and keys before RoPE (Qwen3).
    max_position_embeddings: informational; written back on export.
    model_type: HF family name used on export ("qwen2", "qwen3", "llama").
    param_dtype: "float32" or "bfloat16"; activations follow it, logits are float32.
    remat: recompute each block's activations in the backward pass (saves memory).
    layer_loop: the training forward's blocks as a `lax.scan` ("scan"), a Python loop
      ("unroll") or "auto" (`decoder.resolve_layer_loop`).
    attention: "auto" or a kernel of `models.attention.KERNELS` ("blockwise", "xla", "cudnn",
      "pallas", ...); "auto" resolves when a program is traced, per backend
      (`attention.resolve_attention`).
    matmul_precision: the projections' and LM head's matmuls on float32 activations: "float32"
      (exact), or "bfloat16" (operands rounded to bf16, products summed in float32: what TPUs do
      for float32 matmuls at default precision; `decoder.dot`). No effect on bf16 activations.
    initializer_range: std of the normal initialiser for fresh weights.
    lora_rank: rank r of the LoRA adapters on the attention and MLP projections (`models.lora`);
      0 (the default) is no adapters. With adapters the base weights are frozen.
    lora_alpha: the adapters' scale is lora_alpha / lora_rank (Hu et al. 2021); > 0.
    bos_token_id, eos_token_id, pad_token_id: carried through for export only.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int | None = None
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, float | int], ...] | None = None
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = True
  qkv_bias: bool = False
  qk_norm: bool = False
  max_position_embeddings: int = 4096
  model_type: str = "llama"
  param_dtype: str = "float32"
  remat: bool = False
  attention: str = "auto"
  layer_loop: str = "auto"
  matmul_precision: str = "float32"
  initializer_range: float = 0.02
  lora_rank: int = 0
  lora_alpha: float = 16.0
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None

  def __post_init__(self):
    if self.head_dim is None:
      if self.hidden_size % self.num_heads:
        raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads "
                         f"{self.num_heads}; set head_dim explicitly.")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads "
                       f"{self.num_kv_heads} (grouped-query attention).")
    if self.head_dim % 2:
      raise ValueError(f"head_dim {self.head_dim} must be even for RoPE.")
    if self.param_dtype not in _DTYPES:
      raise ValueError(f"param_dtype {self.param_dtype!r} is not one of {_DTYPES}.")
    attention.check_attention(self.attention)
    if self.layer_loop not in LAYER_LOOPS:
      raise ValueError(f"layer_loop {self.layer_loop!r} is not one of {LAYER_LOOPS}.")
    if self.matmul_precision not in MATMUL_PRECISIONS:
      raise ValueError(f"matmul_precision {self.matmul_precision!r} is not one of "
                       f"{MATMUL_PRECISIONS}.")
    if self.lora_rank < 0:
      raise ValueError(f"lora_rank must be >= 0 (0 turns LoRA off), got {self.lora_rank}.")
    if self.lora_alpha <= 0:
      raise ValueError(f"lora_alpha must be > 0 (the adapters' scale is lora_alpha / "
                       f"lora_rank), got {self.lora_alpha}.")
    if self.model_type not in _FAMILIES:
      raise ValueError(f"model_type {self.model_type!r} is not one of {sorted(_FAMILIES)}.")
    if self.rope_scaling is not None:
      object.__setattr__(self, "rope_scaling", _rope_scaling_items(self.rope_scaling))
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

  @property
  def dtype(self) -> jnp.dtype:
    """Parameter and activation dtype."""
    return jnp.dtype(self.param_dtype)

  @property
  def lora_scale(self) -> float:
    """alpha / r: what the adapters' product is multiplied by (0 without adapters)."""
    return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

  @property
  def group_size(self) -> int:
    """Query heads per key/value head."""
    return self.num_heads // self.num_kv_heads

  @property
  def num_params(self) -> int:
    """Parameter count (the LM head counted once when tied)."""
    d, f, dh = self.hidden_size, self.intermediate_size, self.head_dim
    qkv = d * (self.num_heads + 2 * self.num_kv_heads) * dh
    per_layer = qkv + self.num_heads * dh * d + 3 * d * f + 2 * d
    per_layer += (self.num_heads + 2 * self.num_kv_heads) * dh if self.qkv_bias else 0
    per_layer += 2 * dh if self.qk_norm else 0
    head = 0 if self.tie_embeddings else d * self.vocab_size
    return self.vocab_size * d + self.num_layers * per_layer + d + head

  def inv_freq(self) -> np.ndarray:
    """RoPE inverse frequencies [head_dim // 2] float32, as transformers computes them."""
    dim = self.head_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(self.rope_theta) ** exponent)).astype(np.float32)
    if self.rope_scaling is None:
      return inv_freq
    s = dict(self.rope_scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)

  @classmethod
  def from_hf_config(cls, source: str | os.PathLike | Mapping[str, Any], **overrides
                     ) -> "ModelConfig":
    """Builds a config from an HF checkpoint directory, a config.json path or its dict.

    Accepts `rope_theta` at the top level (older files, real Qwen2.5/Llama checkpoints) or in
    `rope_parameters` (transformers 5), and llama3 scaling in `rope_scaling` or
    `rope_parameters`. `overrides` replace fields afterwards (e.g. param_dtype="bfloat16").
    """
    if isinstance(source, Mapping):
      hf = dict(source)
    else:
      path = os.fspath(source)
      if os.path.isdir(path):
        path = os.path.join(path, "config.json")
      if not os.path.exists(path):
        raise FileNotFoundError(f"No HF config at {path}: pass a checkpoint directory holding "
                                "config.json, the file itself, or its parsed dict.")
      with open(path) as f:
        hf = json.load(f)
    model_type = _model_type(hf)
    default_bias, qk_norm = _FAMILIES[model_type]
    _reject_unsupported(hf, model_type)
    theta, scaling = _rope(hf)
    num_heads = hf["num_attention_heads"]
    fields = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=default_bias,  # other bias layouts are rejected above
        qk_norm=qk_norm,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        model_type=model_type,
        initializer_range=hf.get("initializer_range", 0.02),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
    )
    fields.update(overrides)
    return cls(**fields)

  def to_hf_config(self) -> dict[str, Any]:
    """The config.json dict transformers needs to rebuild this model."""
    arch = {v: k for k, v in _ARCHITECTURES.items()}[self.model_type]
    rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
    if self.rope_scaling is not None:
      rope.update(dict(self.rope_scaling), rope_type="llama3")
    hf = dict(
        architectures=[arch],
        model_type=self.model_type,
        vocab_size=self.vocab_size,
        hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size,
        num_hidden_layers=self.num_layers,
        num_attention_heads=self.num_heads,
        num_key_value_heads=self.num_kv_heads,
        head_dim=self.head_dim,
        hidden_act="silu",
        max_position_embeddings=self.max_position_embeddings,
        rms_norm_eps=self.rms_norm_eps,
        tie_word_embeddings=self.tie_embeddings,
        rope_theta=self.rope_theta,
        rope_parameters=rope,
        initializer_range=self.initializer_range,
        bos_token_id=self.bos_token_id,
        eos_token_id=list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
        else self.eos_token_id,
        pad_token_id=self.pad_token_id,
        dtype=self.param_dtype,
    )
    if self.model_type != "qwen2":
      hf["attention_bias"] = self.qkv_bias
    if self.model_type == "qwen2":
      hf["use_sliding_window"] = False
    return hf


def _model_type(hf: Mapping[str, Any]) -> str:
  model_type = hf.get("model_type")
  if model_type is None:
    for arch in hf.get("architectures") or ():
      if arch in _ARCHITECTURES:
        model_type = _ARCHITECTURES[arch]
  if model_type not in _FAMILIES:
    raise ValueError(f"Unsupported model_type {model_type!r} (architectures "
                     f"{hf.get('architectures')}); supported: {sorted(_FAMILIES)} "
                     "(SmolLM2 is 'llama').")
  return model_type


def _reject_unsupported(hf: Mapping[str, Any], model_type: str) -> None:
  if hf.get("use_sliding_window") or (model_type != "qwen2" and hf.get("sliding_window")):
    raise ValueError("Sliding-window attention is not supported; use a checkpoint with "
                     "use_sliding_window=false.")
  layer_types = hf.get("layer_types") or ()
  if any(t != "full_attention" for t in layer_types):
    raise ValueError(f"Only full attention layers are supported, got layer_types "
                     f"{sorted(set(layer_types))}.")
  if hf.get("mlp_bias"):
    raise ValueError("mlp_bias=true is not supported (no supported family uses MLP biases).")
  if model_type != "qwen2" and hf.get("attention_bias"):
    raise ValueError(f"attention_bias=true for {model_type} adds an output-projection bias, "
                     "which is not supported.")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"hidden_act {act!r} is not supported; only SwiGLU ('silu').")
  for key in ("partial_rotary_factor",):
    if hf.get(key, 1.0) != 1.0 or (hf.get("rope_parameters") or {}).get(key, 1.0) != 1.0:
      raise ValueError(f"{key} != 1 is not supported (RoPE over the full head_dim only).")


def _rope(hf: Mapping[str, Any]) -> tuple[float, tuple[tuple[str, float], ...] | None]:
  params = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or {})
  theta = hf.get("rope_theta", params.get("rope_theta", scaling.get("rope_theta")))
  if theta is None:
    raise ValueError("config has neither rope_theta nor rope_parameters.rope_theta.")
  merged = {**params, **scaling}
  rope_type = merged.get("rope_type", merged.get("type", "default"))
  if rope_type == "default":
    return float(theta), None
  if rope_type != "llama3":
    raise ValueError(f"RoPE type {rope_type!r} is not supported; only 'default' and 'llama3'.")
  keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
  missing = [k for k in keys if k not in merged]
  if missing:
    raise ValueError(f"llama3 rope scaling lacks {missing}.")
  return float(theta), _rope_scaling_items({k: merged[k] for k in keys})


def _rope_scaling_items(scaling) -> tuple[tuple[str, float | int], ...]:
  """llama3 scaling as sorted (key, value) pairs: the context length an int (transformers
  warns on reading a float one back), the factors floats."""
  return tuple(sorted((k, int(v) if k == "original_max_position_embeddings" else float(v))
                      for k, v in dict(scaling).items()))
