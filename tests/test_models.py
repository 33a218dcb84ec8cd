"""Decoder, KV cache, value model and config parsing on tiny random configs (no torch needed)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentgym_jax.models import Decoder, KVCache, ModelConfig, ValueModel
from agentgym_jax.models import attention as attention_lib
from agentgym_jax.models.decoder import Backbone, RMSNorm, Segments, apply_rope, rope_tables

TINY = ModelConfig(vocab_size=128, hidden_size=48, intermediate_size=80, num_layers=2,
                   num_heads=6, num_kv_heads=2, head_dim=8, qkv_bias=True, qk_norm=True,
                   tie_embeddings=False, model_type="qwen3")


def _randomize(model, seed=1):
  """Perturbs every parameter (biases start at zero, norms at one) so that no code path hides."""
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  nnx.update(model, jax.tree.unflatten(treedef, noisy))
  return model


def _make(cfg, seed=0, randomize=True):
  """Builds (and perturbs) a model under jit: eager creation dispatches op by op."""
  make = lambda: Decoder(cfg, rngs=nnx.Rngs(seed))
  return nnx.jit(lambda: _randomize(make()) if randomize else make())()


# Jitted entry points; the models are pytrees of arrays, so these compile once per shape.
_forward = nnx.jit(lambda m, t, v: m(t, v))
_extend = nnx.jit(lambda m, t, n, c: m.extend(t, n, c))


@pytest.fixture(scope="module")
def model():
  return _make(TINY)


def _batch(lengths, seed=0, vocab=TINY.vocab_size):
  t = max(lengths)
  tokens = jax.random.randint(jax.random.key(seed), (len(lengths), t), 0, vocab)
  valid = jnp.arange(t)[None] < jnp.asarray(lengths)[:, None]
  return tokens.astype(jnp.int32), valid


def test_forward_shapes_and_dtypes(model):
  tokens, valid = _batch([7, 3])
  logits = _forward(model, tokens, valid)
  assert logits.shape == (2, 7, TINY.vocab_size) and logits.dtype == jnp.float32
  hidden = nnx.jit(lambda m: m.backbone(tokens, valid))(model)
  assert hidden.shape == (2, 7, TINY.hidden_size)
  np.testing.assert_allclose(nnx.jit(lambda m: m.logits_from_hidden(hidden))(model), logits,
                             atol=1e-6)
  assert TINY.num_params == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_padding_and_future_tokens_do_not_leak(model):
  tokens, valid = _batch([9, 5, 2])
  logits = _forward(model, tokens, valid)
  # Garbage (even out-of-range ids) in the padding changes nothing at valid positions.
  junk = jnp.where(valid, tokens, jnp.array([[-5], [10_000], [3]]))
  np.testing.assert_allclose(np.asarray(_forward(model, junk, valid))[np.asarray(valid)],
                             np.asarray(logits)[np.asarray(valid)], atol=1e-5)
  # A row alone and unpadded gives the same logits as inside the padded batch.
  alone = _forward(model, tokens[1:2, :5], valid[1:2, :5])
  np.testing.assert_allclose(alone[0], logits[1, :5], atol=1e-5)
  # Causality: changing token 6 leaves positions 0..5 untouched, but moves position 6.
  changed = _forward(model, tokens.at[0, 6].set((tokens[0, 6] + 1) % TINY.vocab_size), valid)
  np.testing.assert_allclose(changed[0, :6], logits[0, :6], atol=1e-6)
  assert np.abs(changed[0, 6] - logits[0, 6]).max() > 1e-3


def test_prefill_then_token_by_token_decode_matches_full_forward(model):
  lengths = [10, 6, 8]
  tokens, valid = _batch(lengths, seed=2)
  full = np.asarray(_forward(model, tokens, valid))
  prompt = np.array([4, 1, 3])
  cache = KVCache.init(TINY, batch_size=3, max_len=12)
  prompt_tokens = jnp.where(jnp.arange(4)[None] < prompt[:, None], tokens[:, :4], 0)
  logits, cache = _extend(model, prompt_tokens, jnp.asarray(prompt), cache)
  got = {(b, t): logits[b, t] for b in range(3) for t in range(prompt[b])}
  pos = prompt.copy()
  while (pos < lengths).any():
    active = pos < lengths
    step = np.where(active, np.asarray(tokens)[np.arange(3), np.minimum(pos, 9)], 0)
    logits, cache = _extend(model, jnp.asarray(step[:, None]), jnp.asarray(active, jnp.int32),
                           cache)
    for b in np.flatnonzero(active):
      got[(b, pos[b])] = logits[b, 0]
    pos += active
  np.testing.assert_array_equal(cache.lengths, lengths)
  for (b, t), value in got.items():
    np.testing.assert_allclose(value, full[b, t], atol=1e-4, err_msg=f"row {b} pos {t}")
  assert len(got) == sum(lengths)


def test_chunks_at_per_row_offsets_match_full_forward(model):
  lengths = np.array([11, 7, 9])
  tokens, valid = _batch(list(lengths), seed=3)
  full = np.asarray(_forward(model, tokens, valid))
  seq = np.asarray(tokens)
  schedule = np.array([[4, 2, 5], [0, 3, 4], [7, 2, 0]])  # row b takes schedule[i, b] tokens
  assert (schedule.sum(0) == lengths).all()
  chunk_len = 7
  cache = KVCache.init(TINY, batch_size=3, max_len=16)
  rng = np.random.RandomState(0)
  done = np.zeros(3, int)
  for num_new in schedule:
    # Padding inside the chunk is random tokens: it must not matter.
    chunk = rng.randint(0, TINY.vocab_size, (3, chunk_len))
    for b in range(3):
      chunk[b, :num_new[b]] = seq[b, done[b]:done[b] + num_new[b]]
    logits, cache = _extend(model, jnp.asarray(chunk, jnp.int32), jnp.asarray(num_new), cache)
    for b in range(3):
      np.testing.assert_allclose(logits[b, :num_new[b]], full[b, done[b]:done[b] + num_new[b]],
                                 atol=1e-4)
    done += num_new
    np.testing.assert_array_equal(cache.lengths, done)


def test_writes_past_cache_end_are_dropped(model):
  cache = KVCache.init(TINY, batch_size=1, max_len=8)
  tokens, valid = _batch([8], seed=4)
  _, cache = _extend(model, tokens[:, :6], jnp.array([6]), cache)
  before = [np.asarray(k[..., :6]) for k in cache.k]
  # Chunk of 4 at offset 6 with 2 real tokens: slots 8, 9 do not exist; nothing shifts back.
  chunk = jnp.concatenate([tokens[:, 6:8], jnp.zeros((1, 2), jnp.int32)], axis=1)
  logits, cache = _extend(model, chunk, jnp.array([2]), cache)
  for k, k_before in zip(cache.k, before):
    np.testing.assert_array_equal(np.asarray(k[..., :6]), k_before)
  np.testing.assert_allclose(logits[0, :2], _forward(model, tokens, valid)[0, 6:8], atol=1e-4)


def test_kv_cache_init_grow_and_donation(model):
  bf16 = dataclasses.replace(TINY, param_dtype="bfloat16")  # the cache takes the model's dtype
  cache = KVCache.init(bf16, batch_size=3, max_len=16)
  assert len(cache.k) == len(cache.v) == TINY.num_layers
  assert cache.k[0].shape == (3, 2, 8, 16) and cache.v[0].shape == (3, 2, 16, 8)
  assert cache.k[0].dtype == jnp.bfloat16
  assert cache.lengths.dtype == jnp.int32 and cache.max_len == 16
  pointers = {x.unsafe_buffer_pointer() for x in cache.k + cache.v}
  assert len(pointers) == 2 * TINY.num_layers
  graphdef, state = nnx.split(_make(bf16, randomize=False))
  step = jax.jit(lambda s, t, n, c: nnx.merge(graphdef, s).extend(t, n, c), donate_argnums=3)
  _, new = step(state, jnp.ones((3, 2), jnp.int32), jnp.array([2, 1, 0]), cache)
  np.testing.assert_array_equal(new.lengths, [2, 1, 0])
  assert new.k[0].dtype == jnp.bfloat16
  # A grown cache holds the same tokens and continues as a cache that was never small. The two
  # sizes are two compiled programs, which XLA may fuse differently on some CPUs: equal to
  # float32 rounding, not bit for bit (seen: 9e-7 on an AMD EPYC).
  tokens, _ = _batch([9, 9, 9], seed=6)
  small = _extend(model, tokens[:, :5], jnp.array([5, 3, 0]), KVCache.init(TINY, 3, 8))[1]
  large = _extend(model, tokens[:, :5], jnp.array([5, 3, 0]), KVCache.init(TINY, 3, 16))[1]
  grown = small.grow(16)
  assert grown.max_len == 16
  np.testing.assert_array_equal(grown.lengths, large.lengths)
  for a, b in zip(grown.k, small.k):  # growing copies the small cache exactly, zero-padded
    np.testing.assert_array_equal(a[..., :8], b)
    np.testing.assert_array_equal(a[..., 8:], 0)
  for a, b in zip(grown.v, small.v):
    np.testing.assert_array_equal(a[:, :, :8], b)
    np.testing.assert_array_equal(a[:, :, 8:], 0)
  for a, b in zip(grown.k + grown.v, large.k + large.v):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  after_grown = _extend(model, tokens[:, 5:9], jnp.array([4, 4, 4]), grown)[0]
  after_large = _extend(model, tokens[:, 5:9], jnp.array([4, 4, 4]), large)[0]
  np.testing.assert_allclose(after_grown, after_large, rtol=1e-5, atol=1e-5)


def test_bfloat16_params_give_float32_logits():
  cfg = dataclasses.replace(TINY, param_dtype="bfloat16")
  model = _make(cfg, randomize=False)
  assert {x.dtype for x in jax.tree.leaves(nnx.state(model))} == {jnp.dtype(jnp.bfloat16)}
  tokens, valid = _batch([5, 3])
  assert _forward(model, tokens, valid).dtype == jnp.float32


def _bf16(x):
  return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("kernel_in", [0, 1])
def test_bfloat16_matmul_precision_rounds_operands_and_keeps_the_kernel_gradient_exact(
    kernel_in):
  from agentgym_jax.models.decoder import dot  # pylint: disable=import-outside-toplevel
  k = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(k[0], (2, 5, 24))
  kernel = jax.random.normal(k[1], (24, 16) if kernel_in == 0 else (16, 24))
  cotangent = jax.random.normal(k[2], (2, 5, 16))
  w = _bf16(kernel) if kernel_in == 0 else _bf16(kernel).T  # [In, Out]
  x64, c64 = np.asarray(x, np.float64), np.asarray(cotangent, np.float64)

  def loss(x, kernel, precision):
    return jnp.sum(dot(x, kernel, precision, kernel_in) * cotangent)
  out = dot(x, kernel, "bfloat16", kernel_in)
  assert out.shape == (2, 5, 16) and out.dtype == jnp.float32
  # Operands rounded to bf16, products summed in float32.
  np.testing.assert_allclose(out, _bf16(x) @ w, rtol=1e-5, atol=1e-5)
  exact = dot(x, kernel, "float32", kernel_in)
  assert np.abs(np.asarray(out) - np.asarray(exact)).max() > 1e-3  # it did round
  d_x, d_kernel = jax.grad(loss, argnums=(0, 1))(x, kernel, "bfloat16")
  np.testing.assert_allclose(d_x, _bf16(cotangent) @ w.T, rtol=1e-5, atol=1e-5)
  # The kernel gradient is float32's: the rows and the cotangent are not rounded.
  exact_kernel_grad = np.einsum("bti,bto->io", x64, c64)
  np.testing.assert_allclose(d_kernel, exact_kernel_grad if kernel_in == 0
                             else exact_kernel_grad.T, rtol=1e-5, atol=1e-5)


def test_bfloat16_matmul_precision_stays_near_the_float32_model(model):
  tokens, valid = _batch([6, 4], seed=7)
  graphdef, state = nnx.split(model)
  rounded_def, _ = nnx.split(nnx.eval_shape(lambda: Decoder(
      dataclasses.replace(TINY, matmul_precision="bfloat16"), rngs=nnx.Rngs(0))))
  logits = lambda gd: nnx.jit(lambda s: nnx.merge(gd, s)(tokens, valid))(state)
  exact, rounded = np.asarray(logits(graphdef)), np.asarray(logits(rounded_def))
  difference = np.abs(rounded - exact)[np.asarray(valid)].max()
  assert 1e-4 < difference < 0.05 * np.abs(exact).max(), difference
  with pytest.raises(ValueError, match="matmul_precision 'fp8' is not one of"):
    dataclasses.replace(TINY, matmul_precision="fp8")


def test_remat_same_gradients(model):
  tokens, valid = _batch([6, 4], seed=5)
  graphdef, state = nnx.split(model)
  remat_graphdef, _ = nnx.split(nnx.eval_shape(
      lambda: Decoder(dataclasses.replace(TINY, remat=True), rngs=nnx.Rngs(0))))

  def loss(state, gd):
    logits = nnx.merge(gd, state)(tokens, valid)
    return jnp.sum(jnp.where(valid, jax.nn.log_softmax(logits)[..., 0], 0))

  g1 = jax.jit(jax.grad(lambda s: loss(s, graphdef)))(state)
  g2 = jax.jit(jax.grad(lambda s: loss(s, remat_graphdef)))(state)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, atol=1e-5)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(g1))


@pytest.mark.parametrize("remat", [False, True])
def test_blocks_as_a_scan_give_the_unrolled_loss_and_gradients(model, remat):
  tokens, valid = _batch([6, 4], seed=6)
  graphdef, state = nnx.split(model)
  def loss(state, layer_loop):
    cfg = dataclasses.replace(TINY, remat=remat, layer_loop=layer_loop)
    gd, _ = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    logits = nnx.merge(gd, state)(tokens, valid)
    return jnp.sum(jnp.where(valid, jax.nn.log_softmax(logits)[..., 0], 0))
  unrolled = jax.jit(jax.value_and_grad(lambda s: loss(s, "unroll")))(state)
  scanned = jax.jit(jax.value_and_grad(lambda s: loss(s, "scan")))(state)
  for a, b in zip(jax.tree.leaves(unrolled), jax.tree.leaves(scanned)):
    np.testing.assert_allclose(a, b, atol=1e-5)
  scan_program = jax.jit(lambda s: loss(s, "scan")).lower(state).as_text()
  assert "stablehlo.while" in scan_program  # a loop over the blocks, not TINY's two copies


def _backbone_grad_temporaries(layers: int, remat: bool) -> int:
  """Bytes of temporaries of d/dparams of the unrolled backbone on a 2,048-token row."""
  cfg = dataclasses.replace(TINY, hidden_size=128, intermediate_size=512, num_layers=layers,
                            vocab_size=64, remat=remat, layer_loop="unroll",
                            attention="blockwise")
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
  def loss(state, tokens, valid):
    return jnp.sum(nnx.merge(graphdef, state).backbone(tokens, valid) ** 2)
  tokens, valid = jnp.zeros((1, 2048), jnp.int32), jnp.ones((1, 2048), bool)
  compiled = jax.jit(jax.grad(loss)).lower(state, tokens, valid).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_remat_of_unrolled_blocks_holds_one_blocks_activations_on_cpu():
  # What each extra block costs the backward: its activations without remat (29 MiB at these
  # sizes), its checkpoint and gradients with it (2.7 MiB). jax.checkpoint in the same loop
  # measured 25 MiB: XLA:CPU merged the recomputation back into the forward.
  per_block = lambda remat: (_backbone_grad_temporaries(6, remat)
                             - _backbone_grad_temporaries(2, remat)) / 4
  plain, remat = per_block(False), per_block(True)
  assert remat < plain / 4, (plain, remat)


def test_layer_loop_auto_unrolls_on_cpu_and_scans_elsewhere():
  from agentgym_jax.models.decoder import resolve_layer_loop  # pylint: disable=import-outside-toplevel
  assert resolve_layer_loop("auto", "cpu") == "unroll"
  assert resolve_layer_loop("auto", "tpu") == resolve_layer_loop("auto", "gpu") == "scan"
  assert resolve_layer_loop("unroll", "tpu") == "unroll"
  with pytest.raises(ValueError, match="layer_loop 'scanned' is not one of"):
    resolve_layer_loop("scanned")


def test_value_model(model):
  tokens, valid = _batch([6, 2])
  values = nnx.jit(lambda: ValueModel(TINY, rngs=nnx.Rngs(0))(tokens, valid))()
  assert values.shape == (2, 6) and values.dtype == jnp.float32
  np.testing.assert_array_equal(values, 0.0)  # zero-initialised head
  critic = ValueModel(TINY, rngs=nnx.Rngs(1))
  hidden = nnx.jit(lambda c: c.backbone(tokens, valid))(critic)
  critic.head[...] = jnp.ones((TINY.hidden_size,))
  np.testing.assert_allclose(nnx.jit(lambda c: c(tokens, valid))(critic), hidden.sum(-1),
                             rtol=1e-5, atol=1e-5)


def test_rmsnorm_and_rope_golden_values():
  norm = RMSNorm(2, eps=0.0, dtype=jnp.float32, names=("norm",))
  np.testing.assert_allclose(norm(jnp.array([[3.0, 4.0]])),
                             [[3 / np.sqrt(12.5), 4 / np.sqrt(12.5)]], rtol=1e-6)
  cfg = ModelConfig(vocab_size=4, hidden_size=4, intermediate_size=4, num_layers=1, num_heads=1,
                    num_kv_heads=1, rope_theta=100.0)
  np.testing.assert_allclose(cfg.inv_freq(), [1.0, 0.1], rtol=1e-6)
  cos, sin = rope_tables(cfg, jnp.array([[2]]))
  x = jnp.array([[[1.0, 2.0, 3.0, 4.0]]])  # [B, T, Dh]; halves (1, 2) and (3, 4) pair up
  c0, s0, c1, s1 = np.cos(2.0), np.sin(2.0), np.cos(0.2), np.sin(0.2)
  expected = [1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1]
  np.testing.assert_allclose(apply_rope(x, cos, sin)[0, 0], expected, rtol=1e-5)


def test_llama3_rope_scaling_bands():
  cfg = ModelConfig(vocab_size=4, hidden_size=16, intermediate_size=4, num_layers=1,
                    num_heads=1, num_kv_heads=1, rope_theta=10000.0,
                    rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=64))
  base = dataclasses.replace(cfg, rope_scaling=None).inv_freq()
  scaled = cfg.inv_freq()
  wavelen = 2 * np.pi / base
  high, low = wavelen < 16, wavelen > 64  # wavelengths below 64/4 and above 64/1
  np.testing.assert_allclose(scaled[high], base[high])
  np.testing.assert_allclose(scaled[low], base[low] / 8, rtol=1e-6)
  mid = ~high & ~low
  assert mid.any() and (scaled[mid] < base[mid]).all() and (scaled[mid] > base[mid] / 8).all()


_HF_BASE = dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_from_hf_config_accepts_both_rope_theta_spellings():
  top = ModelConfig.from_hf_config({**_HF_BASE, "rope_theta": 1e6})
  nested = ModelConfig.from_hf_config(
      {**_HF_BASE, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
  assert top == nested and top.rope_theta == 1e6 and top.head_dim == 16
  llama31 = ModelConfig.from_hf_config(
      {**_HF_BASE, "model_type": "llama", "rope_theta": 5e5,
       "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
  assert dict(llama31.rope_scaling)["factor"] == 32.0 and not llama31.qkv_bias
  from_arch = ModelConfig.from_hf_config(
      {k: v for k, v in {**_HF_BASE, "rope_theta": 1e4, "architectures": ["Qwen3ForCausalLM"]
                         }.items() if k != "model_type"})
  assert from_arch.qk_norm
  assert hash(top) == hash(nested)  # usable as a static jit argument
  assert ModelConfig.from_hf_config(top.to_hf_config()) == top


@pytest.mark.parametrize("patch, message", [
    (dict(use_sliding_window=True, sliding_window=128), "Sliding-window"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "yarn"),
    (dict(model_type="gemma2"), "Unsupported model_type 'gemma2'"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(num_key_value_heads=3), "multiple of num_kv_heads"),
    (dict(model_type="llama", mlp_bias=True), "mlp_bias"),
    (dict(model_type="llama", rope_parameters={"rope_type": "llama3", "rope_theta": 1e4,
                                               "factor": 8.0}), "llama3 rope scaling lacks"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "full attention"),
])
def test_bad_configs_fail_clearly(patch, message):
  with pytest.raises(ValueError, match=message):
    ModelConfig.from_hf_config({**_HF_BASE, "rope_theta": 1e4, **patch})


def test_missing_config_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    ModelConfig.from_hf_config(tmp_path)


def test_live_bound_reads_only_the_first_slots_and_matches_the_whole_cache(model):
  """Attention bounded to the first slots, directly or through `head` / `with_head`."""
  tokens, valid = _batch([10, 7, 9], seed=7)
  full = np.asarray(_forward(model, tokens, valid))
  cache = KVCache.init(TINY, batch_size=3, max_len=32)
  bounded = cache.with_live(12)
  assert bounded.view_len == 12 and cache.view_len == 32
  logits, bounded = _extend(model, tokens[:, :6], jnp.array([6, 6, 6]), bounded)
  logits, bounded = _extend(model, tokens[:, 6:10], jnp.array([4, 1, 3]), bounded)
  assert bounded.live == 12  # the bound travels with the cache through the forward
  np.testing.assert_allclose(logits[0], full[0, 6:10], atol=1e-4)
  np.testing.assert_allclose(logits[1, :1], full[1, 6:7], atol=1e-4)
  # What lies past the bound is never read: garbage there changes nothing.
  poisoned = bounded.replace(k=tuple(k.at[..., 12:].set(1e4) for k in bounded.k),
                             v=tuple(v.at[:, :, 12:].set(1e4) for v in bounded.v))
  step = jnp.asarray(np.asarray(tokens)[:, 9:10])
  a = _extend(model, step, jnp.array([0, 1, 1]), bounded)[0]
  b = _extend(model, step, jnp.array([0, 1, 1]), poisoned)[0]
  np.testing.assert_array_equal(a, b)
  # A decode loop runs on the first 12 slots as buffers of their own and writes them back.
  head = bounded.head()
  assert head.max_len == 12 and head.live == 0 and cache.head() is cache
  merged = bounded.with_head(_extend(model, step, jnp.array([0, 1, 1]), head)[1])
  direct = _extend(model, step, jnp.array([0, 1, 1]), bounded)[1]
  assert merged.max_len == 32 and merged.live == 12
  np.testing.assert_array_equal(merged.lengths, direct.lengths)
  for x, y in zip(merged.k + merged.v, direct.k + direct.v):
    np.testing.assert_allclose(x, y, atol=1e-6)
  with pytest.raises(ValueError, match="outside 1..32"):
    cache.with_live(33)


# ----- packed rows (Segments) ------------------------------------------------------------------

def _packed_and_unpacked(opening, lengths, pad, seed=8):
  """One packed row [opening | c1 | c2 | ... | pad] and the rows [opening + ci] it stands for.

  Returns (tokens [1, T], valid [1, T], Segments), (tokens [N, U], valid [N, U]) and where
  each valid packed token lies unpacked: (rows, positions), [n_valid] each.
  """
  rng = np.random.RandomState(seed)
  prefix = rng.randint(0, TINY.vocab_size, opening)
  conts = [rng.randint(0, TINY.vocab_size, n) for n in lengths]
  n_valid = opening + sum(lengths)
  t, u = n_valid + pad, opening + max(lengths) + 2
  tokens, starts, positions = np.zeros((3, 1, t), np.int32)
  tokens[0, :n_valid] = np.concatenate([prefix] + conts)
  tokens[0, n_valid:] = rng.randint(0, TINY.vocab_size, pad)  # padding: junk, must not matter
  positions[0, :opening] = np.arange(opening)
  rows, where = [0] * opening, list(range(opening))
  unpacked = np.zeros((len(lengths), u), np.int32)
  at = opening
  for i, cont in enumerate(conts):
    starts[0, at:at + len(cont)] = at
    positions[0, at:at + len(cont)] = opening + np.arange(len(cont))
    unpacked[i, :opening + len(cont)] = np.concatenate([prefix, cont])
    rows += [i] * len(cont)
    where += list(opening + np.arange(len(cont)))
    at += len(cont)
  # Continuations see the opening [0, opening); the opening is a segment of its own.
  shared_end = np.where(np.arange(t) >= opening, opening, 0)[None].astype(np.int32)
  segments = Segments(positions=jnp.asarray(positions), starts=jnp.asarray(starts),
                      shared_start=jnp.zeros((1, t), jnp.int32),
                      shared_end=jnp.asarray(shared_end))
  unpacked_valid = np.arange(u)[None] < (opening + np.asarray(lengths))[:, None]
  packed = (jnp.asarray(tokens), jnp.arange(t)[None] < n_valid, segments)
  return packed, (jnp.asarray(unpacked), jnp.asarray(unpacked_valid)), (np.array(rows),
                                                                       np.array(where))


_PACKED = _packed_and_unpacked(opening=5, lengths=[4, 6, 3], pad=3)


def _corresponding_loss(cfg, state, tokens, valid, segments, gather):
  """sum(hidden[gather] * weights) of the backbone of `cfg` with parameters `state`, and the
  gathered hidden states [n, D]."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Backbone(cfg, rngs=nnx.Rngs(0))))
  hidden = nnx.merge(graphdef, state)(tokens, valid, segments)[gather]
  weights = jax.random.normal(jax.random.key(3), hidden.shape)
  return jnp.sum(hidden * weights), hidden


