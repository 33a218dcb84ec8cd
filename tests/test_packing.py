"""Packed rows (train/packing.py): the layout by hand, bad input, and the update and scorers
on packed rows equal to those on the rows themselves."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentgym_jax import sharding
from agentgym_jax.models import Decoder, ModelConfig, ValueModel
from agentgym_jax.train import config as base
from agentgym_jax.train import packing
from agentgym_jax.train import state as state_lib
from agentgym_jax.train import update as update_lib

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2)
ROWS, LENGTH, PACK = 16, 24, 4
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _fast_compiles():
  """Tiny models: XLA's optimisation passes cost more time than they save."""
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", False)


# ----- the layout ------------------------------------------------------------------------------


TOKENS = np.array([[1, 2, 3, 4, 5, 0], [1, 2, 3, 7, 0, 0],   # group A: shares 1 2 3
                   [9, 8, 0, 0, 0, 0], [9, 8, 7, 0, 0, 0]])  # group B: row 2 is the opening


def test_pack_rows_lays_out_each_group_by_hand():
  packed = packing.pack_rows(TOKENS, TOKENS > 0, rows_per_pack=2, rows_per_opening=2,
                             pad_id=0, minimum=8)
  np.testing.assert_array_equal(packed.tokens, [[1, 2, 3, 4, 5, 7, 0, 0],
                                                [9, 8, 7, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(packed.valid, packed.tokens > 0)
  np.testing.assert_array_equal(packed.positions, [[0, 1, 2, 3, 4, 3, 0, 0],
                                                   [0, 1, 2, 0, 0, 0, 0, 0]])
  # The opening is a segment of its own; padding too, each position one.
  np.testing.assert_array_equal(packed.starts, [[0, 0, 0, 3, 3, 5, 6, 7],
                                                [0, 0, 2, 3, 4, 5, 6, 7]])
  np.testing.assert_array_equal(packed.shared_start, [[0, 0, 0, 0, 0, 0, 6, 7],
                                                      [0, 0, 0, 3, 4, 5, 6, 7]])
  np.testing.assert_array_equal(packed.shared_end, [[0, 0, 0, 3, 3, 3, 6, 7],
                                                    [0, 0, 2, 3, 4, 5, 6, 7]])
  np.testing.assert_array_equal(packed.index, [[0, 1, 2, 3, 4, 0], [0, 1, 2, 5, 0, 0],
                                               [0, 1, 0, 0, 0, 0], [0, 1, 2, 0, 0, 0]])


def test_pack_rows_puts_several_groups_in_one_row_each_with_its_opening():
  packed = packing.pack_rows(TOKENS, TOKENS > 0, rows_per_pack=4, rows_per_opening=2,
                             pad_id=0, minimum=8)
  np.testing.assert_array_equal(packed.tokens, [[1, 2, 3, 4, 5, 7, 9, 8, 7, 0, 0, 0]])
  np.testing.assert_array_equal(packed.positions, [[0, 1, 2, 3, 4, 3, 0, 1, 2, 0, 0, 0]])
  np.testing.assert_array_equal(packed.starts, [[0, 0, 0, 3, 3, 5, 6, 6, 8, 9, 10, 11]])
  np.testing.assert_array_equal(packed.shared_start, [[0, 0, 0, 0, 0, 0, 6, 6, 6, 9, 10, 11]])
  np.testing.assert_array_equal(packed.shared_end, [[0, 0, 0, 3, 3, 3, 6, 6, 8, 9, 10, 11]])
  np.testing.assert_array_equal(packed.index, [[0, 1, 2, 3, 4, 0], [0, 1, 2, 5, 0, 0],
                                               [6, 7, 0, 0, 0, 0], [6, 7, 8, 0, 0, 0]])


def test_pack_rows_packs_rows_without_a_common_opening_back_to_back():
  tokens = np.array([[1, 2, 0], [3, 4, 5]])
  packed = packing.pack_rows(tokens, tokens > 0, rows_per_pack=2, rows_per_opening=2,
                             pad_id=0, minimum=8)
  np.testing.assert_array_equal(packed.tokens[0, :5], [1, 2, 3, 4, 5])
  np.testing.assert_array_equal(packed.positions[0, :5], [0, 1, 0, 1, 2])
  np.testing.assert_array_equal(packed.starts[0, :5], [0, 0, 2, 2, 2])
  np.testing.assert_array_equal(packed.shared_end[0, :5], 0)  # an empty opening
  assert packed.tokens.shape == (1, 8)


def test_pack_rows_rejects_rows_it_cannot_pack():
  tokens = np.ones((3, 4), np.int32)
  with pytest.raises(ValueError, match="do not split into blocks of 2"):
    packing.pack_rows(tokens, tokens > 0, rows_per_pack=2, rows_per_opening=1, pad_id=0)
  with pytest.raises(ValueError, match="do not split into groups of 2"):
    packing.pack_rows(tokens, tokens > 0, rows_per_pack=3, rows_per_opening=2, pad_id=0)
  left_padded = np.array([[False, True], [True, True]])
  with pytest.raises(ValueError, match="right-padded"):
    packing.pack_rows(np.ones((2, 2), np.int32), left_padded, rows_per_pack=2,
                      rows_per_opening=2, pad_id=0)


def test_update_config_refuses_packed_rows_at_several_lengths():
  c = base.base_config()
  c.algo.pack_rows, c.algo.microbatch_lengths = 4, 3
  with pytest.raises(ValueError, match="algo.microbatch_lengths=1"):
    update_lib.UpdateConfig.from_config(c)


# ----- the update and the scorers on packed rows ------------------------------------------------


def _rows(seed=0):
  """Blocks of PACK rows sharing a random opening of 5-9 tokens (agent tokens among them:
  a shared token's gradient is summed over its rows), then their own tokens."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, CFG.vocab_size, (ROWS, LENGTH)).astype(np.int32)
  for first in range(0, ROWS, PACK):
    shared = rng.integers(5, 10)
    tokens[first + 1:first + PACK, :shared] = tokens[first, :shared]
  lengths = rng.integers(LENGTH // 2, LENGTH + 1, ROWS)
  lengths[3] = 4  # a row inside the shared opening: no token of its own
  positions = np.arange(LENGTH)[None]
  valid = positions < lengths[:, None]
  tokens = np.where(valid, tokens, 0)
  mask = valid & (((positions >= 4) & (positions < 8)) | ((positions >= 11) & (positions < 15)))
  f32 = lambda x: np.asarray(x, np.float32)
  return {"tokens": tokens, "valid": valid, "loss_mask": mask,
          "advantages": f32(rng.normal(size=mask.shape) * mask),
          "returns": f32(rng.normal(size=mask.shape) * mask),
          "old_values": f32(rng.normal(size=mask.shape) * mask)}


@pytest.fixture(scope="module")
def setup():
  mesh = sharding.make_mesh((("data", 2), ("fsdp", 1), ("tensor", 1)),
                            devices=jax.devices()[:2])
  c = base.base_config()
  c.algo.estimator = "gae"
  c.algo.kl_coef = 0.01
  c.algo.minibatches, c.algo.microbatches = 1, 2
  c.optim.lr = 1e-2
  ucfg = update_lib.UpdateConfig.from_config(c)
  policy = sharding.sharded_init(lambda: Decoder(CFG, rngs=nnx.Rngs(0)), mesh)
  critic = sharding.sharded_init(lambda: ValueModel(CFG, rngs=nnx.Rngs(1)), mesh)
  critic.head[...] = jax.random.normal(jax.random.key(2), critic.head.shape) * 0.1
  opts = state_lib.Optimizers.from_config(c, with_critic=True)
  policy_def, policy_params = state_lib.split_params(policy)
  critic_def, critic_params = state_lib.split_params(critic)
  shardings = state_lib.train_state_shardings(
      policy_shardings=state_lib.param_shardings(policy, mesh),
      critic_shardings=state_lib.param_shardings(critic, mesh), keep_reference=True,
      optimizers=opts, policy=policy_params, critic=critic_params, mesh=mesh)
  state = state_lib.init_train_state(policy=policy_params, critic=critic_params,
                                     keep_reference=True, optimizers=opts, seed=0,
                                     shardings=shardings)
  initial = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state)
  return mesh, ucfg, policy_def, critic_def, opts, shardings, initial


def _scored(setup, pack):
  """The batch (packed when pack > 1) with old and reference log-probs and old values scored
  by the scorers of that layout; and the scorers' outputs."""
  mesh, ucfg, policy_def, critic_def, _, shardings, initial = setup
  ucfg = dataclasses.replace(ucfg, pack_rows=pack)
  state = jax.device_put(initial, shardings)
  rows = _rows()
  put = lambda x: sharding.shard_batch(np.asarray(x), mesh)
  batch = sharding.shard_batch(rows, mesh)
  if pack > 1:
    batch |= update_lib.packed_fields(
        packing.pack_rows(rows["tokens"], rows["valid"], pack, PACK, pad_id=0), put)
  logprobs, values = update_lib.make_scorers(policy_def, critic_def, ucfg, mesh)
  forward = update_lib.forward_inputs(batch)
  # On-policy (one epoch, one minibatch): the update's forward gives the old log-probs, and
  # compares them with the sampler's (here the scorer's).
  batch["rollout_logprobs"] = batch["ref_logprobs"] = logprobs(state.policy, forward)
  scored_values = values(state.critic, forward)
  return ucfg, state, batch, scored_values


@pytest.mark.parametrize("pack", [PACK, 2 * PACK])
def test_scorers_and_update_on_packed_rows_equal_those_on_the_rows(setup, pack):
  """A group per packed row, and two groups per packed row each with its own opening."""
  mesh, _, policy_def, critic_def, opts, shardings, _ = setup
  results = {}
  for pack in (1, pack):
    ucfg, state, batch, values = _scored(setup, pack)
    step = update_lib.make_update_step(policy_def, critic_def, opts, ucfg, mesh, shardings)
    scored = (np.asarray(batch["rollout_logprobs"]), np.asarray(values))
    new_state, metrics = step(state, batch)
    results[pack] = scored, jax.device_get((new_state.policy, new_state.critic)), metrics
  valid = _rows()["valid"]
  for rows, packed in zip(results[1][0], results[pack][0]):
    np.testing.assert_allclose(np.where(valid, packed, 0), np.where(valid, rows, 0),
                               rtol=1e-5, atol=1e-5)
  # After one AdamW step of lr 1e-2: Adam divides each gradient by its own magnitude, so a
  # near-zero gradient's rounding moves its weight by up to ~1e-5 (a thousandth of a step).
  for rows, packed in zip(jax.tree.leaves(results[1][1]), jax.tree.leaves(results[pack][1])):
    np.testing.assert_allclose(packed, rows, rtol=1e-4, atol=1e-5)
  for name, value in results[1][2].items():
    np.testing.assert_allclose(results[pack][2][name], value, rtol=1e-4, atol=1e-6,
                               err_msg=name)


# ----- a run ---------------------------------------------------------------------------------


def _keypad(workdir, *flags):
  """Step 1 of keypad's runlocal on one CPU device (a laptop's), its metrics."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(ROOT))
  result = subprocess.run(
      [sys.executable, "-m", "agentgym_jax.train", "--config=experiments/keypad/learn.py:runlocal",
       f"--workdir={workdir}", "--config.total_steps=1", "--config.eval.every_steps=0",
       "--config.algo.microbatches=2", *flags],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads((workdir / "metrics.jsonl").read_text().splitlines()[-1])


def test_a_run_on_packed_rows_takes_the_same_first_step(tmp_path):
  """The trainer packs each group (2 tasks x 4 samples, a packed row per micro-batch): the same
  episodes, the same loss and gradient norm as the run on the rows themselves."""
  rows = _keypad(tmp_path / "rows")
  packed = _keypad(tmp_path / "packed", "--config.algo.pack_rows=4")
  for name in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
               "episodes/length_mean", "batch/advantage_mean", "update/trained_tokens"):
    np.testing.assert_allclose(packed[name], rows[name], rtol=1e-4, atol=1e-6, err_msg=name)
  # Each group's 4 rows share their opening: the packed forward computes fewer positions.
  assert packed["batch/forward_positions"] < rows["batch/forward_positions"]
