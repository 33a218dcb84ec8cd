"""The attention seam: XLA forms against plain attention; every other kernel (blockwise, the
cuDNN call's argument mapping through its XLA mode, the Pallas kernel in interpret mode) against
the XLA form, outputs and gradients; memory without a score matrix; the Pallas kernel compiling
for a TPU topology (libtpu, AOT)."""

import dataclasses
import functools
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # before jax loads libtpu

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpu_slices
from flax import nnx
from jax.sharding import NamedSharding

from agentgym_jax import sharding
from agentgym_jax.models import Decoder, KVCache, ModelConfig, attention as attn
from agentgym_jax.models.attention import (attention, cache_attention, cached_attention,
                                           causal_attention, resolve_attention, self_attention)

TINY = ModelConfig(vocab_size=128, hidden_size=48, intermediate_size=80, num_layers=2,
                   num_heads=6, num_kv_heads=2, head_dim=8, qkv_bias=True, qk_norm=True,
                   tie_embeddings=False, model_type="qwen3", attention="xla")

@pytest.mark.parametrize("t, score_block", [
    (1, 1 << 22),     # decode: one query per row
    (24, 1 << 22),    # every row in one block
    (96, 1 << 19),    # blocks of 2 rows (of 96 queries x 4 heads x 512 slots each)
    (96, 1 << 15),    # one row at a time, its queries in blocks of 16
    (100, 1 << 15),   # 7 blocks of 15 queries, the last one padded with 5
])
def test_cached_attention_equals_attention(t, score_block):
  """A decode step and the row and query blocks compute plain attention."""
  b, kh, g, s, dh = 8, 2, 2, 512, 16
  keys = jax.random.split(jax.random.key(t), 3)
  q = jax.random.normal(keys[0], (b, t, kh, g, dh))
  k = jax.random.normal(keys[1], (b, kh, dh, s))
  v = jax.random.normal(keys[2], (b, kh, s, dh))
  positions = jnp.arange(b)[:, None] * 40 + jnp.arange(t)[None]
  mask = jnp.arange(s)[None, None] <= positions[:, :, None]
  blocked = jax.jit(functools.partial(cached_attention, score_block=score_block))
  np.testing.assert_allclose(blocked(q, k, v, mask), jax.jit(attention)(q, k, v, mask),
                             atol=1e-5)


@pytest.mark.parametrize("t", [3, 7, 64])
def test_causal_attention_equals_attention(t):
  """Query blocks that skip the keys above the diagonal compute plain causal attention."""
  b, kh, g, dh = 3, 2, 2, 16
  keys = jax.random.split(jax.random.key(t), 3)
  q = jax.random.normal(keys[0], (b, t, kh, g, dh))
  k = jax.random.normal(keys[1], (b, kh, dh, t))
  v = jax.random.normal(keys[2], (b, kh, t, dh))
  valid = jnp.arange(t)[None] < jnp.array([t, t - 1, 1])[:, None]
  mask = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]
  np.testing.assert_allclose(jax.jit(causal_attention)(q, k, v, mask),
                             jax.jit(attention)(q, k, v, mask), atol=1e-6)


def test_resolve_attention_and_bad_values():
  assert resolve_attention("auto", "tpu") == "pallas"
  assert resolve_attention("auto", "gpu") == "cudnn"
  assert resolve_attention("auto", "cpu") == "blockwise"
  assert resolve_attention("auto") == attn.AUTO.get(jax.default_backend(), "blockwise")
  assert resolve_attention("xla", "tpu") == "xla"
  assert set(attn.attention_names()) == {"auto", "xla", "blockwise", "cudnn", "pallas",
                                         "pallas_interpret"}
  with pytest.raises(ValueError, match="not one of"):
    resolve_attention("flash")
  with pytest.raises(ValueError, match=r"attention 'flash' is not one of \('auto', 'xla'"):
    dataclasses.replace(TINY, attention="flash")
  with pytest.raises(ValueError, match="already registered"):
    attn.register_kernel("xla", attn._xla_self, attn._xla_cache)
  from agentgym_jax.train import config as train_config  # pylint: disable=import-outside-toplevel
  config = train_config.base_config()
  assert config.model.attention == "auto"
  config.model.attention = "flash"
  with pytest.raises(ValueError, match="model.attention 'flash' is not one of"):
    train_config.lock(config)


