"""The jitted update: exact micro-batching, token alignment, skip on non-finite, sharding, and
old log-probs from its own forward (the same step as scoring them apart, one forward fewer)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from agentgym_jax import settings as settings_lib
from agentgym_jax import multihost, policies
from agentgym_jax import sharding
from agentgym_jax.models import Decoder, ModelConfig, ValueModel
from agentgym_jax.rl import algorithm
from agentgym_jax.rl import logprobs as logprobs_lib
from agentgym_jax.rl import losses
from agentgym_jax.rollout.trajectory import bucket_length
from agentgym_jax.tokenization import ChatTokenizer
from agentgym_jax.train import batches, data
from agentgym_jax.train import config as base
from agentgym_jax.train import state as state_lib
from agentgym_jax.train import update as update_lib
from environments.workers import StepOutcome

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2)
ROWS, LENGTH = 16, 20


@pytest.fixture(scope="module", autouse=True)
def _fast_compiles():
  """Tiny models: XLA's optimisation passes cost more time than they save."""
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", False)


def _config(**algo):
  c = base.base_config()
  c.algo.estimator = algo.pop("estimator", "grpo")
  for key, value in algo.items():
    c.algo[key] = value
  c.optim.lr = 1e-2
  c.total_steps = 10
  return c


def _forward(batch, positions=None):
  """What the scorers and `sequence_logprobs_and_entropy` read of a batch."""
  rows = {"tokens": batch["tokens"], "valid": batch["valid"]}
  return rows if positions is None else rows | {"scored_positions": positions}


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
  got = logprobs_lib.token_logprobs(logits, tokens, temperature)
  both, got_entropy = logprobs_lib.token_logprobs_and_entropy(logits, tokens, temperature)
  np.testing.assert_allclose(both, got, atol=1e-6)
  log_p = np.asarray(jax.nn.log_softmax(np.asarray(logits) / temperature, axis=-1))
  for b in range(2):
    assert got[b, 0] == 0.0 and got_entropy[b, 0] == 0.0
    for t in range(1, 5):
      np.testing.assert_allclose(got[b, t], log_p[b, t - 1, tokens[b, t]], rtol=1e-6)
      np.testing.assert_allclose(got_entropy[b, t], -np.sum(np.exp(log_p[b, t - 1]) *
                                                            log_p[b, t - 1]), rtol=1e-5)


# 4 rows x 19 scored positions x 48 logits: 1, 6 (the last padded) and 19 blocks of positions.
@pytest.mark.parametrize("block", [7296, 640, 192])
def test_blocked_lm_head_gives_the_same_logprobs_entropy_and_gradient(monkeypatch, block):
  (graphdef, params), _ = _models()
  batch = _batch(rows=4)
  tokens, valid = batch["tokens"], batch["valid"]

  def loss(params):
    model = nnx.merge(graphdef, params)
    logp, entropy = update_lib.sequence_logprobs_and_entropy(
        model, {"tokens": tokens, "valid": valid}, 0.7)
    return jnp.sum(logp * batch["advantages"]) + jnp.sum(entropy), (logp, entropy)

  (_, want), want_grads = jax.value_and_grad(loss, has_aux=True)(params)
  plain = logprobs_lib.token_logprobs_and_entropy(nnx.merge(graphdef, params)(tokens, valid),
                                                tokens, 0.7)
  np.testing.assert_allclose(want[0], plain[0], atol=1e-5)
  monkeypatch.setattr(logprobs_lib, "_LOGIT_BLOCK", block)
  (_, got), got_grads = jax.value_and_grad(loss, has_aux=True)(params)
  for a, b in zip(got + tuple(jax.tree.leaves(got_grads)),
                  want + tuple(jax.tree.leaves(want_grads))):
    np.testing.assert_allclose(a, b, atol=2e-5)


def test_token_logprobs_and_entropy_gradient_is_autodiff_of_log_softmax():
  """The closed-form backward equals differentiating log-softmax, gather and entropy."""
  rng = np.random.default_rng(1)
  logits = jnp.asarray(3 * rng.normal(size=(2, 6, 11)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 11, (2, 6)), jnp.int32)
  w_logp, w_entropy = (jnp.asarray(rng.normal(size=(2, 5)), jnp.float32) for _ in range(2))

  def ours(x):  # [B, L - 1] scores of tokens 1..L-1
    logp, entropy = logprobs_lib.token_logprobs_and_entropy(x, tokens, 0.7)
    return logp[:, 1:], entropy[:, 1:]

  def reference(x):
    log_p = jax.nn.log_softmax(x[:, :-1] / 0.7, axis=-1)
    picked = jnp.take_along_axis(log_p, tokens[:, 1:, None], axis=-1)[..., 0]
    return picked, -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)

  def loss(fn, x):
    logp, entropy = fn(x)
    return jnp.sum(w_logp * logp + w_entropy * entropy)

  np.testing.assert_allclose(jax.grad(functools.partial(loss, ours))(logits),
                             jax.grad(functools.partial(loss, reference))(logits), atol=1e-6)


def test_split_micro_strides_rows_and_merge_inverts_it():
  x = jnp.arange(12).reshape(6, 2)
  micro = update_lib.split_micro(x, 3)
  assert micro.shape == (3, 2, 2)
  np.testing.assert_array_equal(micro[1], x[np.array([1, 4])])
  np.testing.assert_array_equal(update_lib.merge_micro(micro), x)
  with pytest.raises(ValueError, match="do not split"):
    update_lib.split_micro(x, 4)


