"""LoRA (models/lora.py): adapters at zero are the base model, the merged export is what
transformers computes, the optimizer moves the adapters only, the KL reference is the base,
bad settings fail naming the field, and a training run with adapters completes and resumes."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # experiment files import `experiments.agentgym_rl.common`.
  sys.path.insert(0, str(ROOT))

from agentgym_jax import policies, sharding  # pylint: disable=wrong-import-position
from agentgym_jax.models import Decoder, KVCache, ModelConfig, lora, save_hf  # pylint: disable=wrong-import-position
from agentgym_jax.models.decoder import add_adapters  # pylint: disable=wrong-import-position
from agentgym_jax.train import checkpoints, provenance  # pylint: disable=wrong-import-position
from agentgym_jax.train import config as base  # pylint: disable=wrong-import-position
from agentgym_jax.train import state as state_lib  # pylint: disable=wrong-import-position

# Qwen2-like (q/k/v biases, untied head), so every kind of base parameter is there.
CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, qkv_bias=True, tie_embeddings=False,
                  model_type="qwen2", attention="xla")


def _mesh():
  return sharding.make_mesh([("fsdp", 2)], devices=jax.devices()[:2])


def _batch(seed=0, lengths=(9, 5, 1)):
  t = max(lengths)
  tokens = np.random.RandomState(seed).randint(0, CFG.vocab_size, (len(lengths), t))
  valid = np.arange(t)[None] < np.asarray(lengths)[:, None]
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(valid)


def _with_adapters(rank=4, alpha=8.0, seed=0):
  """(base model, the same weights with fresh adapters): two separate models."""
  mesh = _mesh()
  make = lambda: Decoder(CFG, rngs=nnx.Rngs(seed))
  return (sharding.sharded_init(make, mesh),
          add_adapters(sharding.sharded_init(make, mesh), rank, alpha, seed=seed + 1, mesh=mesh))


def _randomise_b(model, seed=1, scale=0.3):
  """Every B drawn at random (fresh adapters have B = 0, which would hide a wrong product)."""
  params = nnx.state(model, nnx.LoRAParam).to_pure_dict()
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params))))
  nnx.update(model, jax.tree_util.tree_map_with_path(
      lambda path, x: (scale * jax.random.normal(next(keys), x.shape, x.dtype)
                       if path[-1].key == lora.B else x), params))
  assert all(np.any(np.asarray(block.lora.down.lora_b[...]))
             for block in model.backbone.layers)


def _cached_logits(model, tokens, valid):
  """Logits of each row's tokens fed one at a time through `extend`, as the sampler does."""
  cache = KVCache.init(model.cfg, tokens.shape[0], 16)
  extend = nnx.jit(lambda m, t, n, c: m.extend(t, n, c))
  out = []
  for t in range(tokens.shape[1]):
    logits, cache = extend(model, tokens[:, t:t + 1], valid[:, t].astype(jnp.int32), cache)
    out.append(logits[:, 0])
  return np.stack(out, axis=1)


