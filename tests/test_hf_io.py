"""HF checkpoint import/export and config parsing, checked against transformers' PyTorch models."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentgym_jax.models import KVCache, ModelConfig, load_hf, save_hf
from agentgym_jax.models import hf_io

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

FAMILIES = {
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM",
                   dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "qwen2_untied": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(tie_word_embeddings=False, rope_theta=1e6)),
    # head_dim 24 != hidden / heads = 16: Qwen3 decouples them.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(head_dim=24, tie_word_embeddings=True, rope_theta=1e6)),
    # original_max_position_embeddings 16 puts the test positions into all three llama3 bands.
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(tie_word_embeddings=False, num_key_value_heads=1,
                    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                         low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=16))),
}


def write_checkpoint(path, family, seed=0, **overrides):
  """Saves a random tiny transformers model (config fields `overrides` changed); biases and
  norm scales are perturbed from their zero/one init so that a loader mixing them up cannot
  pass. Returns the torch model."""
  config_cls, model_cls, extra = FAMILIES[family]
  config = getattr(transformers, config_cls)(**{**_SMALL, **extra, **overrides})
  torch.manual_seed(seed)
  model = getattr(transformers, model_cls)(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "bias" in name or "norm" in name:
        p.add_(0.2 * torch.randn_like(p))
  model.save_pretrained(path)
  return model


def padded_batch(seed=0, lengths=(13, 8, 3, 1), vocab=256):
  t = max(lengths)
  tokens = np.random.RandomState(seed).randint(0, vocab, (len(lengths), t)).astype(np.int32)
  valid = np.arange(t)[None] < np.asarray(lengths)[:, None]
  return tokens, valid


# Tokens per row of each cached-forward call over padded_batch()'s rows of 13, 8, 3 and 1 tokens,
# in the order a rollout makes them: a prefill into a cache too small for what follows, the
# cache grown (to two of the decode step's 64-slot groups), single-token decode steps with idle
# rows, then a chunk at per-row offsets.
_SCHEDULE = ([5, 3, 2, 1], "grow", [1, 1, 0, 0], [1, 0, 1, 0], [6, 4, 0, 0])


def cached_logits(model, cfg, tokens):
  """Logits [B, T, V] of every real token through `Decoder.extend`, fed along _SCHEDULE (the
  cache in the model's dtype)."""
  extend = nnx.jit(lambda m, t, n, c: m.extend(t, n, c))
  cache = KVCache.init(cfg, tokens.shape[0], 8)
  out = np.zeros(tokens.shape + (cfg.vocab_size,), np.float32)
  done = np.zeros(tokens.shape[0], int)
  for num_new in _SCHEDULE:
    if num_new == "grow":
      cache = cache.grow(128)
      continue
    num_new = np.asarray(num_new)
    chunk = np.zeros((tokens.shape[0], num_new.max()), np.int32)
    for b, n in enumerate(num_new):
      chunk[b, :n] = tokens[b, done[b]:done[b] + n]
    logits, cache = extend(model, jnp.asarray(chunk), jnp.asarray(num_new, jnp.int32), cache)
    for b, n in enumerate(num_new):
      out[b, done[b]:done[b] + n] = logits[b, :n]
    done += num_new
  np.testing.assert_array_equal(cache.lengths, done)
  return out


def transformers_logits(torch_model, tokens, valid):
  with torch.no_grad():
    logits = torch_model(input_ids=torch.tensor(tokens, dtype=torch.long),
                         attention_mask=torch.tensor(valid, dtype=torch.long)).logits
  return logits.float().numpy()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(tmp_path, family):
  """The training forward and the cached forward of rollouts, each against transformers."""
  torch_model = write_checkpoint(tmp_path, family)
  cfg, model = load_hf(tmp_path)
  tokens, valid = padded_batch()
  ref = transformers_logits(torch_model, tokens, valid)
  # The reference must actually vary, or agreement would mean nothing.
  assert ref[valid].std() > 1e-2
  ours = np.asarray(model(jnp.asarray(tokens), jnp.asarray(valid)))
  assert ours.dtype == np.float32
  diff = np.abs(ours - ref)[valid].max()
  assert diff < 1e-4, f"{family}: max |logit diff| {diff}"
  diff = np.abs(cached_logits(model, cfg, tokens) - ref)[valid].max()
  assert diff < 1e-4, f"{family}, cached: max |logit diff| {diff}"


def test_a_long_prefill_in_padded_query_blocks_matches_transformers(tmp_path):
  """601 tokens into 2,048 slots overflow one block of attention scores (4 heads x 2,048 slots
  x 601 queries > 2^22), so each row's queries run in 2 blocks of 301, the last padded."""
  torch_model = write_checkpoint(tmp_path, "qwen3", max_position_embeddings=2048)
  cfg, model = load_hf(tmp_path)
  tokens = np.random.RandomState(1).randint(0, 256, (2, 601)).astype(np.int32)
  ref = transformers_logits(torch_model, tokens, np.ones_like(tokens, bool))
  logits, cache = nnx.jit(lambda m, t, n, c: m.extend(t, n, c))(
      model, jnp.asarray(tokens), jnp.full((2,), 601, jnp.int32), KVCache.init(cfg, 2, 2048))
  assert cfg.num_heads * 2048 * 601 > 1 << 22
  np.testing.assert_array_equal(cache.lengths, [601, 601])
  assert np.abs(np.asarray(logits) - ref).max() < 1e-4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bfloat16_logits_as_close_as_transformers_own(tmp_path, family):
  """bfloat16 weights (and cache): both forwards stay as close to the float32 logits as
  transformers' own bfloat16 model does."""
  torch_model = write_checkpoint(tmp_path, family)
  cfg, model = load_hf(tmp_path, dtype=jnp.bfloat16)
  tokens, valid = padded_batch()
  ref = transformers_logits(torch_model, tokens, valid)
  theirs = np.abs(transformers_logits(torch_model.to(torch.bfloat16), tokens, valid) - ref)
  ours = np.abs(np.asarray(model(jnp.asarray(tokens), jnp.asarray(valid))) - ref)
  cached = np.abs(cached_logits(model, cfg, tokens) - ref)
  for name, diff in (("forward", ours), ("cached", cached)):
    assert diff[valid].max() < 2 * theirs[valid].max(), (name, diff[valid].max())


def test_config_features_per_family(tmp_path):
  for family in FAMILIES:
    write_checkpoint(tmp_path / family, family)
  q2 = ModelConfig.from_hf_config(tmp_path / "qwen2_tied")
  assert (q2.model_type, q2.qkv_bias, q2.qk_norm, q2.tie_embeddings) == ("qwen2", True, False,
                                                                          True)
  assert ModelConfig.from_hf_config(tmp_path / "qwen2_untied").rope_theta == 1e6
  q3 = ModelConfig.from_hf_config(tmp_path / "qwen3" / "config.json")
  assert (q3.qkv_bias, q3.qk_norm, q3.head_dim) == (False, True, 24)
  ll = ModelConfig.from_hf_config(tmp_path / "llama3")
  assert dict(ll.rope_scaling) == dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=16.0)
  assert (ll.num_kv_heads, ll.rope_theta, ll.tie_embeddings) == (1, 500000.0, False)