# ----- micro-batching is exact -----------------------------------------------------------------


def _grads_by_micro_batches(loss_fn, params, batch, den):
  """(loss, grads, aux) with 1 and with 4 micro-batches, compiled as one function."""
  acc = functools.partial(update_lib.accumulate_gradients, loss_fn)
  return jax.jit(lambda p, b, d: (acc(p, b, d, 1), acc(p, b, d, 4)))(params, batch, den)


def _assert_same(one, four, label):
  (loss1, grads1, aux1), (loss4, grads4, aux4) = one, four
  np.testing.assert_allclose(loss4, loss1, atol=1e-6)
  for g1, g4 in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads4)):
    assert float(jnp.max(jnp.abs(g1 - g4))) < 1e-5, label
  assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(grads1)), label
  for key in aux1:
    np.testing.assert_allclose(aux4[key], aux1[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_policy_gradient_does_not_depend_on_micro_batches(mode):
  (policy_def, policy), _ = _models()
  cfg = update_lib.UpdateConfig.from_config(
      _config(loss_agg_mode=mode, kl_coef=0.1, entropy_coef=0.01))
  batch = _batch()
  den = losses.aggregation_denominator(batch["loss_mask"], mode)
  loss_fn = functools.partial(update_lib.policy_loss, graphdef=policy_def, cfg=cfg)
  _assert_same(*_grads_by_micro_batches(loss_fn, policy, batch, den), mode)


def test_value_gradient_does_not_depend_on_micro_batches():
  _, (critic_def, critic) = _models()
  mode = "seq-mean-token-mean"  # the one mode whose per-row term is not a plain token sum
  cfg = update_lib.UpdateConfig.from_config(_config(estimator="gae", loss_agg_mode=mode))
  batch = _batch()
  den = losses.aggregation_denominator(batch["loss_mask"], mode)
  loss_fn = functools.partial(update_lib.critic_loss, graphdef=critic_def, cfg=cfg)
  _assert_same(*_grads_by_micro_batches(loss_fn, critic, batch, den), mode)


def test_token_mean_loss_is_the_mean_over_agent_tokens():
  (policy_def, policy), _ = _models()
  cfg = update_lib.UpdateConfig.from_config(_config(kl_coef=0.0, entropy_coef=0.0))
  batch = _batch()
  den = losses.aggregation_denominator(batch["loss_mask"], "token-mean")
  loss, aux = jax.jit(functools.partial(update_lib.policy_loss, graphdef=policy_def, cfg=cfg))(
      policy, batch, den)
  logits = jax.jit(lambda p, t, v: nnx.merge(policy_def, p)(t, v))(
      policy, batch["tokens"], batch["valid"])
  log_p = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1))
  tokens = np.asarray(batch["tokens"])
  logp = np.zeros(tokens.shape)
  logp[:, 1:] = np.take_along_axis(log_p[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
  mask = np.asarray(batch["loss_mask"])
  ratio = np.exp(logp - np.asarray(batch["old_logprobs"]))
  adv = np.asarray(batch["advantages"])
  per_token = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2))
  np.testing.assert_allclose(loss, per_token[mask].mean(), rtol=1e-5)
  np.testing.assert_allclose(aux["pg_loss"], loss, rtol=1e-6)


# ----- the whole update --------------------------------------------------------------------------


class _Run:
  """A compiled update (by default gae + KL term, 2 minibatches x 2 micro-batches) and its
  initial state.

  Built once per mesh; `fresh()` hands out a new copy of the initial state (the update
  donates the state it is given).
  """

  def __init__(self, mesh, config=None):
    if config is None:
      config = _config(estimator="gae", kl_coef=0.01, entropy_coef=0.001)
      config.algo.minibatches = 2
      config.algo.microbatches = 2
    self.mesh = mesh
    ucfg = update_lib.UpdateConfig.from_config(config)
    policy = sharding.sharded_init(lambda: Decoder(CFG, rngs=nnx.Rngs(0)), mesh)
    critic = sharding.sharded_init(lambda: ValueModel(CFG, rngs=nnx.Rngs(1)), mesh)
    opts = state_lib.Optimizers.from_config(config, with_critic=True)
    policy_def, policy_params = state_lib.split_params(policy)
    critic_def, critic_params = state_lib.split_params(critic)
    self.shardings = state_lib.train_state_shardings(
        policy_shardings=state_lib.param_shardings(policy, mesh),
        critic_shardings=state_lib.param_shardings(critic, mesh), keep_reference=True,
        optimizers=opts, policy=policy_params, critic=critic_params, mesh=mesh)
    state = state_lib.init_train_state(policy=policy_params, critic=critic_params,
                                       keep_reference=True, optimizers=opts, seed=0,
                                       shardings=self.shardings)
    self.initial = _copy(state)
    self.policy_def, self.critic_def, self.opts = policy_def, critic_def, opts
    self.step = update_lib.make_update_step(policy_def, critic_def, opts, ucfg, mesh,
                                            self.shardings)
    self.logprobs, self.values = update_lib.make_scorers(
        policy_def, critic_def, dataclasses.replace(ucfg, minibatches=1, microbatches=2), mesh)

  def fresh(self):
    return jax.device_put(self.initial, self.shardings)

  def batch(self, state, seed=0, advantage=None):
    batch = sharding.shard_batch(_batch(seed), self.mesh)
    batch["old_logprobs"] = self.logprobs(state.policy, _forward(batch))
    batch["ref_logprobs"] = batch["old_logprobs"]
    batch["old_values"] = self.values(state.critic, _forward(batch))
    if advantage is not None:
      batch["advantages"] = jnp.where(batch["loss_mask"], advantage, 0.0)
    return batch