def _qkv(b, t, kh, g, dh, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (b, t, kh, g, dh)), jax.random.normal(keys[1], (b, t, kh, dh)),
          jax.random.normal(keys[2], (b, t, kh, dh)))


def _valid(lengths, t):
  return jnp.arange(t)[None] < jnp.asarray(lengths)[:, None]


@pytest.mark.parametrize("t, max_block, g", [
    (24, 512, 2),     # one block, padded from 24 to 128 queries and keys
    (200, 128, 3),    # 2 x 2 blocks (the one above the diagonal skipped), padded to 256
    (16, 512, 1),     # no grouping (G = 1)
])
def test_pallas_self_attention_matches_xla(monkeypatch, t, max_block, g):
  """Causal, right-padded rows (one full, one cut short, one of a single token), GQA: the
  outputs at valid positions and the gradients of q, k, v agree within 1e-5."""
  monkeypatch.setattr(attn, "_MAX_BLOCK", max_block)
  q, k, v = _qkv(3, t, 2, g, 16, seed=t)
  valid = _valid([t, t - 5, 1], t)
  weights = jax.random.normal(jax.random.key(1), (3, t, 2 * g * 16)) * valid[..., None]
  def loss(impl, q, k, v):
    out = self_attention(q, k, v, valid, impl)
    return jnp.sum(out * weights), out
  grad = lambda impl: jax.jit(jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2),
                                       has_aux=True))(q, k, v)
  (g_x, out_x), (g_p, out_p) = grad("xla"), grad("pallas_interpret")
  keep = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(out_p)[keep], np.asarray(out_x)[keep], atol=1e-5)
  assert np.isfinite(np.asarray(out_p)).all()  # padded queries too
  for a, b in zip(g_p, g_x):
    np.testing.assert_allclose(a, b, atol=1e-5)


def _self_grads(fn, q, k, v, valid):
  """(out, grads of q, k, v) of sum(out * weights) over valid queries, fn(q, k, v, valid)."""
  weights = jax.random.normal(jax.random.key(1), q.shape[:2] + (-1,)[:0] +
                              (q.shape[2] * q.shape[3] * q.shape[4],)) * valid[..., None]
  def loss(q, k, v):
    out = fn(q, k, v, valid)
    return jnp.sum(out * weights), out
  grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


def _assert_self_parity(fn, q, k, v, valid, atol=1e-5, reference=attn._xla_self):
  """fn's outputs at valid queries and its gradients equal the reference's (the XLA form)
  within atol; every output (padded queries too) is finite."""
  out, grads = _self_grads(fn, q, k, v, valid)
  ref_out, ref_grads = _self_grads(reference, q, k, v, valid)
  keep = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(out)[keep], np.asarray(ref_out)[keep], atol=atol)
  assert np.isfinite(np.asarray(out)).all()
  for a, b in zip(grads, ref_grads):
    np.testing.assert_allclose(a, b, atol=atol)


@pytest.mark.parametrize("t, block_q, block_k, g", [
    (24, None, None, 3),   # one block each way
    (200, 64, 48, 3),      # 4 x 5 blocks, uneven, the last of each padded
    (37, 8, 16, 1),        # no grouping (G = 1), many small blocks
    (1, None, None, 2),    # a single token
])
def test_blockwise_self_attention_matches_xla(t, block_q, block_k, g):
  """Right-padded rows (full, cut short, one token), GQA, blocks that do not divide T: the
  blockwise kernel's outputs and gradients equal the XLA form's within 1e-5."""
  q, k, v = _qkv(3, t, 2, g, 16, seed=t)
  valid = _valid([t, max(t - 5, 1), 1], t)
  positions = jnp.broadcast_to(jnp.arange(t), valid.shape)
  fn = lambda q, k, v, valid: attn.flash_attention(
      q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), positions, valid, block_q, block_k)
  _assert_self_parity(fn, q, k, v, valid)
  _assert_self_parity(functools.partial(self_attention, impl="blockwise"), q, k, v, valid)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cudnn_kernels_call_matches_xla(dtype):
  """The GPU kernel's `jax.nn.dot_product_attention` call (causal, each row's valid length, GQA
  heads) run by its XLA implementation, which takes the same arguments as cuDNN's, equals the
  XLA form; in float32 (which cuDNN does not take) the kernel falls back to blockwise."""
  q, k, v = (x.astype(dtype) for x in _qkv(3, 40, 2, 3, 16, seed=5))
  valid = _valid([40, 33, 1], 40)
  call = functools.partial(attn.dot_product_self, implementation="xla")
  _assert_self_parity(call, q, k, v, valid, atol=1e-5 if dtype == jnp.float32 else 5e-2)
  assert attn.cudnn_supports(q) == (dtype == jnp.bfloat16)
  if dtype == jnp.float32:
    _assert_self_parity(functools.partial(self_attention, impl="cudnn"), q, k, v, valid)


