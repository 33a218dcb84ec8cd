"""Hugging Face safetensors checkpoints <-> `Decoder`.

Import reads tensors memory-mapped, one at a time, and places each onto its final sharding
(`sharding.put_global`: one device_put, or on several hosts each process's own shards), so a
checkpoint is never materialised whole on one device. The HF layout is per-projection
([out, in] matrices); ours fuses q/k/v and gate/up into 2-D [in, out] kernels (see
decoder.py), so import concatenates and export splits. Export merges LoRA adapters into their
kernels (`models.lora`), so transformers loads a plain model.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from agentgym_jax import sharding as sharding_lib
from agentgym_jax.models import lora
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import PROJECTIONS, Decoder

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


# --- layout transforms (numpy, host side) -------------------------------------------------


def fuse_qkv(cfg: ModelConfig, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
  """HF q/k/v weights [H*Dh, D], [K*Dh, D], [K*Dh, D] (or biases [H*Dh], ...) -> fused.

  Weights become [D, K * (G + 2) * Dh], biases [K * (G + 2) * Dh]: per kv head, its G query
  heads, then its key, then its value.
  """
  kh, g, dh = cfg.num_kv_heads, cfg.group_size, cfg.head_dim
  lead = q.shape[1:]  # (D,) for weights, () for biases
  parts = [q.reshape(kh, g, dh, *lead), k.reshape(kh, 1, dh, *lead),
           v.reshape(kh, 1, dh, *lead)]
  fused = np.concatenate(parts, axis=1).reshape(kh * (g + 2) * dh, *lead)
  return fused.T if lead else fused


def split_qkv(cfg: ModelConfig, fused: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Inverse of `fuse_qkv`: returns HF-layout q, k, v."""
  kh, g, dh = cfg.num_kv_heads, cfg.group_size, cfg.head_dim
  x = fused.T if fused.ndim == 2 else fused
  lead = x.shape[1:]
  x = x.reshape(kh, g + 2, dh, *lead)
  q = x[:, :g].reshape(kh * g * dh, *lead)
  k = x[:, g].reshape(kh * dh, *lead)
  v = x[:, g + 1].reshape(kh * dh, *lead)
  return q, k, v


def fuse_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
  """HF gate/up [F, D] -> [D, F * 2], gate and up interleaved per unit."""
  return np.stack([gate.T, up.T], axis=-1).reshape(gate.shape[1], -1)


def split_gate_up(fused: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Inverse of `fuse_gate_up`: returns HF gate, up [F, D]."""
  x = fused.reshape(fused.shape[0], -1, 2)
  return x[..., 0].T, x[..., 1].T


# --- name mapping --------------------------------------------------------------------------


def hf_param_plan(cfg: ModelConfig) -> dict[tuple, tuple[tuple[str, ...], Callable]]:
  """Our parameter path -> (HF tensor names it is built from, numpy builder)."""
  ident = lambda x: x
  transpose = lambda x: x.T
  plan = {("backbone", "embed"): (("model.embed_tokens.weight",), ident),
          ("backbone", "final_norm", "scale"): (("model.norm.weight",), ident)}
  for i in range(cfg.num_layers):
    hf = f"model.layers.{i}."
    ours = ("backbone", "layers", i)
    attn = hf + "self_attn."
    plan[ours + ("attn_norm", "scale")] = ((hf + "input_layernorm.weight",), ident)
    plan[ours + ("mlp_norm", "scale")] = ((hf + "post_attention_layernorm.weight",), ident)
    plan[ours + ("qkv",)] = (tuple(attn + f"{p}_proj.weight" for p in "qkv"),
                             lambda q, k, v: fuse_qkv(cfg, q, k, v))
    if cfg.qkv_bias:
      plan[ours + ("qkv_bias",)] = (tuple(attn + f"{p}_proj.bias" for p in "qkv"),
                                    lambda q, k, v: fuse_qkv(cfg, q, k, v))
    if cfg.qk_norm:
      plan[ours + ("q_norm", "scale")] = ((attn + "q_norm.weight",), ident)
      plan[ours + ("k_norm", "scale")] = ((attn + "k_norm.weight",), ident)
    plan[ours + ("o",)] = ((attn + "o_proj.weight",), transpose)
    plan[ours + ("gate_up",)] = ((hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                                 fuse_gate_up)
    plan[ours + ("down",)] = ((hf + "mlp.down_proj.weight",), transpose)
  if not cfg.tie_embeddings:
    plan[("lm_head",)] = (("lm_head.weight",), transpose)
  return plan


def _host_copy(x: jax.Array) -> np.ndarray:
  # On several hosts a sharded parameter is gathered first; every process gets all of it.
  if not x.is_fully_addressable:
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def to_hf_tensors(model: Decoder) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (HF name, numpy array) for every tensor of `model`, in HF layout; LoRA adapters
  are merged into their kernels (W + alpha / r * A @ B), so the export is a plain model."""
  cfg = model.cfg
  flat = {tuple(path): _host_copy(var[...])
          for path, var in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.LoRAParam)))}
  for i, block in enumerate(model.backbone.layers):
    if block.lora is None:
      continue
    for name in PROJECTIONS:
      flat[("backbone", "layers", i, name)] = _host_copy(lora.merged_kernel(
          getattr(block, name)[...], getattr(block.lora, name), cfg.lora_scale))
  for path, (names, _) in hf_param_plan(cfg).items():
    value = flat[path]
    if path[-1] in ("qkv", "qkv_bias"):
      parts = split_qkv(cfg, value)
    elif path[-1] == "gate_up":
      parts = split_gate_up(value)
    elif path[-1] in ("o", "down", "lm_head"):
      parts = (value.T,)
    else:
      parts = (value,)
    for name, part in zip(names, parts):
      yield name, np.ascontiguousarray(part)