def _copy(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


@pytest.fixture(scope="module")
def run():
  return _Run(sharding.make_mesh((("data", 2), ("fsdp", 2), ("tensor", 2))))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_update_moves_log_probs_in_the_advantage_direction(run, sign):
  state = run.fresh()
  batch = run.batch(state, advantage=sign)
  mask = np.asarray(batch["loss_mask"])
  before = np.asarray(batch["old_logprobs"])[mask].mean()
  state, metrics = run.step(state, batch)
  after = np.asarray(run.logprobs(state.policy, _forward(batch))
                     )[mask].mean()
  assert np.sign(after - before) == sign
  assert int(state.step) == 1 and float(metrics["actor/skipped"]) == 0.0


def test_non_finite_loss_skips_the_update_and_training_continues(run):
  state = run.fresh()
  batch = run.batch(state)
  poisoned = dict(batch)
  # Every minibatch gets a NaN advantage and an infinite return on an agent token.
  poisoned["advantages"] = batch["advantages"].at[:, 5].set(jnp.nan)
  poisoned["returns"] = batch["returns"].at[:, 5].set(jnp.inf)
  before = _copy((state.policy, state.opt_state, state.critic, state.critic_opt_state))
  state, metrics = run.step(state, poisoned)
  after = _copy((state.policy, state.opt_state, state.critic, state.critic_opt_state))
  assert float(metrics["actor/skipped"]) == 1.0 and float(metrics["critic/skipped"]) == 1.0
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)
  assert int(state.step) == 1  # the step still counts: the rollout batch was consumed
  state, metrics = run.step(state, run.batch(state, seed=1))
  assert float(metrics["actor/skipped"]) == 0.0 and float(metrics["critic/skipped"]) == 0.0
  moved = _copy(state.policy)
  assert any(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(before[0]), jax.tree.leaves(moved)))
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(moved))


def test_update_keeps_shardings_and_donates_the_old_state(run):
  state = run.fresh()
  batch = run.batch(state)
  old_leaf = jax.tree.leaves(state.policy)[0]
  new_state, metrics = run.step(state, batch)
  assert old_leaf.is_deleted()  # donated: its buffer now backs the new state
  for leaf, expected in zip(jax.tree.leaves(new_state), jax.tree.leaves(run.shardings)):
    assert leaf.sharding.is_equivalent_to(expected, leaf.ndim)
  assert any(any(leaf.sharding.spec) for leaf in jax.tree.leaves(new_state.policy))
  expected = {"actor/pg_loss", "actor/entropy", "actor/kl", "actor/clip_frac", "actor/grad_norm",
              "actor/lr", "actor/skipped", "critic/value_loss", "critic/vf_clip_frac",
              "critic/grad_norm"}
  assert expected <= set(metrics)


def test_sharded_update_equals_single_device_update(run):
  single = _Run(sharding.make_mesh((("data", 1), ("fsdp", 1), ("tensor", 1)),
                                   devices=jax.devices()[:1]))
  results = []
  for r in (run, single):
    state = r.fresh()
    state, metrics = r.step(state, r.batch(state))
    results.append((_copy(state), float(metrics["actor/pg_loss"])))
  np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(results[0][0]), jax.tree.leaves(results[1][0])):
    np.testing.assert_allclose(a, b, atol=2e-5)


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


def test_the_jitted_steps_pin_activations_whoever_calls_them(run):
  # Lowered outside any `jax.set_mesh`, as the trainer calls them: the decoder's pins on the
  # [rows, T, D] activations (`sharding.constrain`) must still be in the programs.
  state = run.fresh()
  batch = run.batch(state)
  hidden = f"x{CFG.hidden_size}xf32>"
  def activation_pins(lowered):
    return [line for line in lowered.as_text().splitlines()
            if "sharding_constraint" in line and line.rstrip().endswith(hidden)]
  update = activation_pins(run.step.lower(state, batch))
  scoring = activation_pins(run.logprobs.lower(state.policy, _forward(batch)))
  # One pin after the embedding and one after each block, forward (and its remat/backward).
  assert len(update) >= CFG.num_layers + 1, update
  assert len(scoring) >= CFG.num_layers + 1, scoring
  assert all('{"data", "fsdp"}' in line for line in update + scoring), update + scoring


def test_bfloat16_compute_is_mixed_precision_with_float32_gradients():
  (graphdef, params), _ = _models()
  batch = _batch(rows=4)

  def loss(params, dtype):
    model = nnx.merge(graphdef, update_lib.as_compute(params, dtype))
    logp, _ = update_lib.sequence_logprobs_and_entropy(model, _forward(batch))
    return jnp.sum(jnp.where(batch["loss_mask"], logp, 0.0))

  (full, full_grads), (mixed, mixed_grads) = (
      jax.value_and_grad(loss)(params, dtype) for dtype in ("float32", "bfloat16"))
  np.testing.assert_allclose(mixed, full, rtol=2e-2)
  for a, b in zip(jax.tree.leaves(mixed_grads), jax.tree.leaves(full_grads)):
    assert a.dtype == jnp.float32  # the master weights' gradients
    np.testing.assert_allclose(a, b, atol=0.05 * float(np.abs(b).max()) + 1e-6)


# ----- old log-probs from the update's own forward ---------------------------------------------