def test_adapters_are_lora_params_named_as_the_plain_dicts_say_and_sharded_like_their_kernel():
  _, model = _with_adapters()
  typed = nnx.state(model, nnx.LoRAParam).to_pure_dict()
  flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param).to_pure_dict())[0]
  by_name = {tuple(k.key for k in path) for path, _ in flat if lora.is_adapter(path)}
  by_type = {tuple(k.key for k in path)
             for path, _ in jax.tree_util.tree_flatten_with_path(typed)[0]}
  assert by_name == by_type and len(by_type) == 2 * 4 * CFG.num_layers
  qkv = model.backbone.layers[0].lora.qkv
  assert qkv.lora_a.shape == (CFG.hidden_size, 4) and qkv.lora_b.shape == (4, 64)
  assert qkv.lora_a.get_metadata()["out_sharding"] == ("embed", None)
  assert qkv.lora_b.get_metadata()["out_sharding"] == (None, "qkv")
  # The logical names reach the mesh: A's input axis and B's output axis split over fsdp.
  assert qkv.lora_a[...].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
  down = model.backbone.layers[0].lora.down
  assert down.lora_b[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")


def test_fresh_adapters_give_exactly_the_base_models_logits():
  """B = 0: the training forward and the rollout's cached forward equal the base model's
  bit for bit, so adding adapters changes nothing until they are trained."""
  base_model, model = _with_adapters()
  tokens, valid = _batch()
  assert model.cfg.lora_rank == 4 and base_model.cfg.lora_rank == 0
  np.testing.assert_array_equal(np.asarray(model(tokens, valid)),
                                np.asarray(base_model(tokens, valid)))
  np.testing.assert_array_equal(_cached_logits(model, tokens, valid),
                                _cached_logits(base_model, tokens, valid))


def test_adapter_math_is_x_w_plus_alpha_over_r_x_a_b():
  """Golden: one projection by hand (numpy) against the block's."""
  _, model = _with_adapters(rank=2, alpha=6.0)
  _randomise_b(model)
  block = model.backbone.layers[0]
  x = np.random.RandomState(3).randn(2, 3, CFG.num_heads * CFG.head_dim).astype(np.float32)
  w, a, b = (np.asarray(v[...]) for v in (block.o, block.lora.o.lora_a, block.lora.o.lora_b))
  want = x @ w + 3.0 * (x @ a) @ b
  np.testing.assert_allclose(np.asarray(block._project(jnp.asarray(x), "o")), want,
                             rtol=1e-5, atol=1e-6)


def test_the_rollouts_sampled_logprobs_are_the_adapted_models():
  """The sampler (prefill and decode through `extend`) draws from the model with its
  adapters: its log-probs are the training forward's, not the base model's."""
  from agentgym_jax.rollout import sampler  # pylint: disable=import-outside-toplevel
  base_model, model = _with_adapters()
  _randomise_b(model)
  prompts = np.asarray([[5, 17, 3, 9], [11, 2, 40, 41]], np.int32)
  graphdef, params = nnx.split(model)
  cache, logits = sampler.extend(graphdef, params, KVCache.init(model.cfg, 2, 32),
                                 jnp.zeros((2, CFG.vocab_size)), prompts, np.asarray([4, 4]))
  settings = sampler.SamplingConfig(temperature=1.0, max_reply_tokens=8)
  turn = sampler.Turn.idle(jax.random.split(jax.random.key(0), 2), 8).replace(
      running=jnp.ones(2, bool))
  _, _, turn = sampler.decode(graphdef, params, cache, logits, turn, np.asarray([8, 8]), (),
                              settings)
  sampled = np.asarray(turn.tokens)
  assert np.asarray(turn.counts).tolist() == [8, 8]
  rows = jnp.asarray(np.concatenate([prompts, sampled], axis=1))
  valid = jnp.ones(rows.shape, bool)
  for scorer, close in ((model, True), (base_model, False)):
    full = np.asarray(jax.nn.log_softmax(scorer(rows, valid)))
    want = np.take_along_axis(full[:, 3:-1], sampled[..., None], axis=-1)[..., 0]
    assert np.allclose(np.asarray(turn.logprobs), want, atol=1e-4) == close


def test_merged_export_loads_in_transformers_with_our_logits(tmp_path):
  """W + alpha / r * A @ B exported: transformers computes our adapted model's logits (the
  training forward and the rollout's) within the HF parity tolerance."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  base_model, model = _with_adapters()
  _randomise_b(model)
  tokens, valid = _batch()
  ours = np.asarray(model(tokens, valid))
  assert np.abs(ours - np.asarray(base_model(tokens, valid)))[np.asarray(valid)].max() > 1e-2
  save_hf(model, tmp_path)
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  assert not any("lora" in name for name, _ in theirs.named_parameters())
  with torch.no_grad():
    ref = theirs(input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long),
                 attention_mask=torch.tensor(np.asarray(valid), dtype=torch.long)
                 ).logits.float().numpy()
  mask = np.asarray(valid)
  assert np.abs(ours - ref)[mask].max() < 1e-4
  assert np.abs(_cached_logits(model, tokens, valid) - ref)[mask].max() < 1e-4


def _config(lora_rank=4, lora_alpha=16.0):
  c = base.base_config()
  c.model.lora_rank = lora_rank
  c.model.lora_alpha = lora_alpha
  c.optim.lr = 1e-2
  c.optim.warmup_steps = 0
  return c


def _state(model, keep_reference=True):
  state, split, optimizers = state_lib.create(_config(), model, None,
                                              keep_reference=keep_reference, mesh=_mesh())
  return state, split, optimizers


def _loss(graphdef, params, tokens, valid):
  logits = nnx.merge(graphdef, params)(tokens, valid)
  return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * valid)


def test_an_update_moves_the_adapters_only():
  """The base weights get no gradient and stay bit for bit; AdamW keeps moments of the
  adapters only; every adapter moves (A through B's gradient once B is nonzero)."""
  _, model = _with_adapters()
  state, split, optimizers = _state(model)
  tokens, valid = _batch()
  labels = lora.trainable_labels(state.policy)
  params, opt_state = state.policy, state.opt_state
  for _ in range(2):  # the first step moves B only (A's gradient is 0 while B is)
    grads = jax.grad(lambda p: _loss(split.policy_def, p, tokens, valid))(params)
    for label, g in zip(jax.tree.leaves(labels), jax.tree.leaves(grads)):
      if label == "frozen":
        assert not np.any(np.asarray(g))  # stop_gradient: nothing reaches the base weights
    updates, opt_state = optimizers.policy.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  for label, before, after in zip(jax.tree.leaves(labels), jax.tree.leaves(state.policy),
                                  jax.tree.leaves(params)):
    if label == "frozen":
      np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    else:
      assert np.any(np.asarray(after) != np.asarray(before))
  adapter_sizes = sum(x.size for label, x in zip(jax.tree.leaves(labels),
                                                  jax.tree.leaves(state.policy))
                      if label == "trained")
  moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
  assert moments == 2 * adapter_sizes  # Adam's mu and nu, of the adapters alone


def test_the_reference_is_the_base_model_without_a_copy():
  """With adapters the state keeps no reference copy; `reference_params` is the policy with
  its adapters off, whose log-probs are the base model's exactly (the policy's differ)."""
  base_model, model = _with_adapters()
  _randomise_b(model)
  state, split, _ = _state(model)
  assert state.ref is None and state.reference_is_base
  reference = state_lib.reference_params(state)
  leaves = zip(jax.tree.leaves(lora.trainable_labels(state.policy)),
               jax.tree.leaves(reference), jax.tree.leaves(state.policy))
  assert all(r is p for label, r, p in leaves if label == "frozen")  # the same buffers
  tokens, valid = _batch()
  base_logits = np.asarray(base_model(tokens, valid))
  np.testing.assert_array_equal(
      np.asarray(nnx.merge(split.policy_def, reference)(tokens, valid)), base_logits)
  policy_logits = np.asarray(nnx.merge(split.policy_def, state.policy)(tokens, valid))
  assert np.abs(policy_logits - base_logits)[np.asarray(valid)].max() > 1e-2
  # Without adapters the reference is a copy, as before.
  plain, _, _ = state_lib.create(_config(lora_rank=0), base_model, None, keep_reference=True,
                                 mesh=_mesh())
  assert not plain.reference_is_base and plain.ref is not None


def test_a_lora_runs_workdir_as_init_from_starts_from_its_merged_policy(tmp_path):
  """init_from a LoRA run's workdir: its adapters (rank from their shapes, alpha from the
  run's saved config) are folded into the base, so a new model, without adapters or with
  fresh ones of any rank, computes the LoRA run's policy; with no config naming alpha, one
  line says so."""
  _, adapted = _with_adapters(rank=4, alpha=8.0)
  _randomise_b(adapted)
  _, params = state_lib.split_params(adapted)
  ckpt = checkpoints.Checkpointer(str(tmp_path / policies.CHECKPOINT_DIR))
  ckpt.save(3, state_lib.TrainState(step=jnp.int32(3), rng=jnp.zeros((2,), jnp.uint32),
                                    policy=params, opt_state=None), {"data_cursor": 0})
  ckpt.close()
  tokens, valid = _batch()
  want = np.asarray(adapted(tokens, valid))
  with pytest.raises(policies.InitFromError, match="lora_alpha"):
    policies._load_init_from(  # pylint: disable=protected-access
        sharding.sharded_init(lambda: Decoder(CFG, rngs=nnx.Rngs(5)), _mesh()), str(tmp_path))
  provenance.save_config(str(tmp_path), _config(lora_rank=4, lora_alpha=8.0))
  for rank in (0, 2):  # the new run fully fine-tuned, or with adapters of its own
    model = sharding.sharded_init(lambda: Decoder(CFG, rngs=nnx.Rngs(5)), _mesh())
    policies._load_init_from(model, str(tmp_path))  # pylint: disable=protected-access
    assert model.cfg.lora_rank == 0 and not nnx.state(model, nnx.LoRAParam)
    if rank:  # as build_policy adds them after init_from: B = 0, the same function
      model = add_adapters(model, rank, 16.0, seed=1, mesh=_mesh())
    np.testing.assert_allclose(np.asarray(model(tokens, valid)), want, atol=1e-5)


@pytest.mark.parametrize("field,value,message", [
    ("lora_rank", -1, "lora_rank must be >= 0"),
    ("lora_alpha", 0.0, "lora_alpha must be > 0")])
def test_bad_lora_settings_are_one_line_errors_naming_the_field(field, value, message):
  with pytest.raises(ValueError, match=message) as model_error:
    dataclasses.replace(CFG, **{field: value})
  c = _config()
  c.model[field] = value
  with pytest.raises(ValueError, match=f"model.{message}") as config_error:
    base.lock(c)
  for error in (model_error, config_error):
    assert "\n" not in str(error.value)


def test_paper_configs_take_a_lora_rank():
  from experiments.agentgym_rl import babyai  # pylint: disable=import-outside-toplevel
  full = babyai.get_config("schedule=fixed,model=7b")
  c = babyai.get_config("schedule=fixed,model=7b,lora=16")
  assert (full.model.lora_rank, c.model.lora_rank) == (0, 16)
  assert c.model.dtype == "bfloat16" and c.optim.lr == pytest.approx(10 * full.optim.lr)
  with pytest.raises(ValueError, match="model.lora_rank must be >= 0"):
    babyai.get_config("lora=-2")


def _cli(module, *args):
  """`python -m module` on keypad's runlocal config, one CPU device."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one device: conftest's eight would only slow the run down
  result = subprocess.run(
      [sys.executable, "-m", module, "--config=experiments/keypad/learn.py:runlocal", *args],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]


def test_a_training_run_with_adapters_checkpoints_resumes_and_exports_merged(tmp_path):
  """keypad's runlocal config with rank-4 adapters through the trainer's command line: one
  step, then a resumed second; the KL to the reference (the base) starts at 0, the
  checkpoints hold the base unchanged, the adapters trained and no reference, the export is a plain model transformers loads, and the evaluation
  command reads the checkpoint."""
  workdir = str(tmp_path / "run")
  flags = ["--config.model.lora_rank=4", "--config.optim.lr=1e-2", "--config.algo.kl_coef=0.01"]
  train = lambda *more: _cli("agentgym_jax.train", f"--workdir={workdir}",
                             "--config.log.progress_bar=False", *flags, *more)
  train("--config.total_steps=1")
  train("--config.total_steps=2")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  assert [m["step"] for m in lines if "actor/grad_norm" in m] == [1, 2]
  # The KL reference is the base, which the policy still is in step 1 (B = 0): no KL.
  assert abs(lines[1]["actor/kl"]) < 1e-6, lines[1]["actor/kl"]
  policy = {}
  for step in (1, 2):
    saved = ocp.StandardCheckpointer().restore(
        os.path.join(workdir, policies.CHECKPOINT_DIR, str(step), "state"))
    assert "ref" not in saved  # the reference is the base: nothing to save
    policy[step] = saved["policy"]
  flat = jax.tree_util.tree_flatten_with_path(policy[1])[0]
  labels = jax.tree.leaves(lora.trainable_labels(policy[1]))
  moved = [bool(np.any(np.asarray(a) != np.asarray(b)))
           for (_, a), b in zip(flat, jax.tree.leaves(policy[2]))]
  # Every B moved in step 2 (A's gradient is 0 while B is, so A moves from the step after B
  # first does; the unit test above sees it); no base weight moved.
  b_moved = [m for (path, _), m in zip(flat, moved) if path[-1].key == lora.B]
  assert len(b_moved) == 8 and all(b_moved)
  assert not any(m for m, label in zip(moved, labels) if label == "frozen")
  transformers = pytest.importorskip("transformers")
  exported = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(workdir, "hf"))
  assert not any("lora" in name for name, _ in exported.named_parameters())
  # The evaluation command reads the adapted policy back from the checkpoint.
  _cli("agentgym_jax.evaluate", "--config.model.lora_rank=4", f"--checkpoint={workdir}",
       f"--output={tmp_path / 'eval'}", "--num_tasks=2")
  with open(tmp_path / "eval" / "eval_test.json") as f:
    assert "step 2" in json.load(f)["label"]


def test_a_checkpoint_with_or_without_adapters_names_the_lora_rank_to_use():
  from agentgym_jax import policies  # pylint: disable=import-outside-toplevel
  base = {"backbone/layers/0/attn/q/kernel": np.zeros((8, 8))}
  adapters = {"backbone/layers/0/lora/q/lora_a": (8, 4), "backbone/layers/0/lora/q/lora_b": (4, 8)}
  saved = {"backbone/layers/0/attn/q/kernel": (8, 8), **adapters}
  with pytest.raises(ValueError, match=r"use that run's model.lora_rank \(4: "):
    policies._check_same_shapes(saved, base)  # pylint: disable=protected-access
  target = dict(base, **{k: np.zeros(v) for k, v in adapters.items()})
  with pytest.raises(ValueError, match=r"use that run's model.lora_rank \(0: "):
    policies._check_same_shapes({"backbone/layers/0/attn/q/kernel": (8, 8)}, target)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="use that run's model.arch and tokenizer"):
    policies._check_same_shapes({"backbone/layers/0/attn/q/kernel": (8, 9)}, base)  # pylint: disable=protected-access
