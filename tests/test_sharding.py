"""Meshes, logical-axis rules and sharded models on the 8 fake CPU devices from conftest, and
meshes on TPU slices' devices from libtpu (tests/tpu_slices.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tpu_slices
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from agentgym_jax import sharding
from agentgym_jax.models import Decoder, KVCache, ModelConfig, load_hf, save_hf
from agentgym_jax.train import state as state_lib

CFG = ModelConfig(vocab_size=128, hidden_size=48, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=12, qkv_bias=True,
                  tie_embeddings=False, model_type="qwen2")


def _params(model):
  return {tuple(p): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def reference():
  """An unsharded model (non-trivial biases) and its logits on a padded batch of 8 rows."""
  model = nnx.jit(lambda: Decoder(CFG, rngs=nnx.Rngs(0)))()
  bias = model.backbone.layers[0].qkv_bias
  bias[...] = 0.3 * jax.random.normal(jax.random.key(1), bias.shape)
  tokens = jax.random.randint(jax.random.key(2), (8, 10), 0, CFG.vocab_size, jnp.int32)
  valid = jnp.arange(10)[None] < jnp.array([10, 3, 7, 1, 10, 5, 8, 2])[:, None]
  logits = nnx.jit(lambda m: m(tokens, valid))(model)
  return model, tokens, valid, logits


def test_devices_available():
  assert jax.device_count() == 8, "conftest should give 8 fake CPU devices"


def test_make_mesh_sizes_and_errors():
  mesh = sharding.make_mesh([("data", -1), ("fsdp", 2), ("tensor", 1)])
  assert dict(mesh.shape) == {"data": 4, "fsdp": 2, "tensor": 1}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(ValueError, match="At most one"):
    sharding.make_mesh([("data", -1), ("fsdp", -1), ("tensor", 1)])
  with pytest.raises(ValueError, match="needs 6 devices"):
    sharding.make_mesh([("data", 3), ("fsdp", 2), ("tensor", 1)])
  with pytest.raises(ValueError, match="do not divide"):
    sharding.make_mesh([("data", -1), ("fsdp", 3), ("tensor", 1)])


@pytest.mark.parametrize("name, fsdp, tensor", [("v5p-128", 2, 1), ("v5p-128", 8, 2),
                                                ("v4-32", 2, 4)])
def test_a_mesh_axis_no_set_of_torus_sides_makes_splits_a_side_between_neighbours(
    name, fsdp, tensor):
  # v5p-128 is 4x4x4 chips and v4-32 2x2x4: no set of sides multiplies to 2 (or 2x4 is
  # taken), which jax.make_mesh refuses. The split side keeps each pair along the innermost
  # axis of more than one chip on neighbouring chips.
  devices = tpu_slices.devices(name)
  with pytest.raises(NotImplementedError, match="Failed to find assignment"):
    jax.make_mesh((len(devices) // (fsdp * tensor), fsdp, tensor), sharding.MESH_AXES,
                  devices=devices)
  mesh = sharding.make_mesh([("data", -1), ("fsdp", fsdp), ("tensor", tensor)], devices)
  assert dict(mesh.shape) == {"data": len(devices) // (fsdp * tensor), "fsdp": fsdp,
                              "tensor": tensor}
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
  innermost = mesh.devices[..., 0] if tensor == 1 else mesh.devices
  for a, b in innermost.reshape(-1, 2):
    assert sum(abs(x - y) for x, y in zip(a.coords, b.coords)) == 1, (a.coords, b.coords)


@pytest.mark.parametrize("name", ["v5p-128", "v4-32", "v5e-64"])
def test_meshes_jax_make_mesh_builds_are_unchanged(name):
  devices = tpu_slices.devices(name)
  for fsdp, tensor in ((1, 1), (4, 1), (4, 4), (1, 4)):
    want = jax.make_mesh((len(devices) // (fsdp * tensor), fsdp, tensor), sharding.MESH_AXES,
                         devices=devices)
    got = sharding.make_mesh([("data", -1), ("fsdp", fsdp), ("tensor", tensor)], devices)
    assert [d.id for d in got.devices.flat] == [d.id for d in want.devices.flat], (fsdp, tensor)


def test_logical_to_spec_rules_and_fallbacks():
  mesh = sharding.make_mesh([("data", 2), ("fsdp", 2), ("tensor", 2)])
  assert sharding.logical_to_spec(("embed", "qkv"), (48, 96), mesh) == P("fsdp", "tensor")
  assert sharding.logical_to_spec(("batch", None), (8, 3), mesh) == P(("data", "fsdp"), None)
  # 7 is not divisible by the 2 tensor devices: that axis stays replicated.
  assert sharding.logical_to_spec(("vocab", "embed"), (7, 48), mesh) == P(None, "fsdp")
  # Axes of size 1 are dropped.
  pure_dp = sharding.make_mesh([("data", 8), ("fsdp", 1), ("tensor", 1)])
  assert sharding.logical_to_spec(("embed", "mlp"), (48, 64), pure_dp) == P(None, None)
  with pytest.raises(KeyError, match="no rule"):
    sharding.logical_to_spec(("bogus",))


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 4, 1), (2, 2, 2)])
def test_sharded_forward_equals_unsharded(reference, shape):
  model, tokens, valid, expected = reference
  mesh = sharding.make_mesh(list(zip(sharding.MESH_AXES, shape)))
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, sharding.state_shardings(state, mesh))
  tokens_s, valid_s = sharding.shard_batch((tokens, valid), mesh)
  with jax.set_mesh(mesh):  # lets the model pin activations to the batch axes
    logits = jax.jit(lambda s, t, v: nnx.merge(graphdef, s)(t, v))(state, tokens_s, valid_s)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=1e-5)
  assert logits.sharding.spec[0] == (("data", "fsdp") if shape[1] > 1 else "data")
  # Decoding with a sharded cache agrees too.
  cache = KVCache.init(CFG, batch_size=8, max_len=12)
  cache = jax.device_put(cache, cache.shardings(mesh))
  step = jax.jit(lambda s, t, n, c: nnx.merge(graphdef, s).extend(t, n, c))
  num_new = jnp.sum(valid, axis=1, dtype=jnp.int32)
  with jax.set_mesh(mesh):
    chunk_logits, cache = step(state, tokens_s, num_new, cache)
  want = cache.shardings(mesh)
  for buf, spec in zip(cache.k + cache.v, want.k + want.v):
    assert buf.sharding.is_equivalent_to(spec, 4)
  np.testing.assert_allclose(np.asarray(chunk_logits)[np.asarray(valid)],
                             np.asarray(expected)[np.asarray(valid)], atol=1e-5)


def test_sharded_init_places_params_by_rules():
  mesh = sharding.make_mesh([("data", 2), ("fsdp", 2), ("tensor", 2)])
  model = sharding.sharded_init(lambda: Decoder(CFG, rngs=nnx.Rngs(0)), mesh)
  params = _params(model)
  expect = {
      ("backbone", "embed"): P("tensor", "fsdp"),
      ("backbone", "layers", 0, "qkv"): P("fsdp", "tensor"),
      ("backbone", "layers", 0, "qkv_bias"): P("tensor"),
      ("backbone", "layers", 1, "o"): P("tensor", "fsdp"),
      ("backbone", "layers", 1, "gate_up"): P("fsdp", "tensor"),
      ("backbone", "layers", 1, "down"): P("tensor", "fsdp"),
      ("backbone", "final_norm", "scale"): P(None),
      ("lm_head",): P("fsdp", "tensor"),
  }
  for path, spec in expect.items():
    assert params[path].sharding == NamedSharding(mesh, spec), path
  # Each device holds only its shard.
  qkv = params[("backbone", "layers", 0, "qkv")]
  assert qkv.addressable_shards[0].data.shape == (24, qkv.shape[1] // 2)
  # Same values as creating the model unsharded (partitionable RNG).
  plain = _params(nnx.jit(lambda: Decoder(CFG, rngs=nnx.Rngs(0)))())
  for path, value in plain.items():
    np.testing.assert_array_equal(np.asarray(params[path]), np.asarray(value), err_msg=path)


def test_load_hf_onto_mesh(reference, tmp_path):
  model, tokens, valid, expected = reference
  save_hf(model, tmp_path)
  mesh = sharding.make_mesh([("data", 2), ("fsdp", 4), ("tensor", 1)])
  cfg, loaded = load_hf(tmp_path, mesh=mesh)
  assert cfg == CFG
  params = _params(loaded)
  assert params[("backbone", "layers", 0, "gate_up")].sharding == NamedSharding(
      mesh, P("fsdp", None))
  assert params[("lm_head",)].sharding == NamedSharding(mesh, P("fsdp", None))
  logits = nnx.jit(lambda m: m(tokens, valid))(loaded)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=1e-5)


def test_the_rollout_mesh_puts_the_fsdp_chips_on_tensor_as_far_as_kv_heads_divide():
  mesh = sharding.make_mesh([("data", 2), ("fsdp", 4), ("tensor", 1)])
  for kv_heads, tensor in ((4, 4), (2, 2), (6, 2), (1, 1)):
    rollout = sharding.rollout_mesh(mesh, kv_heads)
    assert dict(rollout.shape) == {"data": 8 // tensor, "fsdp": 1, "tensor": tensor}
    # The same devices in the same order: a tensor group is neighbours of one fsdp group.
    assert [d.id for d in rollout.devices.flat] == [d.id for d in mesh.devices.flat]
  no_fsdp = sharding.make_mesh([("data", 4), ("fsdp", 1), ("tensor", 2)])
  assert sharding.rollout_mesh(no_fsdp, 2) is no_fsdp
  assert sharding.rollout_mesh(None, 2) is None


def test_a_rollout_on_its_mesh_gathers_no_weights_and_matches_the_unsharded_model(reference):
  # The trainer's FSDP mesh, and the rollout's copy of the weights (`state.rollout_layout`):
  # heads, MLP units and vocabulary split over the 4 chips FSDP shards them over, no axis on
  # `embed`. The FSDP mesh's step gathers weights; the rollout mesh's exchanges activations.
  model, tokens, valid, expected = reference
  mesh = sharding.make_mesh([("data", 2), ("fsdp", 4), ("tensor", 1)])
  graphdef, state = state_lib.split_params(model)
  rollout, shardings = state_lib.rollout_layout(graphdef, state, mesh)
  assert dict(rollout.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
  layer = shardings["backbone"]["layers"][0]
  assert layer["qkv"].spec == P(None, "tensor") and layer["down"].spec == P("tensor", None)
  assert shardings["backbone"]["embed"].spec == P("tensor", None)
  num_new = jnp.sum(valid, axis=1, dtype=jnp.int32)
  step = jax.jit(lambda s, t, n, c: nnx.merge(graphdef, s).extend(t, n, c))
  weights = {tuple(x.shape) for x in jax.tree.leaves(state) if x.ndim == 2}
  gathers = {}
  for name, where, layout in (("fsdp", mesh, sharding.state_shardings(
      nnx.state(model, nnx.Param), mesh).to_pure_dict()), ("rollout", rollout, shardings)):
    params = jax.device_put(state, layout)
    cache = KVCache.init(CFG, batch_size=8, max_len=12)
    cache = jax.device_put(cache, cache.shardings(where))
    args = (params, *sharding.shard_batch((tokens, num_new), where), cache)
    with jax.set_mesh(where):
      hlo = step.lower(*args).compile().as_text()
      gathered = {tuple(map(int, dims.split(","))) for dims in
                  re.findall(r"= \w+\[([\d,]+)\]\S* all-gather\(", hlo)}
      gathers[name] = sorted(gathered & weights)
      chunk_logits, cache = step(*args)
    np.testing.assert_allclose(np.asarray(chunk_logits)[np.asarray(valid)],
                               np.asarray(expected)[np.asarray(valid)], atol=1e-5)
  # (The rollout's own gathers are the rows' new keys and values, for the cache's scatter.)
  assert gathers["fsdp"] and not gathers["rollout"], gathers
