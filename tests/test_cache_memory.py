"""The rollout KV cache: in the model's dtype, updated in place by `sampler.decode` (compiled
temporaries a small fraction of the cache, on CPU and for a TPU topology), and its TPU storage
layout (slots-major, `models.cache`) computing what the CPU layout computes."""

import dataclasses
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
from agentgym_jax.models import Decoder, KVCache, ModelConfig
from agentgym_jax.rollout import sampler
from agentgym_jax.rollout.batch import DecodeBatch
from agentgym_jax.rollout.sampler import SamplingConfig

# 4 layers x 2 kv heads x 64 x 512 slots x 8 rows x (k, v): 8 MiB of float32 cache, 4 of bf16.
CFG = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4,
                  num_heads=4, num_kv_heads=2)
ROWS, SLOTS, REPLY = 8, 512, 64


def _abstract(cfg, platform=None, shard=lambda x: None, rows=ROWS, slots=SLOTS):
  """graphdef, and ShapeDtypeStructs of decode's state, cache, logits, turn and caps."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard(x))
  cache = jax.tree.map(sds, jax.eval_shape(lambda: KVCache.init(cfg, rows, slots, platform)))
  turn = jax.eval_shape(lambda: sampler.Turn.idle(jax.random.split(jax.random.key(0), rows),
                                                  REPLY))
  rest = (jax.ShapeDtypeStruct((rows, cfg.vocab_size), jnp.float32), turn,
          jax.ShapeDtypeStruct((rows,), jnp.int32))
  return graphdef, state, cache, jax.tree.map(sds, rest)


def _temp_fraction(compiled, cache, devices=1) -> float:
  """Compiled temporaries over the cache's bytes on one device."""
  cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((cache.k, cache.v)))
  return compiled.memory_analysis().temp_size_in_bytes / (cache_bytes / devices)


def test_cpu_decode_updates_the_cache_in_place():
  """float32, the CPU's dtype. (A bf16 model on XLA:CPU converts each layer's keys and values
  to float32 for its matmuls, about 2.6x its bf16 cache in temporaries: XLA:CPU has no bf16
  matmul; the TPU test below is the bf16 case.)"""
  graphdef, state, cache, (logits, turn, caps) = _abstract(CFG, "cpu")
  assert cache.k[0].dtype == jnp.float32
  compiled = sampler.decode.lower(graphdef, state, cache, logits, turn, caps, end_ids=(1,),
                                  sampling=SamplingConfig(max_reply_tokens=REPLY)).compile()
  assert _temp_fraction(compiled, cache) < 0.25


def _tpu_devices():
  return tpu_slices.devices("v5e-4")  # one v5e host, 2x2 chips


def test_tpu_decode_updates_the_cache_in_place():
  """Compiled for 4 TPU v5e chips, rows split over them: with the heads-first layout XLA:TPU
  converted the whole cache into another layout for the decode loop (temporaries 2.1x the
  cache); stored slots-major it keeps it in place."""
  devices = _tpu_devices()
  mesh = sharding.make_mesh([("data", 1), ("fsdp", 4), ("tensor", 1)], devices)
  rows_split = lambda x: NamedSharding(mesh, sharding.logical_to_spec(
      ["batch"] + [None] * (x.ndim - 1), x.shape, mesh))
  # Kv heads x head_dim = 128, one lane width; 32 rows x 2,048 slots: 32 MiB of cache a chip.
  cfg = dataclasses.replace(CFG, hidden_size=256, head_dim=64, param_dtype="bfloat16")
  graphdef, state, cache, (logits, turn, caps) = _abstract(cfg, "tpu", rows_split, 32, 2048)
  specs = sharding.state_shardings(state, mesh)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       state, specs)
  with jax.set_mesh(mesh):
    compiled = sampler.decode.lower(graphdef, state, cache, logits, turn, caps, end_ids=(1,),
                                    sampling=SamplingConfig(max_reply_tokens=REPLY)).compile()
  assert _temp_fraction(compiled, cache, len(devices)) < 0.25


def _model(cfg):
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  # Larger weights than the initialiser's, so sampled tokens depend on the context.
  state = jax.tree.map(lambda x: x * 20 if x.ndim == 2 else x, nnx.state(model))
  nnx.update(model, state)
  return nnx.split(model)


def _rollout(graphdef, state, platform, live=False):
  """Prefill of uneven rows, a turn of decode, an observation, a second turn; returns the
  cache and both turns' tokens and log-probs."""
  prompts = [[5, 17, 3, 9], [11, 2, 40, 41, 42, 43, 44], [7], [60, 61, 62]]
  b, cfg = len(prompts), nnx.merge(graphdef, state).cfg
  cache = KVCache.init(cfg, b, 64, platform)
  cache = cache.with_live(32) if live else cache
  tokens = np.zeros((b, 8), np.int32)
  for row, p in enumerate(prompts):
    tokens[row, :len(p)] = p
  lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
  cache, logits = sampler.extend(graphdef, state, cache, jnp.zeros((b, cfg.vocab_size)),
                                 jnp.asarray(tokens), lens)
  keys = jax.random.split(jax.random.key(1), b)
  out = []
  for turn_number in range(2):
    turn = sampler.start_turns(sampler.Turn.idle(keys, 6), jnp.ones(b, bool), keys,
                               jnp.full((b,), turn_number, jnp.int32))
    cache, logits, turn = sampler.decode(graphdef, state, cache, logits, turn,
                                         jnp.full((b,), 6, jnp.int32), (), SamplingConfig())
    out.append((np.asarray(turn.tokens), np.asarray(turn.logprobs)))
    cache, logits = sampler.extend(graphdef, state, cache, logits,
                                   jnp.asarray(turn.tokens[:, -1:]), jnp.ones(b, jnp.int32))
  return cache, out