@pytest.mark.parametrize("impl", ["blockwise", "cudnn", "pallas_interpret"])
@pytest.mark.parametrize("t, starts", [
    (8, [0, 5, 30]),     # a prefill, and chunks at nonzero lengths
    (20, [0, 0, 3]),     # a chunk longer than some rows' history
    (1, [4, 0, 37]),     # decode: the XLA form under every kernel
])
def test_cache_attention_matches_xla(impl, t, starts):
  """A chunk at per-row offsets against the cache it was written into: every query agrees
  (padded queries included: every form gives them the same keys)."""
  b, kh, g, dh, s = 3, 2, 3, 16, 48
  q, k_new, v_new = _qkv(b, t, kh, g, dh, seed=7 + t)
  keys = jax.random.split(jax.random.key(3), 2)
  cache = KVCache(k=(jax.random.normal(keys[0], (b, kh, dh, s)),),
                  v=(jax.random.normal(keys[1], (b, kh, s, dh)),), lengths=jnp.asarray(starts))
  starts = jnp.asarray(starts, jnp.int32)
  k_buf, v_buf = cache.write(0, k_new, v_new, starts)
  run = lambda impl: jax.jit(functools.partial(cache_attention, impl=impl))(
      q, k_buf, v_buf, starts)
  np.testing.assert_allclose(run(impl), run("xla"), atol=1e-5)


def test_blockwise_decode_step_matches_xla():
  """T = 1 through the blockwise kernel itself (the seam sends decode to XLA), small blocks."""
  b, kh, g, dh, s = 3, 2, 3, 16, 48
  q, _, _ = _qkv(b, 1, kh, g, dh, seed=11)
  keys = jax.random.split(jax.random.key(4), 2)
  k, v = jax.random.normal(keys[0], (b, kh, dh, s)), jax.random.normal(keys[1], (b, kh, s, dh))
  starts = jnp.asarray([4, 0, 47], jnp.int32)
  out = attn.flash_attention(q, k.swapaxes(2, 3), v, starts[:, None], jnp.ones((b, s), bool),
                             block_k=16)
  np.testing.assert_allclose(out, attn._xla_cache(q, k, v, starts), atol=1e-5)


def _grad_temporaries(impl: str, t: int) -> int:
  """Temporaries of one layer's attention forward + backward on this CPU, one row of t."""
  b, kh, g, dh = 1, 3, 3, 64
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  def loss(q, k, v, valid):
    return jnp.sum(self_attention(q, k, v, valid, impl))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
      spec(b, t, kh, g, dh), spec(b, t, kh, dh), spec(b, t, kh, dh),
      jax.ShapeDtypeStruct((b, t), jnp.bool_)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_linearly_with_length():
  """No [T, T] score matrix: from 2,048 to 8,192 tokens the blockwise gradient's temporaries
  grow about 4x (linearly; blocks of scores are constant), the XLA form's about 16x."""
  blockwise = [_grad_temporaries("blockwise", t) for t in (2048, 8192)]
  xla = [_grad_temporaries("xla", t) for t in (2048, 8192)]
  assert blockwise[1] < 6 * blockwise[0], blockwise
  assert xla[1] > 10 * xla[0], xla
  assert blockwise[1] < xla[1] / 10, (blockwise, xla)


_forward = nnx.jit(lambda m, t, v: m(t, v))
_extend = nnx.jit(lambda m, t, n, c: m.extend(t, n, c))


