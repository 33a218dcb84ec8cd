"""The jitted update: exact micro-batching, token alignment, skip on non-finite, sharding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentgym_jax import sharding
from agentgym_jax.models import Decoder, ModelConfig, ValueModel
from agentgym_jax.rl import losses
from agentgym_jax.train import config as base
from agentgym_jax.train import state as state_lib
from agentgym_jax.train import update as update_lib

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2)
ROWS, LENGTH = 16, 20


def _config(**algo):
  c = base.base_config()
  c.algo.advantage = algo.pop("advantage", "grpo")
  for key, value in algo.items():
    c.algo[key] = value
  c.optim.lr = 1e-2
  c.total_steps = 10
  return c


def _batch(seed=0, rows=ROWS, length=LENGTH):
  """Right-padded rows with a prompt, two agent turns and an observation between them."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, CFG.vocab_size, (rows, length)).astype(np.int32)
  lengths = rng.integers(length // 2, length + 1, rows)
  lengths[3] = 4  # a row that ends inside its prompt: no agent token at all
  positions = np.arange(length)[None]
  valid = positions < lengths[:, None]
  agent = ((positions >= 4) & (positions < 8)) | ((positions >= 11) & (positions < 15))
  mask = valid & agent
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return {
      "tokens": jnp.asarray(tokens), "valid": jnp.asarray(valid), "loss_mask": jnp.asarray(mask),
      "old_logprobs": f32(rng.normal(-3.0, 0.3, (rows, length)) * mask),
      "ref_logprobs": f32(rng.normal(-3.0, 0.3, (rows, length)) * mask),
      "advantages": f32(rng.normal(size=(rows, length)) * mask),
      "returns": f32(rng.normal(size=(rows, length)) * mask),
      "old_values": f32(rng.normal(size=(rows, length)) * mask),
  }


@functools.lru_cache(maxsize=None)
def _models():
  policy = Decoder(CFG, rngs=nnx.Rngs(0))
  critic = ValueModel(CFG, rngs=nnx.Rngs(1))
  # A non-zero head, so value gradients reach the whole backbone.
  critic.head[...] = jax.random.normal(jax.random.key(2), critic.head.shape) * 0.1
  return state_lib.split_params(policy), state_lib.split_params(critic)


# ----- token alignment -------------------------------------------------------------------------


def test_token_logprobs_and_entropy_sit_on_the_scored_token():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(2, 5, 7)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 7, (2, 5)), jnp.int32)
  temperature = 0.7
  got = update_lib.token_logprobs(logits, tokens, temperature)
  got_entropy = update_lib.token_entropy(logits, temperature)
  log_p = np.asarray(jax.nn.log_softmax(np.asarray(logits) / temperature, axis=-1))
  for b in range(2):
    assert got[b, 0] == 0.0 and got_entropy[b, 0] == 0.0
    for t in range(1, 5):
      np.testing.assert_allclose(got[b, t], log_p[b, t - 1, tokens[b, t]], rtol=1e-6)
      np.testing.assert_allclose(got_entropy[b, t], -np.sum(np.exp(log_p[b, t - 1]) *
                                                            log_p[b, t - 1]), rtol=1e-5)


def test_split_micro_strides_rows_and_merge_inverts_it():
  x = jnp.arange(12).reshape(6, 2)
  micro = update_lib.split_micro(x, 3)
  assert micro.shape == (3, 2, 2)
  np.testing.assert_array_equal(micro[1], x[np.array([1, 4])])
  np.testing.assert_array_equal(update_lib.merge_micro(micro), x)
  with pytest.raises(ValueError, match="do not split"):
    update_lib.split_micro(x, 4)


# ----- micro-batching is exact -----------------------------------------------------------------


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_gradient_does_not_depend_on_micro_batches(mode):
  (policy_def, policy), (critic_def, critic) = _models()
  cfg = update_lib.UpdateConfig.from_config(
      _config(advantage="gae", loss_agg_mode=mode, kl_coef=0.1, entropy_coef=0.01))
  batch = _batch()
  den = losses.aggregation_denominator(batch["loss_mask"], mode)
  for fn, params in ((update_lib.policy_loss, policy), (update_lib.critic_loss, critic)):
    loss_fn = functools.partial(fn, graphdef=policy_def if fn is update_lib.policy_loss
                                else critic_def, cfg=cfg)
    acc = jax.jit(update_lib.accumulate_gradients, static_argnums=(0, 4))
    loss1, grads1, aux1 = acc(loss_fn, params, batch, den, 1)
    loss4, grads4, aux4 = acc(loss_fn, params, batch, den, 4)
    # Reference: the loss of the whole minibatch in one piece, without any denominator trick.
    direct, _ = jax.grad(lambda p: loss_fn(p, batch, den), has_aux=True)(params)
    np.testing.assert_allclose(loss4, loss1, atol=1e-6)
    for g1, g4, gd in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads4),
                          jax.tree.leaves(direct)):
      assert float(jnp.max(jnp.abs(g1 - g4))) < 1e-5, mode
      assert float(jnp.max(jnp.abs(g1 - gd))) < 1e-5, mode
    for key in aux1:
      np.testing.assert_allclose(aux4[key], aux1[key], rtol=1e-5, atol=1e-6)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(grads1))