@pytest.fixture(scope="module")
def rows_of_their_own(model):
  """Gradients and hidden states of the sequences of `_PACKED` in rows of their own (TINY's
  attention and layer loop), read at the packed row's valid tokens."""
  _, (tokens, valid), (rows, where) = _PACKED
  loss = lambda state: _corresponding_loss(TINY, state, tokens, valid, None, (rows, where))
  return jax.jit(jax.grad(loss, has_aux=True))(nnx.split(model.backbone)[1])


@pytest.mark.parametrize("attention", ["blockwise", "xla"])
@pytest.mark.parametrize("layer_loop, remat", [("unroll", True), ("unroll", False),
                                               ("scan", True)])
def test_packed_row_equals_its_sequences_in_rows_of_their_own(model, rows_of_their_own,
                                                               monkeypatch, attention,
                                                               layer_loop, remat):
  """One row [opening | c1 | c2 | c3 | pad] with `Segments` gives each token the hidden state
  it has in the row [opening + ci] of its own, within 1e-5, and a loss read at corresponding
  positions has the same gradients w.r.t. every parameter (within 1e-5 of their scale): the
  opening's keys, shared by three sequences, collect all three's gradients. Blockwise blocks
  of 4 tokens, so segments and the opening end inside blocks."""
  monkeypatch.setattr(attention_lib, "_SEGMENT_BLOCK", 4)
  (tokens, valid, segments), _, (rows, _) = _PACKED
  cfg = dataclasses.replace(TINY, attention=attention, layer_loop=layer_loop, remat=remat)
  loss = lambda state: _corresponding_loss(cfg, state, tokens, valid, segments,
                                           (0, slice(0, len(rows))))
  grads, hidden = jax.jit(jax.grad(loss, has_aux=True))(nnx.split(model.backbone)[1])
  ref_grads, ref_hidden = rows_of_their_own
  np.testing.assert_allclose(hidden, ref_hidden, atol=1e-5)
  ref_grads = dict(nnx.to_flat_state(ref_grads))
  for path, g in nnx.to_flat_state(grads):
    ref = ref_grads[path][...]
    scale = float(np.abs(ref).max())
    assert scale > 0, path
    np.testing.assert_allclose(g[...], ref, atol=1e-5 * scale, err_msg=str(path))


def test_decoder_and_value_model_pass_segments_on(model):
  """Decoder and ValueModel read packed rows through the backbone: their outputs are the
  head's of the backbone's hidden states with the same `Segments` (which change them)."""
  (tokens, valid, segments), _, _ = _PACKED

  @nnx.jit
  def outputs(model):
    critic = ValueModel(TINY, rngs=nnx.Rngs(1))
    critic.head[...] = jnp.ones((TINY.hidden_size,))
    hidden = model.backbone(tokens, valid, segments)
    return (hidden, model.backbone(tokens, valid), model(tokens, valid, segments),
            model.logits_from_hidden(hidden), critic(tokens, valid, segments),
            critic.backbone(tokens, valid, segments).sum(-1))

  hidden, unpacked, logits, ref_logits, values, ref_values = outputs(model)
  assert not np.allclose(hidden, unpacked, atol=1e-3)
  np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
  np.testing.assert_allclose(values, ref_values, rtol=1e-5, atol=1e-5)