@pytest.mark.parametrize("mode,algo,expected", [
    ("rl", {}, False),  # the base config: 2 minibatches, the second starts from moved params
    ("rl", {"minibatches": 1}, True),
    ("rl", {"minibatches": 1, "microbatches": 4}, True),  # params only move after the last
    ("rl", {"minibatches": 1, "epochs": 2}, False),
    ("rl", {"minibatches": 1, "tis_cap": 2.0}, True),
    ("rl", {"minibatches": 1, "kl_in_reward": True}, False),  # the reward reads them first
    ("rl", {"minibatches": 1, "kl_in_reward": True, "kl_coef": 0.0}, True),  # no KL at all
    ("bc", {"minibatches": 1}, False),  # cross-entropy reads no old log-probs
])
def test_old_logprobs_come_from_the_update_when_nothing_needs_them_before_it(mode, algo,
                                                                             expected):
  c = _config(**algo)
  c.mode = mode
  cfg = update_lib.UpdateConfig.from_config(c)
  assert cfg.algo.old_logprobs_from_update is expected
  z = jnp.zeros((2, 3))
  batch = update_lib.build_batch(cfg.algo, tokens=z, valid=z, loss_mask=z, old_logprobs=z,
                                 advantages=z, ref_logprobs=z, returns=z, values=z,
                                 rollout_logprobs=z)
  assert ("old_logprobs" not in batch) is expected
  # The update compares its log-probs with the sampler's: the batch must hold them.
  if expected:
    with pytest.raises(ValueError, match=r"\['rollout_logprobs'\]"):
      update_lib.build_batch(cfg.algo, tokens=z, valid=z, loss_mask=z, advantages=z,
                             ref_logprobs=z)


def test_update_config_refuses_old_logprobs_from_an_update_of_several_steps():
  cfg = update_lib.UpdateConfig.from_config(_config(minibatches=1))
  with pytest.raises(ValueError, match="epochs=1 x minibatches=2"):
    dataclasses.replace(cfg, minibatches=2)


# Adam's first step moves each parameter by lr x g / (|g| + eps): where a gradient is ~eps, the
# gradients' 1e-7 agreement leaves up to ~1e-3 of lr to chance, so parameters are compared at
# 1e-6 after steps of 1e-3 (still a thousandth of a step).
_PARITY_LR = 1e-3


def _update_step(run, cfg):
  return update_lib.make_update_step(run.policy_def, run.critic_def, run.opts, cfg, run.mesh,
                                     run.shardings)


def _off_policy_path(cfg):
  """`cfg` with its old log-probs scored before the update (today's separate forward)."""
  return dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo,
                                                           old_logprobs_from_update=False))


@pytest.mark.parametrize("estimator,algo", [
    # KL term, truncated importance sampling (the sampler's log-probs are off by up to ~e^0.3),
    # dual clip, 2 micro-batches, per-episode aggregation.
    ("grpo", dict(kl_coef=0.05, tis_cap=1.2, clip_dual=3.0, microbatches=2,
                  loss_agg_mode="seq-mean-token-mean")),
    ("gae", dict(kl_coef=0.0, microbatches=1)),  # with a critic
])
def test_on_policy_update_equals_the_update_on_separately_scored_old_logprobs(estimator, algo):
  config = _config(estimator=estimator, minibatches=1, entropy_coef=0.01, **algo)
  config.optim.lr = _PARITY_LR
  mesh = sharding.make_mesh((("data", 2), ("fsdp", 2), ("tensor", 1)),
                            devices=jax.devices()[:4])
  run = _Run(mesh, config)
  on = update_lib.UpdateConfig.from_config(config)
  off = _off_policy_path(on)
  assert on.algo.old_logprobs_from_update
  state = run.fresh()
  batch = sharding.shard_batch(_batch(), mesh)
  old = run.logprobs(state.policy, _forward(batch))
  mask = np.asarray(batch["loss_mask"])
  noise = np.random.default_rng(3).uniform(-0.3, 0.3, mask.shape) * mask
  rollout = jnp.where(batch["loss_mask"], old + jnp.asarray(noise, jnp.float32), 0.0)
  fields = dict(tokens=batch["tokens"], valid=batch["valid"], loss_mask=batch["loss_mask"],
                advantages=batch["advantages"], ref_logprobs=batch["ref_logprobs"],
                returns=batch["returns"],
                values=run.values(state.critic, _forward(batch)),
                rollout_logprobs=rollout)
  on_batch = update_lib.build_batch(on.algo, **fields)
  off_batch = update_lib.build_batch(off.algo, old_logprobs=old, **fields)
  assert "old_logprobs" not in on_batch and "old_logprobs" in off_batch

  # The gradient of each path, micro-batches accumulated as the update does.
  den = losses.aggregation_denominator(batch["loss_mask"], on.algo.loss_agg_mode)
  def grads(cfg, b):
    loss_fn = functools.partial(update_lib.policy_loss, graphdef=run.policy_def, cfg=cfg)
    return jax.jit(lambda p, b: update_lib.accumulate_gradients(
        loss_fn, p, b, den, cfg.microbatches, mesh))(state.policy, b)
  (want_loss, want_grads, want_aux), (got_loss, got_grads, got_aux) = (
      grads(off, off_batch), grads(on, on_batch))
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6, atol=1e-6)
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  # The per-token log-probs the update returns are the scored old ones, in the batch's order.
  np.testing.assert_allclose(np.where(mask, got_aux.pop("logprobs"), 0.0),
                             np.where(mask, old, 0.0), atol=1e-6)
  assert set(got_aux) == set(want_aux)

  # The whole update: same parameters, moments and metrics; the ratio is exactly 1.
  want_state, want = jax.device_get(_update_step(run, off)(run.fresh(), off_batch))
  got_state, got = jax.device_get(_update_step(run, on)(run.fresh(), on_batch))
  assert float(got["actor/approx_kl"]) == 0.0 and float(got["actor/clip_frac"]) == 0.0
  gap = update_lib.logprob_gap(old, rollout, mask)
  assert set(got) == set(want) | set(gap)
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6, err_msg=key)
  for key in gap:  # what the separate scoring pass logged
    assert float(gap[key]) > 0.01
    np.testing.assert_allclose(got[key], gap[key], rtol=1e-6, atol=1e-6, err_msg=key)
  for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