@pytest.mark.parametrize("impl", ["blockwise", "pallas_interpret"])
def test_decoder_with_kernel_matches_xla(impl):
  """A tiny random Decoder: full-forward logits at valid positions, and a prefill then a
  chunk at nonzero lengths, with the kernel against attention='xla'."""
  make = lambda cfg: nnx.jit(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))()
  xla, pallas = make(TINY), make(dataclasses.replace(TINY, attention=impl))
  lengths = np.array([9, 4, 1])
  tokens = jax.random.randint(jax.random.key(0), (3, 9), 0, TINY.vocab_size).astype(jnp.int32)
  valid = jnp.arange(9)[None] < jnp.asarray(lengths)[:, None]
  keep = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(_forward(pallas, tokens, valid))[keep],
                             np.asarray(_forward(xla, tokens, valid))[keep], atol=1e-5)
  caches = [KVCache.init(TINY, batch_size=3, max_len=16)] * 2
  for chunk, num_new in ((tokens[:, :5], [5, 2, 1]), (tokens[:, 4:9], [4, 2, 0])):
    num_new = jnp.asarray(num_new)
    (lx, cx), (lp, cp) = (_extend(m, chunk, num_new, c) for m, c in zip((xla, pallas), caches))
    np.testing.assert_allclose(lp, lx, atol=1e-5)
    caches = [cx, cp]
  np.testing.assert_array_equal(caches[1].lengths, [9, 4, 1])


def _tpu_devices():
  return tpu_slices.devices("v5e-4")  # one v5e host, 2x2 chips