def test_token_mean_loss_is_the_mean_over_agent_tokens():
  (policy_def, policy), _ = _models()
  cfg = update_lib.UpdateConfig.from_config(_config(kl_coef=0.0, entropy_coef=0.0))
  batch = _batch()
  den = losses.aggregation_denominator(batch["loss_mask"], "token-mean")
  loss, aux = update_lib.policy_loss(policy, batch, den, graphdef=policy_def, cfg=cfg)
  logits = nnx.merge(policy_def, policy)(batch["tokens"], batch["valid"])
  logp = np.asarray(update_lib.token_logprobs(logits, batch["tokens"]))
  mask = np.asarray(batch["loss_mask"])
  ratio = np.exp(logp - np.asarray(batch["old_logprobs"]))
  adv = np.asarray(batch["advantages"])
  per_token = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2))
  np.testing.assert_allclose(loss, per_token[mask].mean(), rtol=1e-5)
  np.testing.assert_allclose(aux["pg_loss"], loss, rtol=1e-6)


# ----- the whole update --------------------------------------------------------------------------


def _setup(mesh_axes, **algo):
  config = _config(**algo)
  config.algo.minibatches = 2
  config.algo.microbatches = 2
  mesh = sharding.make_mesh(mesh_axes)
  ucfg = update_lib.UpdateConfig.from_config(config)
  policy = sharding.sharded_init(lambda: Decoder(CFG, rngs=nnx.Rngs(0)), mesh)
  critic = (sharding.sharded_init(lambda: ValueModel(CFG, rngs=nnx.Rngs(1)), mesh)
            if ucfg.use_critic else None)
  opts = state_lib.Optimizers.from_config(config, with_critic=critic is not None)
  policy_def, policy_params = state_lib.split_params(policy)
  critic_def, critic_params = state_lib.split_params(critic) if critic else (None, None)
  shardings = state_lib.train_state_shardings(
      policy_shardings=state_lib.param_shardings(policy, mesh),
      critic_shardings=state_lib.param_shardings(critic, mesh) if critic else None,
      keep_reference=ucfg.kl_in_loss, optimizers=opts, policy=policy_params,
      critic=critic_params, mesh=mesh)
  state = state_lib.init_train_state(policy=policy_params, critic=critic_params,
                                     keep_reference=ucfg.kl_in_loss, optimizers=opts, seed=0,
                                     shardings=shardings)
  step = update_lib.make_update_step(policy_def, critic_def, opts, ucfg, mesh, shardings)
  scorers = update_lib.make_scorers(policy_def, critic_def, ucfg.temperature, 2, mesh)
  return state, step, scorers, mesh, shardings


def _update_batch(state, scorers, mesh, seed=0, advantage=None):
  batch = _batch(seed)
  logprobs, values = scorers
  batch = sharding.shard_batch(batch, mesh)
  batch["old_logprobs"] = logprobs(state.policy, batch["tokens"], batch["valid"])
  batch["ref_logprobs"] = batch["old_logprobs"]
  if values is not None:
    batch["old_values"] = values(state.critic, batch["tokens"], batch["valid"])
  if advantage is not None:
    batch["advantages"] = jnp.where(batch["loss_mask"], advantage, 0.0)
  return batch