class _ShortPool:
  """Episodes of one or two turns (slot s lasts 1 + s % 2), a few tokens each: rows far shorter
  than the context limit. The last step rewards an odd-length reply, so groups carry signal."""

  env_cls = None

  def reset(self, task_ids):
    self.turns = [0] * len(task_ids)
    return [StepOutcome(f"Task {t}.", 0.0, False, False, {"instruction": "Reply."})
            for t in task_ids]

  def step(self, slots, responses):
    outs = []
    for slot, response in zip(slots, responses):
      self.turns[slot] += 1
      done = self.turns[slot] > slot % 2
      reward = float(len(response) % 2) if done else 0.0
      outs.append(StepOutcome("Next." if not done else "Done.", reward, done, False,
                              {"success": reward > 0}))
    return outs


@functools.lru_cache(maxsize=None)
def _bpe():
  return ChatTokenizer.train_bpe(["Task 3. Reply.", "Next.", "Done. Action: go"] * 10,
                                 vocab_size=300)


def _train_step(config, *, policy_scores_old):
  """`rl_batch` and the update of step 0, as train/loop.py runs them (2 data-parallel
  devices), the old log-probs scored apart or not: (batch, update metrics, state after, which
  parameters the log-prob scorer was called with)."""
  tok = _bpe()
  mesh = sharding.make_mesh((("data", 2), ("fsdp", 1), ("tensor", 1)),
                            devices=jax.devices()[:2])
  cfg = update_lib.UpdateConfig.from_config(config)
  if policy_scores_old:
    cfg = _off_policy_path(cfg)
  policy = policies.build_policy(settings_lib.policy(config), tok, mesh)
  state, split, opts = state_lib.create(config, policy, None,
                                        keep_reference=cfg.algo.keep_reference, mesh=mesh)
  score_logprobs, _ = update_lib.make_scorers(split.policy_def, None, cfg, mesh)
  scored = []

  def spy(params, rows):
    scored.append({id(state.policy): "policy", id(state.ref): "reference"}[id(params)])
    return score_logprobs(params, rows)

  inputs = batches.StepInputs(
      config=config, update=cfg, tok=tok, pool=_ShortPool(),
      stream=data.TaskStream(range(8), config.seed), mesh=mesh,
      share=multihost.process_share(mesh), policy_def=split.policy_def,
      rollout=settings_lib.rollout(config), env=settings_lib.env(config),
      schedule=settings_lib.schedule(config), scorers=(spy, None),
      advantages=algorithm.make_advantage_fn(cfg.algo))
  got = batches.rl_batch(inputs, state, 0, 0, max_turns=2, saving=False)
  scored_by_the_step = list(scored)
  _check_stages_alone(inputs, state, got)
  step = update_lib.make_update_step(split.policy_def, None, opts, cfg, mesh, split.shardings)
  state, metrics = step(state, got.batch)
  return got, jax.device_get(metrics), _copy(state.policy), scored_by_the_step


def _check_stages_alone(inputs, state, got):
  """The stages of `batches.scored_batch`, called one by one on the step's episodes, give
  its batch; every agent token of the update's rows lands once on its episode's token."""
  rows = batches.update_rows(inputs, got.host)
  episodes_mask = np.asarray(rows.to_episodes(rows.loss_mask.astype(jnp.float32)))
  np.testing.assert_array_equal(episodes_mask, np.asarray(got.host.loss_mask, np.float32))
  scores = batches.score(inputs, state, rows)
  estimated = batches.advantages(inputs, rows, scores)
  batch = batches.update_batch(inputs, rows, scores, estimated)
  assert set(batch) == set(got.batch)
  for key in batch:
    np.testing.assert_array_equal(np.asarray(batch[key]), np.asarray(got.batch[key]), key)