def compile_attention_for_tpu(impl: str, devices, b: int, t: int, kh: int, g: int, dh: int,
                              mesh_axes=(("data", 2), ("fsdp", 1), ("tensor", 2)),
                              dtype=jnp.bfloat16):
  """AOT-compiles one layer's causal attention forward + backward (grads of q, k, v) for the
  TPU `devices`, under their mesh; returns the compiled program."""
  mesh = sharding.make_mesh(list(mesh_axes), devices)
  q_spec = sharding.logical_to_spec(("batch", None, "kv_heads", None, None), (b, t, kh, g, dh),
                                    mesh)
  kv_spec = sharding.logical_to_spec(("batch", None, "kv_heads", None), (b, t, kh, dh), mesh)
  valid_spec = sharding.logical_to_spec(("batch", None), (b, t), mesh)
  def step(q, k, v, valid):
    loss = lambda q, k, v: jnp.sum(self_attention(q, k, v, valid, impl).astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  shard = lambda spec: NamedSharding(mesh, spec)
  in_shardings = (shard(q_spec), shard(kv_spec), shard(kv_spec), shard(valid_spec))
  args = (jax.ShapeDtypeStruct((b, t, kh, g, dh), dtype),
          jax.ShapeDtypeStruct((b, t, kh, dh), dtype), jax.ShapeDtypeStruct((b, t, kh, dh), dtype),
          jax.ShapeDtypeStruct((b, t), jnp.bool_))
  jitted = jax.jit(sharding.traced_under(mesh, step), in_shardings=in_shardings,
                   out_shardings=in_shardings[:3])
  return jitted.lower(*args).compile()


def test_pallas_attention_compiles_for_tpu():
  """The kernel lowers through Mosaic and compiles for a v5e 2x2 slice (AOT on this host),
  sharded over rows and kv heads, and peaks lower than the XLA form (at 12,288 tokens: see
  the numbers in models/attention.py's docstring, from `compile_attention_for_tpu`)."""
  devices = _tpu_devices()
  peak = {}
  for impl in ("pallas", "xla"):
    compiled = compile_attention_for_tpu(impl, devices, b=2, t=1024, kh=2, g=2, dh=128)
    peak[impl] = compiled.memory_analysis().peak_memory_in_bytes
    print(impl, compiled.memory_analysis())
    if impl == "pallas":
      assert "tpu_custom_call" in compiled.as_text()
  assert peak["pallas"] < peak["xla"], peak


# ----- packed rows (Segments) ------------------------------------------------------------------

def _packed(rows):
  """valid [B, T] and `Segments` of rows given as ([(opening, [segment lengths]), ...],
  padding): each opening, then the segments continuing it.

  Padded tokens get starts and openings 0, as a careless caller might leave them: the kernels
  must cope."""
  t = max(sum(n + sum(lengths) for n, lengths in groups) + pad for groups, pad in rows)
  valid, starts, positions, shared_start, shared_end = (
      np.zeros((len(rows), t), int) for _ in range(5))
  for b, (groups, _) in enumerate(rows):
    at = 0
    for opening, lengths in groups:
      first = at  # the opening: a segment of its own, continuing nothing
      valid[b, at:at + opening] = 1
      starts[b, at:at + opening] = shared_start[b, at:at + opening] = at
      shared_end[b, at:at + opening] = at
      positions[b, at:at + opening] = np.arange(opening)
      at += opening
      for n in lengths:
        valid[b, at:at + n] = 1
        starts[b, at:at + n] = at
        shared_start[b, at:at + n], shared_end[b, at:at + n] = first, first + opening
        positions[b, at:at + n] = opening + np.arange(n)
        at += n
  as_int = lambda x: jnp.asarray(x, jnp.int32)
  segments = attn.Segments(positions=as_int(positions), starts=as_int(starts),
                           shared_start=as_int(shared_start), shared_end=as_int(shared_end))
  return jnp.asarray(valid, bool), segments


# A row with an opening of 7 and three continuations; one plain-packed (an empty opening);
# one with two openings (a batch's two groups), each continued twice or three times; all
# padded at the end.
_ROWS = [([(7, [9, 11, 6])], 4), ([(0, [12, 10, 9])], 6), ([(5, [4, 6]), (6, [5, 3, 4])], 2)]


def _segment_mask(valid, segments):
  """[B, T, T] bool: `Segments`'s rule, written out."""
  t = valid.shape[1]
  s, q = np.arange(t)[None, None, :], np.arange(t)[None, :, None]
  starts, lo, hi = (np.asarray(x)[:, :, None] for x in (segments.starts, segments.shared_start,
                                                        segments.shared_end))
  return np.asarray(valid)[:, None, :] & (s <= q) & ((s >= starts) | ((s >= lo) & (s < hi)))


@pytest.mark.parametrize("block_q, block_k", [(None, None), (8, 8), (5, 7), (16, 4), (3, 11)])
def test_blockwise_segments_match_xla(block_q, block_k):
  """Packed rows (shared opening and plain packing, padded), GQA, blocks that cut segments:
  flash attention with segments, and the seam's blockwise and cuDNN forms, equal the XLA
  form's full mask within 1e-5, outputs and gradients; the XLA form equals `attention` with
  the rule written out."""
  valid, segments = _packed(_ROWS)
  q, k, v = _qkv(len(_ROWS), valid.shape[1], 2, 3, 16, seed=3)
  past = lambda x: jnp.where(valid, x, jnp.arange(valid.shape[1]))
  flash = lambda q, k, v, valid: attn.flash_attention(
      q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
      jnp.broadcast_to(jnp.arange(valid.shape[1]), valid.shape), valid, block_q, block_k,
      segments=(past(segments.starts), past(segments.shared_start),
                past(segments.shared_end)))
  reference = lambda q, k, v, valid: attn._xla_segments(q, k, v, valid, segments)
  _assert_self_parity(flash, q, k, v, valid, reference=reference)
  for impl in ("blockwise", "cudnn"):
    seam = lambda q, k, v, valid: attn.segment_attention(q, k, v, valid, segments, impl)
    _assert_self_parity(seam, q, k, v, valid, reference=reference)
  written_out = attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3),
                          jnp.asarray(_segment_mask(valid, segments)))
  keep = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(reference(q, k, v, valid))[keep],
                             np.asarray(written_out)[keep], atol=1e-5)