@pytest.mark.parametrize("live", [False, True])
def test_slots_layout_decodes_as_the_heads_layout(live):
  """The TPU storage layout, run on CPU, samples the same tokens with the same log-probs."""
  graphdef, state = _model(CFG)
  heads, want = _rollout(graphdef, state, "cpu", live)
  slots, got = _rollout(graphdef, state, "tpu", live)
  assert heads.k[0].ndim == 4 and slots.k[0].shape == (4, 64, CFG.num_kv_heads * CFG.head_dim)
  np.testing.assert_array_equal(slots.lengths, heads.lengths)
  for (tokens, logprobs), (tokens_want, logprobs_want) in zip(got, want):
    np.testing.assert_array_equal(tokens, tokens_want)
    # Float32 rounding apart: XLA orders the transposed reads' sums differently.
    np.testing.assert_allclose(logprobs, logprobs_want, atol=1e-4)
  # The same keys, stored slots-major; a grown cache pads the slot axis.
  q = jnp.zeros((1, 1, CFG.num_kv_heads, CFG.num_heads // CFG.num_kv_heads, CFG.head_dim))
  for cache in (slots.replace(live=0), slots.grow(96).replace(live=0)):
    k, v = cache.attention_view(cache.k[1], cache.v[1], q)
    np.testing.assert_allclose(k[..., :64], heads.k[1], atol=1e-4)
    np.testing.assert_allclose(v[:, :, :64], heads.v[1], atol=1e-4)


def test_bf16_model_rolls_out_with_a_bf16_cache():
  graphdef, state = _model(dataclasses.replace(CFG, param_dtype="bfloat16"))
  batch = DecodeBatch(graphdef, state, 4, limit=512, grow=True, mesh=None, max_reply_tokens=8)
  assert {x.dtype for x in batch.cache.k + batch.cache.v} == {jnp.dtype(jnp.bfloat16)}
  batch.assign(np.arange(4), jax.random.split(jax.random.key(0), 4))
  batch.start(np.ones(4, bool), np.zeros(4, np.int32))
  batch.extend([[5, 17, 3, 9], [11, 2, 40], [7], [60, 61, 62]], np.zeros(4, np.int64),
               max_chunk=512, pad_id=0)
  batch.decode(12, (), SamplingConfig(max_reply_tokens=8))
  assert batch.cache.k[0].dtype == jnp.bfloat16
  counts, logprobs = np.asarray(batch.turn.counts), np.asarray(batch.turn.logprobs)
  assert (counts == 8).all() and np.isfinite(logprobs).all() and (logprobs < 0).any()


def test_a_bf16_copy_of_float32_weights_rolls_out_with_a_bf16_cache():
  # Mixed precision (`model.compute_dtype = "bfloat16"`): the trainer rolls out with a bf16
  # copy of its float32 weights; the cache follows the weights, not the model config.
  from agentgym_jax.train import update as update_lib  # pylint: disable=import-outside-toplevel
  graphdef, state = _model(CFG)
  state = update_lib.as_compute(state, "bfloat16")
  batch = DecodeBatch(graphdef, state, 4, limit=512, grow=True, mesh=None, max_reply_tokens=8)
  assert {x.dtype for x in batch.cache.k + batch.cache.v} == {jnp.dtype(jnp.bfloat16)}


def test_a_growing_cache_is_a_safe_point_that_counts_its_grown_copy(monkeypatch):
  """Under a program budget (freed_memory.ProgramBudget) the rollout drops the programs before
  its cache grows when what the process holds plus the grown copy, alive beside the old cache
  while it is made, would pass the budget; within the budget it keeps them."""
  from agentgym_jax import freed_memory  # pylint: disable=import-outside-toplevel
  graphdef, state = _model(CFG)
  batch = DecodeBatch(graphdef, state, 4, limit=512, grow=True, mesh=None, max_reply_tokens=8)
  small = batch.cache.nbytes  # layers x (k, v) x rows x kv heads x head_dim x 256 slots x 4 B
  assert batch.cache.max_len == 256
  assert small == CFG.num_layers * 2 * 4 * CFG.num_kv_heads * CFG.head_dim * 256 * 4
  checked, released = [], []
  monkeypatch.setattr(freed_memory, "release_programs", lambda: released.append(True))
  held, built = 10 * small, [0]
  budget = freed_memory.ProgramBudget(held + small, lambda: built[0], resident=lambda: held)
  built[0] = 1  # programs built since the budget began: there is something to drop
  check = budget.check
  monkeypatch.setattr(budget, "check", lambda rise=0: checked.append(rise) or check(rise))
  freed_memory.set_program_budget(budget)
  try:
    batch.assign(np.arange(4), jax.random.split(jax.random.key(0), 4))
    batch.extend([[5, 17, 3], [11, 2], [7], [60, 61]], np.zeros(4, np.int64), max_chunk=512,
                 pad_id=0)
    assert batch.cache.max_len == 256 and checked == [] and released == []  # no growth
    batch.extend([list(range(1, 300))] * 4, np.array([3, 2, 1, 2]), max_chunk=512, pad_id=0)
  finally:
    freed_memory.set_program_budget(None)
  # 256 -> 512 slots: the grown copy is twice the cache, and held + it passes the budget.
  assert batch.cache.max_len == 512 and checked == [2 * small] and released == [True]