@pytest.mark.parametrize("history_turns", [0, 1])
def test_on_policy_step_scores_the_reference_only_and_trains_as_the_separate_scoring(
    history_turns):
  c = _config(kl_coef=0.05, minibatches=1, microbatches=2)
  c.optim.lr = _PARITY_LR
  c.data.batch_tasks, c.data.group_size = 2, 2
  c.rollout.max_reply_tokens = 4
  c.rollout.history_turns = history_turns
  # A long context limit: the update's rows must not be as long as it.
  c.rollout.max_context = 2048
  c.model.arch.num_layers, c.model.arch.hidden_size = 1, 32
  on, on_metrics, on_params, on_scored = _train_step(c, policy_scores_old=False)
  off, off_metrics, off_params, off_scored = _train_step(c, policy_scores_old=True)
  assert on_scored == ["reference"] and off_scored == ["policy", "reference"]

  # Rows as long as the longest episode (bucketed), never the context limit's bucket.
  longest = max(len(e.tokens) for e in on.episodes)
  assert on.host.tokens.shape[1] == bucket_length(longest) < bucket_length(2048)
  if not history_turns:
    assert on.batch["tokens"].shape[1] == bucket_length(longest)
  else:  # per-turn rows: as long as the longest turn's context and reply
    assert on.batch["tokens"].shape[1] <= bucket_length(longest)

  # The same rollout, trained the same; the sampler/trainer gap moved to the update's metrics.
  np.testing.assert_array_equal(on.host.tokens, off.host.tokens)
  assert "rollout/logprob_gap" not in on.metrics
  for key in ("rollout/logprob_gap", "rollout/logprob_gap_max"):
    np.testing.assert_allclose(on_metrics[key], off.metrics[key], rtol=1e-5, atol=1e-6)
  assert on_metrics["rollout/logprob_gap"] < 1e-4
  assert set(on_metrics) == set(off_metrics) | {"rollout/logprob_gap",
                                                "rollout/logprob_gap_max"}
  for key in off_metrics:
    np.testing.assert_allclose(on_metrics[key], off_metrics[key], rtol=1e-6, atol=1e-6,
                               err_msg=key)
  for a, b in zip(jax.tree.leaves(on_params), jax.tree.leaves(off_params)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# ----- the LM head at the scored positions only -------------------------------------------------


def test_scored_positions_are_each_rows_agent_tokens_in_order(monkeypatch):
  monkeypatch.setattr(update_lib, "SCORED_POSITIONS_MINIMUM", 4)
  mask = np.zeros((3, 16), bool)
  mask[0, [2, 3, 4, 9, 10]] = True
  mask[1, [0, 15]] = True  # position 0 has no logits before it: never scored
  # row 2: no agent token at all (a failed episode, a padding row)
  want = np.array([[2, 3, 4, 9, 10, 0], [15, 0, 0, 0, 0, 0], [0] * 6])  # P = bucket(5) = 6
  got = update_lib.scored_positions(mask)
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, want)
  # Past half the row the head scores every position: one program, today's.
  mask[0, 1:9] = True
  assert update_lib.scored_positions(mask) is None
  assert update_lib.scored_positions(np.zeros((2, 16), bool)).shape == (2, 4)
  with pytest.raises(ValueError, match=r"\[rows, length\]"):
    update_lib.scored_positions(np.zeros(16, bool))


def test_scored_positions_never_drop_an_agent_token_and_stay_in_the_row():
  rng = np.random.default_rng(0)
  for length, share in ((1536, 0.1), (8192, 0.1), (1024, 0.3), (600, 0.02)):
    mask = rng.random((6, length)) < share
    got = update_lib.scored_positions(mask)
    assert got is not None and got.shape[1] % 64 == 0 and 2 * got.shape[1] < length
    assert got.min() >= 0 and got.max() < length
    for row in range(6):
      np.testing.assert_array_equal(got[row][got[row] > 0], np.flatnonzero(mask[row, 1:]) + 1)
  # The main job's rows (at most 5 x 48 agent tokens of 1,536) compile one shape.
  assert update_lib.scored_positions(np.arange(1536)[None] % 6 < 1).shape == (1, 256)
  assert update_lib.scored_positions(rng.random((4, 1536)) < 0.6) is None


def _subset_batch(rows=4):
  """`_batch` and its scored positions (P = 8 of 20: the minimum set to 4)."""
  batch = _batch(rows=rows)
  positions = update_lib.scored_positions(np.asarray(batch["loss_mask"]))
  assert positions.shape == (rows, 8)
  return batch, jnp.asarray(positions)


# 4 rows x 8 scored positions x 48 logits: 1 and 3 (the last padded) blocks of positions.
@pytest.mark.parametrize("block", [1 << 24, 512])
def test_lm_head_at_the_scored_positions_equals_the_head_at_every_position(monkeypatch, block):
  monkeypatch.setattr(update_lib, "SCORED_POSITIONS_MINIMUM", 4)
  (graphdef, params), _ = _models()
  batch, positions = _subset_batch()
  tokens, valid, mask = batch["tokens"], batch["valid"], batch["loss_mask"]
  weights = jnp.asarray(np.random.default_rng(1).normal(size=tokens.shape), jnp.float32)

  def loss(params, positions):
    model = nnx.merge(graphdef, params)
    rows = {"tokens": tokens, "valid": valid}
    if positions is not None:
      rows["scored_positions"] = positions
    logp, entropy = update_lib.sequence_logprobs_and_entropy(model, rows, 0.7)
    masked = lambda x: jnp.where(mask, x, 0.0)
    return jnp.sum(masked(logp) * weights + 0.1 * masked(entropy)), (logp, entropy)

  (_, want), want_grads = jax.value_and_grad(loss, has_aux=True)(params, None)
  monkeypatch.setattr(logprobs_lib, "_LOGIT_BLOCK", block)
  (_, got), got_grads = jax.value_and_grad(loss, has_aux=True)(params, positions)
  for a, b in zip(got, want):  # the same at agent tokens, 0 everywhere else
    np.testing.assert_allclose(a, np.where(mask, b, 0.0), rtol=1e-6, atol=1e-6)
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_lm_head_scores_nothing_at_a_position_outside_the_row():
  (graphdef, params), _ = _models()
  batch = _batch(rows=4)
  tokens, valid = batch["tokens"][:2], batch["valid"][:2]
  positions = jnp.asarray([[5, LENGTH, -3, 0], [6, 0, LENGTH + 7, -1]], jnp.int32)

  def loss(params, positions):
    logp, entropy = update_lib.sequence_logprobs_and_entropy(
        nnx.merge(graphdef, params),
        {"tokens": tokens, "valid": valid, "scored_positions": positions}, 1.0)
    return jnp.sum(logp) + jnp.sum(entropy), (logp, entropy)

  (_, (logp, entropy)), grads = jax.value_and_grad(loss, has_aux=True)(params, positions)
  (_, want), want_grads = jax.value_and_grad(loss, has_aux=True)(params, positions[:, :1])
  only = np.zeros(tokens.shape, bool)
  only[0, 5] = only[1, 6] = True
  for got, full in zip((logp, entropy), want):
    assert np.all(np.asarray(got)[~only] == 0.0) and np.all(np.asarray(got)[only] != 0.0)
    np.testing.assert_allclose(got, full, rtol=1e-6, atol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _assert_same_sums(got, want, mask, *, grad_rtol, aux_rtol, mask_got):
  """(loss, grads, aux) of two `accumulate_gradients` calls agree; aux's log-probs on `mask`
  (also masked on `got`'s side when `mask_got`)."""
  (got_loss, got_grads, got_aux), (want_loss, want_grads, want_aux) = got, want
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6, atol=1e-6)
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, rtol=grad_rtol, atol=1e-6)
  assert set(got_aux) == set(want_aux)
  masked = lambda key, aux: np.where(mask, aux[key], 0.0) if key == "logprobs" else aux[key]
  for key in want_aux:
    got_value = masked(key, got_aux) if mask_got else got_aux[key]
    np.testing.assert_allclose(got_value, masked(key, want_aux), rtol=aux_rtol, atol=1e-6,
                               err_msg=key)