def _copy(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_update_moves_log_probs_in_the_advantage_direction(sign):
  state, step, scorers, mesh, _ = _setup((("data", -1), ("fsdp", 1), ("tensor", 1)),
                                         kl_coef=0.0, entropy_coef=0.0)
  batch = _update_batch(state, scorers, mesh, advantage=sign)
  before = np.asarray(batch["old_logprobs"])[np.asarray(batch["loss_mask"])].mean()
  state, metrics = step(state, batch)
  after_lp = scorers[0](state.policy, batch["tokens"], batch["valid"])
  after = np.asarray(after_lp)[np.asarray(batch["loss_mask"])].mean()
  assert np.sign(after - before) == sign
  assert int(state.step) == 1 and float(metrics["actor/skipped"]) == 0.0


def test_non_finite_loss_skips_the_update_and_training_continues():
  state, step, scorers, mesh, _ = _setup((("data", 2), ("fsdp", 2), ("tensor", 2)),
                                         advantage="gae", kl_coef=0.01)
  batch = _update_batch(state, scorers, mesh)
  poisoned = dict(batch)
  poisoned["advantages"] = batch["advantages"].at[0, 5].set(jnp.nan)
  poisoned["returns"] = batch["returns"].at[0, 5].set(jnp.inf)
  before = _copy((state.policy, state.opt_state, state.critic, state.critic_opt_state))
  state, metrics = step(state, poisoned)
  after = _copy((state.policy, state.opt_state, state.critic, state.critic_opt_state))
  assert float(metrics["actor/skipped"]) == 1.0 and float(metrics["critic/skipped"]) == 1.0
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)
  assert int(state.step) == 1  # the step still counts: the rollout batch was consumed
  state, metrics = step(state, _update_batch(state, scorers, mesh, seed=1))
  assert float(metrics["actor/skipped"]) == 0.0 and float(metrics["critic/skipped"]) == 0.0
  moved = _copy(state.policy)
  assert any(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(before[0]), jax.tree.leaves(moved)))
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(moved))


def test_update_keeps_shardings_and_donates_the_old_state():
  state, step, scorers, mesh, shardings = _setup((("data", 2), ("fsdp", 2), ("tensor", 2)),
                                                 advantage="gae", kl_coef=0.01)
  batch = _update_batch(state, scorers, mesh)
  old_leaf = jax.tree.leaves(state.policy)[0]
  new_state, metrics = step(state, batch)
  assert old_leaf.is_deleted()  # donated: its buffer now backs the new state
  for leaf, expected in zip(jax.tree.leaves(new_state), jax.tree.leaves(shardings)):
    assert leaf.sharding.is_equivalent_to(expected, leaf.ndim)
  assert any(leaf.sharding.spec != () and any(leaf.sharding.spec)
             for leaf in jax.tree.leaves(new_state.policy))  # really split somewhere
  expected = {"actor/pg_loss", "actor/entropy", "actor/kl", "actor/clip_frac", "actor/grad_norm",
              "actor/lr", "actor/skipped", "critic/value_loss", "critic/vf_clip_frac",
              "critic/grad_norm"}
  assert expected <= set(metrics)


def test_sharded_update_equals_single_device_update():
  results = []
  for axes in ((("data", 8), ("fsdp", 1), ("tensor", 1)), (("data", 2), ("fsdp", 2),
                                                           ("tensor", 2))):
    state, step, scorers, mesh, _ = _setup(axes, advantage="gae", kl_coef=0.01)
    state, metrics = step(state, _update_batch(state, scorers, mesh))
    results.append((_copy(state.policy), float(metrics["actor/pg_loss"])))
  np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(results[0][0]), jax.tree.leaves(results[1][0])):
    np.testing.assert_allclose(a, b, atol=1e-5)


# ----- configuration -------------------------------------------------------------------------


def test_learning_rate_schedules():
  c = base.base_config()
  c.optim.warmup_steps = 2
  c.optim.decay = "cosine"
  c.optim.end_lr_fraction = 0.1
  schedule = state_lib.lr_schedule(c.optim, 1.0, total_steps=10, updates_per_step=3)
  assert float(schedule(0)) == 0.0
  np.testing.assert_allclose(schedule(3), 0.5, rtol=1e-6)  # warm-up counts 6 updates
  np.testing.assert_allclose(schedule(6), 1.0, rtol=1e-6)
  np.testing.assert_allclose(schedule(30), 0.1, rtol=1e-6)
  c.optim.decay = "constant"
  c.optim.warmup_steps = 0
  assert float(state_lib.lr_schedule(c.optim, 0.3, 10, 3)(17)) == pytest.approx(0.3)
  c.optim.decay = "step"
  with pytest.raises(ValueError, match="optim.decay"):
    state_lib.lr_schedule(c.optim, 0.3, 10, 3)


@pytest.mark.parametrize("field,value,match", [
    ("loss_agg_mode", "token-sum", "loss_agg_mode"),
    ("kl_estimator", "k9", "kl_estimator"),
    ("clip_dual", 0.5, "clip_dual"),
    ("minibatches", 0, "minibatches"),
])
def test_update_config_rejects_bad_values(field, value, match):
  c = base.base_config()
  c.algo[field] = value
  with pytest.raises(ValueError, match=match):
    update_lib.UpdateConfig.from_config(c)