def test_blockwise_segments_never_touch_other_segments_keys():
  """Queries of the opening and of the second and third of three continuations, keys of all
  of them, the first continuation's keys (whole key blocks) NaN: nothing may read them, and
  visiting them at all would turn outputs and gradients NaN (0 * NaN in the value matmul),
  masked or not. Outputs and gradients equal the XLA form's with those keys zeroed."""
  shared, block = 8, 8
  lengths = [16, 12, 12]  # continuation 1 fills key blocks 1 and 2
  s = shared + sum(lengths)
  queries = np.r_[0:shared, shared + 16:s]  # the opening, continuations 2 and 3
  starts = np.r_[np.zeros(shared), np.full(12, 24), np.full(12, 36)].astype(np.int32)
  opening = np.r_[np.zeros(shared), np.full(24, shared)].astype(np.int32)  # its end
  b, kh, g, dh = 1, 2, 2, 16
  q, _, _ = _qkv(b, len(queries), kh, g, dh, seed=9)
  keys = jax.random.split(jax.random.key(10), 2)
  k, v = (jax.random.normal(key, (b, kh, s, dh)) for key in keys)
  poison = lambda x: x.at[:, :, shared:shared + 16].set(jnp.nan)
  q_pos = jnp.asarray(queries, jnp.int32)[None]
  weights = jax.random.normal(jax.random.key(2), (b, len(queries), kh * g * dh))
  def grads(fn, k, v):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v) * weights)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
  flash = lambda q, k, v: attn.flash_attention(
      q, k, v, q_pos, jnp.ones((b, s), bool), block, block,
      segments=(jnp.asarray(starts)[None], jnp.zeros((1, len(queries)), jnp.int32),
                jnp.asarray(opening)[None]))
  mask = ((jnp.arange(s)[None, None] <= q_pos[..., None])
          & attn._segment_visible(jnp.arange(s)[None, None], jnp.asarray(starts)[None, :, None],
                                  0, jnp.asarray(opening)[None, :, None]))
  xla = lambda q, k, v: attention(q, k.swapaxes(2, 3), v, mask)
  got, ref = grads(flash, poison(k), poison(v)), grads(xla, *(x.at[:, :, shared:shared + 16]
                                                              .set(0.0) for x in (k, v)))
  for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    assert np.isfinite(np.asarray(a)).all()
    np.testing.assert_allclose(a, r, atol=1e-5)


@pytest.mark.parametrize("row", _ROWS)
@pytest.mark.parametrize("block", [4, 7])
def test_blockwise_segments_visit_only_blocks_with_visible_keys(monkeypatch, row, block):
  """Every key block the forward and the backward score holds a key one of the query block's
  queries may see, and each such block is scored once per pass: the count of scored blocks
  (a callback in `_block_scores`) is twice the count from the rule written out, well below
  the causal count."""
  visits = []
  scores = attn._block_scores
  def counted(*args, **kwargs):
    jax.debug.callback(lambda: visits.append(1))
    return scores(*args, **kwargs)
  monkeypatch.setattr(attn, "_block_scores", counted)
  monkeypatch.setattr(attn, "_SEGMENT_BLOCK", block)
  jax.clear_caches()  # flash_attention is jitted: a trace cached by another test has no callback
  valid, segments = _packed([row])
  t = valid.shape[1]
  q, k, v = _qkv(1, t, 2, 2, 8, seed=4)
  loss = lambda q, k, v: jnp.sum(attn.segment_attention(q, k, v, valid, segments, "blockwise"))
  jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
  jax.effects_barrier()
  block = attn._flash_block(t, block)
  n = -(-t // block)
  seen = _segment_mask(valid, segments)[0] & np.asarray(valid)[0][:, None]
  pairs = np.array([[seen[i * block:(i + 1) * block, j * block:(j + 1) * block].any()
                     for j in range(n)] for i in range(n)])
  causal = np.tril(np.ones((n, n), bool)) & (np.arange(n) <= (np.asarray(valid)[0].sum() - 1)
                                             // block)[None]
  assert len(visits) == 2 * pairs.sum(), (len(visits), pairs.sum())
  assert pairs.sum() < 0.8 * causal.sum(), (pairs.sum(), causal.sum())


def test_pallas_has_no_segment_form():
  valid, segments = _packed(_ROWS)
  q, k, v = _qkv(len(_ROWS), valid.shape[1], 2, 3, 16)
  for impl in ("pallas", "pallas_interpret"):
    with pytest.raises(ValueError, match=rf"attention kernel '{impl}' cannot run packed rows "
                                         r".*model.attention=blockwise or xla"):
      attn.segment_attention(q, k, v, valid, segments, impl)