# --- reading -------------------------------------------------------------------------------


class _SafetensorsDir:
  """Memory-mapped view of a checkpoint's tensors (single file or sharded index)."""

  def __init__(self, directory: str):
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    elif os.path.exists(single):
      weight_map = None
    else:
      raise FileNotFoundError(f"{directory} has neither model.safetensors nor "
                              "model.safetensors.index.json.")
    files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
    self._handles = {f: safetensors.safe_open(os.path.join(directory, f), framework="numpy")
                     for f in files}
    if weight_map is None:
      weight_map = {k: files[0] for k in self._handles[files[0]].keys()}
    self.weight_map = weight_map

  def get(self, name: str) -> np.ndarray:
    if name not in self.weight_map:
      raise KeyError(f"Checkpoint lacks tensor {name!r} (a tied/untied or family mismatch "
                     "between config.json and the weights?).")
    return self._handles[self.weight_map[name]].get_tensor(name)


def load_hf(checkpoint_dir: str | os.PathLike, mesh: Mesh | None = None,
            dtype: jnp.dtype = jnp.float32) -> tuple[ModelConfig, Decoder]:
  """Loads an HF Qwen2/Qwen3/Llama checkpoint directory into a `Decoder`.

  Args:
    checkpoint_dir: directory with config.json and model.safetensors (or a sharded index).
    mesh: when given, each parameter lands directly on its sharding from the logical-axis
      rules; otherwise on the default device.
    dtype: parameter dtype (float32 or bfloat16); tensors are converted on the host.

  Returns:
    (config, model).
  """
  checkpoint_dir = os.fspath(checkpoint_dir)
  cfg = ModelConfig.from_hf_config(checkpoint_dir, param_dtype=jnp.dtype(dtype).name)
  reader = _SafetensorsDir(checkpoint_dir)
  return cfg, build_from_tensors(cfg, reader.get, mesh)


def build_from_tensors(cfg: ModelConfig, get: Callable[[str], np.ndarray],
                       mesh: Mesh | None = None) -> Decoder:
  """Builds a `Decoder` from HF-named tensors fetched one at a time by `get(name)`."""
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
  shardings = sharding_lib.state_shardings(abstract, mesh) if mesh is not None else None
  plan = hf_param_plan(cfg)
  target = _NP_DTYPES[cfg.param_dtype]
  flat = nnx.to_flat_state(abstract)
  flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
  leaves = []
  for path, var in flat:
    if path not in plan:
      raise KeyError(f"No HF mapping for parameter {path}.")
    names, build = plan[path]
    value = np.asarray(build(*(get(n) for n in names))).astype(target)
    if value.shape != var.shape:
      raise ValueError(f"{names} give shape {value.shape} for {path}, expected {var.shape}: "
                       "config.json does not match the weights.")
    placement = flat_shardings[path].get_value() if path in flat_shardings else None
    # put_global: on several hosts each process places only its own devices' shards.
    leaves.append((path, var.replace(sharding_lib.put_global(value, placement))))
  return nnx.merge(graphdef, nnx.from_flat_state(leaves))


# --- writing -------------------------------------------------------------------------------


def save_hf(model: Decoder, checkpoint_dir: str | os.PathLike,
            extra_config: Mapping | None = None) -> None:
  """Writes config.json and model.safetensors that transformers' AutoModelForCausalLM loads.

  Tensors keep the model's parameter dtype. `extra_config` entries are merged into config.json.
  """
  checkpoint_dir = os.fspath(checkpoint_dir)
  os.makedirs(checkpoint_dir, exist_ok=True)
  hf_config = model.cfg.to_hf_config()
  hf_config.update(extra_config or {})
  with open(os.path.join(checkpoint_dir, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  tensors = dict(to_hf_tensors(model))
  safetensors.numpy.save_file(tensors, os.path.join(checkpoint_dir, "model.safetensors"),
                              metadata={"format": "pt"})
