"""The shapes of the published checkpoints the experiments name, without their files.

`agentgym_jax.plan` compiles a run for a TPU slice before anyone has downloaded its weights: it
needs the model's `config.json`, not the checkpoint. These are the fields of the
Hugging Face `config.json` of each model (Qwen/Qwen2.5-*-Instruct and
HuggingFaceTB/SmolLM2-135M-Instruct on the Hugging Face hub) that `ModelConfig.from_hf_config`
reads; a checkpoint directory on disk always takes precedence over this table.
"""

from __future__ import annotations

import os
from typing import Any

_QWEN25 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
               rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
               use_sliding_window=False, bos_token_id=151643, eos_token_id=151645)

HF_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B-Instruct": dict(
        _QWEN25, vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        tie_word_embeddings=True),
    "Qwen2.5-1.5B-Instruct": dict(
        _QWEN25, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        tie_word_embeddings=True),
    "Qwen2.5-3B-Instruct": dict(
        _QWEN25, vocab_size=151936, hidden_size=2048, intermediate_size=11008,
        num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
        tie_word_embeddings=True),
    "Qwen2.5-7B-Instruct": dict(
        _QWEN25, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        tie_word_embeddings=False),
    "Qwen2.5-14B-Instruct": dict(
        _QWEN25, vocab_size=152064, hidden_size=5120, intermediate_size=13824,
        num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
        tie_word_embeddings=False, rms_norm_eps=1e-5),
}


def hf_config(path: str) -> dict[str, Any]:
  """The config.json fields of the published model a checkpoint path names (its last part).

  Raises:
    ValueError: the name is not in `HF_CONFIGS` (the message lists those that are).
  """
  name = os.path.basename(os.path.normpath(path))
  if name not in HF_CONFIGS:
    raise ValueError(f"model.path {path!r} is not a checkpoint directory here and {name!r} is "
                     f"not a published model this table knows ({sorted(HF_CONFIGS)}); point "
                     "model.path at a directory holding its config.json.")
  return dict(HF_CONFIGS[name])