@pytest.mark.parametrize("family", ["qwen2_untied", "qwen3"])
def test_round_trip_exact_and_transformers_loads_export(tmp_path, family):
  write_checkpoint(tmp_path / "in", family)
  cfg, model = load_hf(tmp_path / "in")
  save_hf(model, tmp_path / "out")
  cfg2, model2 = load_hf(tmp_path / "out")
  assert cfg2 == cfg
  for (p1, a), (p2, b) in zip(jax.tree.leaves_with_path(model), jax.tree.leaves_with_path(model2)):
    assert p1 == p2 and np.array_equal(np.asarray(a), np.asarray(b)), p1
  # Exported tensors equal the original HF tensors bit for bit.
  original = hf_io._SafetensorsDir(str(tmp_path / "in"))
  exported = hf_io._SafetensorsDir(str(tmp_path / "out"))
  assert set(exported.weight_map) <= set(original.weight_map)
  for name in exported.weight_map:
    np.testing.assert_array_equal(exported.get(name), original.get(name), err_msg=name)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  tokens, valid = padded_batch(seed=1)
  with torch.no_grad():
    ref = reloaded(input_ids=torch.tensor(tokens, dtype=torch.long),
                   attention_mask=torch.tensor(valid, dtype=torch.long)).logits.numpy()
  ours = np.asarray(model(jnp.asarray(tokens), jnp.asarray(valid)))
  assert np.abs(ours - ref)[valid].max() < 1e-4