@pytest.mark.parametrize("algo", [
    dict(kl_coef=0.05, entropy_coef=0.01, tis_cap=1.2, microbatches=2),
    dict(kl_coef=0.05, entropy_coef=0.01, kl_estimator="k1",
         loss_agg_mode="seq-mean-token-mean", minibatches=1),  # on-policy: old from the update
])
def test_update_loss_at_the_scored_positions_equals_the_loss_at_every_position(monkeypatch,
                                                                                 algo):
  monkeypatch.setattr(update_lib, "SCORED_POSITIONS_MINIMUM", 4)
  (policy_def, policy), _ = _models()
  cfg = update_lib.UpdateConfig.from_config(_config(**algo))
  batch, positions = _subset_batch(rows=ROWS)
  batch["rollout_logprobs"] = batch["old_logprobs"] + 0.1 * batch["loss_mask"]
  den = losses.aggregation_denominator(batch["loss_mask"], cfg.algo.loss_agg_mode)
  loss_fn = functools.partial(update_lib.policy_loss, graphdef=policy_def, cfg=cfg)
  accumulate = jax.jit(lambda p, b: update_lib.accumulate_gradients(loss_fn, p, b, den,
                                                                    cfg.microbatches))
  _assert_same_sums(accumulate(policy, {**batch, "scored_positions": positions}),
                    accumulate(policy, batch), np.asarray(batch["loss_mask"]),
                    grad_rtol=1e-6, aux_rtol=1e-6, mask_got=False)


def test_scorers_and_update_at_the_scored_positions_equal_every_position(monkeypatch, run):
  monkeypatch.setattr(update_lib, "SCORED_POSITIONS_MINIMUM", 4)
  state = run.fresh()
  batch = run.batch(state)
  positions = update_lib.scored_positions(np.asarray(batch["loss_mask"]))
  positions = sharding.shard_batch({"p": positions}, run.mesh)["p"]
  mask = np.asarray(batch["loss_mask"])
  scored = run.logprobs(state.policy, _forward(batch, positions))
  np.testing.assert_allclose(scored, np.where(mask, batch["old_logprobs"], 0.0), atol=1e-6)
  want_state, want = jax.device_get(run.step(run.fresh(), batch))
  got_state, got = jax.device_get(run.step(run.fresh(),
                                           {**batch, "scored_positions": positions}))
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6, err_msg=key)
  # (Adam's first step: as in the test below, up to ~1e-3 of a step where a gradient is ~eps)
  for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-2 * 1e-2)


@pytest.mark.parametrize("history_turns", [0, 1])
def test_a_step_scoring_the_agent_tokens_only_trains_as_scoring_every_position(monkeypatch,
                                                                              history_turns):
  c = _config(kl_coef=0.05, minibatches=1, microbatches=2, kl_in_reward=True)
  c.optim.lr = _PARITY_LR
  c.data.batch_tasks, c.data.group_size = 2, 2
  c.rollout.max_reply_tokens = 4
  c.rollout.history_turns = history_turns
  c.model.arch.num_layers, c.model.arch.hidden_size = 1, 32
  every, every_metrics, every_params, _ = _train_step(c, policy_scores_old=True)
  monkeypatch.setattr(update_lib, "SCORED_POSITIONS_MINIMUM", 4)
  agent, agent_metrics, agent_params, scored = _train_step(c, policy_scores_old=True)
  assert scored == ["policy", "reference"]  # old log-probs read first by the in-reward KL
  assert "scored_positions" not in every.batch
  positions, mask = (np.asarray(agent.batch[k]) for k in ("scored_positions", "loss_mask"))
  assert 2 * positions.shape[1] < mask.shape[1]
  assert (positions > 0).sum() == mask.sum() > 0
  # (the reference's reach the update through the reward: `reward/kl_mean` below)
  np.testing.assert_allclose(agent.batch["old_logprobs"],
                             np.where(mask, every.batch["old_logprobs"], 0.0), atol=1e-6)
  assert set(agent_metrics) == set(every_metrics) and set(agent.metrics) == set(every.metrics)
  read = [k for k in every.metrics if k.startswith(("batch/", "rollout/logprob", "reward/"))]
  assert "reward/kl_mean" in read and "rollout/logprob_gap" in read
  for key in read:  # what the scored log-probs feed before the update
    np.testing.assert_allclose(agent.metrics[key], every.metrics[key], rtol=1e-6, atol=1e-6,
                               err_msg=key)
  for key in every_metrics:
    np.testing.assert_allclose(agent_metrics[key], every_metrics[key], rtol=1e-6, atol=1e-6,
                               err_msg=key)
  # The head's gradient sums over other positions here (in another order): Adam's first step
  # makes that 1e-7 disagreement up to ~1e-3 of a step where a gradient is ~eps (_PARITY_LR).
  for a, b in zip(jax.tree.leaves(agent_params), jax.tree.leaves(every_params)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-2 * _PARITY_LR)