def test_bfloat16_load_and_export(tmp_path):
  write_checkpoint(tmp_path / "in", "qwen2_tied")
  cfg, model = load_hf(tmp_path / "in", dtype=jnp.bfloat16)
  assert cfg.param_dtype == "bfloat16"
  assert {x.dtype for x in jax.tree.leaves(model)} == {jnp.dtype(jnp.bfloat16)}
  save_hf(model, tmp_path / "out")
  assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
  _, again = load_hf(tmp_path / "out", dtype=jnp.bfloat16)
  for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again)):
    assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  tokens, valid = padded_batch()
  _, full = load_hf(tmp_path / "in")
  logits = model(jnp.asarray(tokens), jnp.asarray(valid))
  assert logits.dtype == jnp.float32
  diff = np.abs(np.asarray(logits) - np.asarray(full(jnp.asarray(tokens), jnp.asarray(valid))))
  assert diff[valid].max() < 0.1  # bf16 rounding only


def test_sharded_index_checkpoint(tmp_path):
  torch_model = write_checkpoint(tmp_path / "single", "qwen2_untied")
  # max_shard_size small enough to split the 2-layer model over several files.
  torch_model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
  assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
  _, a = load_hf(tmp_path / "single")
  _, b = load_hf(tmp_path / "sharded")
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.array_equal(np.asarray(x), np.asarray(y))


def test_fuse_split_inverse():
  cfg = ModelConfig(vocab_size=8, hidden_size=12, intermediate_size=6, num_layers=1,
                    num_heads=6, num_kv_heads=2, head_dim=4)
  rng = np.random.RandomState(0)
  q, k, v = rng.randn(24, 12), rng.randn(8, 12), rng.randn(8, 12)
  fused = hf_io.fuse_qkv(cfg, q, k, v)
  assert fused.shape == (12, 40)
  # kv group 1 starts with query head 3 (heads 3, 4, 5 share kv head 1).
  np.testing.assert_array_equal(fused[:, 20:24], q[12:16].T)
  np.testing.assert_array_equal(fused[:, 32:36], k[4:8].T)
  for a, b in zip(hf_io.split_qkv(cfg, fused), (q, k, v)):
    np.testing.assert_array_equal(a, b)
  gate, up = rng.randn(6, 12), rng.randn(6, 12)
  gu = hf_io.fuse_gate_up(gate, up)
  np.testing.assert_array_equal(gu[:, 2], gate[1])
  np.testing.assert_array_equal(gu[:, 3], up[1])
  for a, b in zip(hf_io.split_gate_up(gu), (gate, up)):
    np.testing.assert_array_equal(a, b)


def test_missing_tensor_is_a_clear_error(tmp_path):
  write_checkpoint(tmp_path, "qwen2_tied")
  config = json.loads((tmp_path / "config.json").read_text())
  config["tie_word_embeddings"] = False
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(KeyError, match="lm_head.weight"):
    load_hf(tmp_path)


def test_export_keeps_rope_context_length_an_integer(tmp_path):
  """transformers warns when original_max_position_embeddings comes back as a float (32.0)."""
  write_checkpoint(tmp_path / "in", "llama3")
  _, model = load_hf(tmp_path / "in")
  save_hf(model, tmp_path / "out")
  with open(tmp_path / "out" / "config.json") as f:
    rope = json.load(f)["rope_parameters"]
  assert rope["original_max_position_embeddings"] == 16
  assert isinstance(rope["original_max_position_embeddings"], int)
  assert isinstance(rope["factor"], float)