def test_micro_length_choices():
  assert update_lib.micro_length_choices(1536, 3) == (768, 1024, 1536)
  assert update_lib.micro_length_choices(1536, 1) == (1536,)
  assert update_lib.micro_length_choices(1000, 3) == (512, 768, 1000)
  assert update_lib.micro_length_choices(2048, 2) == (1536, 2048)
  assert update_lib.micro_length_choices(64, 3) == (64,)  # nothing shorter to cut to


@pytest.mark.parametrize("critic", [False, True])
def test_micro_batches_at_their_own_length_train_as_the_whole_rows(monkeypatch, critic):
  """One row per micro-batch, each cut to the shortest of 3 lengths that holds it: the same
  loss, gradients and per-row log-probs as every row at the batch's length."""
  monkeypatch.setattr(update_lib, "MICRO_LENGTH_MINIMUM", 4)
  lengths = update_lib.micro_length_choices(LENGTH, 3)
  assert lengths == (12, 16, 20)
  batch = _batch()
  used = np.asarray(batch["valid"]).sum(axis=1)
  assert (used <= 12).sum() and ((used > 12) & (used <= 16)).sum() and (used > 16).sum()
  (policy_def, policy), (critic_def, critic_params) = _models()
  got = {}
  for count in (1, 3):
    cfg = update_lib.UpdateConfig.from_config(_config(estimator="gae" if critic else "grpo",
                                                      microbatch_lengths=count))
    fn, params = ((update_lib.critic_loss, critic_params) if critic
                  else (update_lib.policy_loss, policy))
    loss_fn = functools.partial(fn, graphdef=critic_def if critic else policy_def, cfg=cfg)
    den = losses.aggregation_denominator(batch["loss_mask"], cfg.algo.loss_agg_mode)
    got[count] = jax.jit(lambda p, b: update_lib.accumulate_gradients(  # pylint: disable=cell-var-from-loop
        loss_fn, p, b, den, ROWS, micro_lengths=cfg.micro_lengths))(params, batch)
  _assert_same_sums(got[3], got[1], np.asarray(batch["loss_mask"]), grad_rtol=1e-5,
                    aux_rtol=1e-5, mask_got=True)


def test_scorers_at_each_micro_batchs_length_give_the_whole_rows_log_probs(monkeypatch):
  monkeypatch.setattr(update_lib, "MICRO_LENGTH_MINIMUM", 4)
  mesh = sharding.make_mesh((("data", 1), ("fsdp", 1), ("tensor", 1)), devices=jax.devices()[:1])
  (policy_def, policy), (critic_def, critic_params) = _models()
  batch = _batch()
  valid = np.asarray(batch["valid"])
  scored = {}
  for count in (1, 3):
    cfg = update_lib.UpdateConfig.from_config(_config(estimator="gae", minibatches=1,
                                                      microbatches=ROWS,
                                                      microbatch_lengths=count))
    logprobs, values = update_lib.make_scorers(policy_def, critic_def, cfg, mesh)
    scored[count] = (logprobs(policy, _forward(batch)), values(critic_params, _forward(batch)))
  for whole, cut in zip(scored[1], scored[3]):
    np.testing.assert_allclose(np.where(valid, cut, 0.0), np.where(valid, whole, 0.0),
                               rtol=1e-5, atol=1e-6)


def test_update_config_rejects_no_micro_batch_length():
  with pytest.raises(ValueError, match="algo.microbatch_lengths must be >= 1"):
    update_lib.UpdateConfig.from_config(_config(microbatch_lengths=0))


@pytest.mark.parametrize("finite", [True, False])
def test_both_forms_of_a_skippable_step_compute_the_same(finite):
  """update._apply_if_finite lowers the cond on CPU and the select elsewhere (TPU): both
  step, or both leave parameters and AdamW moments as they were."""
  (_, params), _ = _models()
  tx = optax.adamw(1e-2)
  opt_state = tx.init(params)
  opt_state = tx.update(jax.tree.map(jnp.ones_like, params), opt_state, params)[1]
  grads = jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), params)
  flag = jnp.asarray(finite)
  got = {form: jax.jit(functools.partial(update_lib.step_unless, tx, form=form))(
      flag, grads, params, opt_state) for form in ("cond", "select")}
  for a, b in zip(jax.tree.leaves(got["cond"]), jax.tree.leaves(got["select"])):
    np.testing.assert_array_equal(a, b)
  moved = any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got["cond"]),
                                                        jax.tree.leaves((params, opt_state))))
  assert moved == finite
