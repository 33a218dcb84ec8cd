"""Episode runner: token exactness against real environments, log-prob consistency, KV-cache
correctness against re-encoding, bounded compilation, stop rules, compaction, sharding."""

import collections
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import environments
from agentgym_jax import caches, freed_memory
from agentgym_jax.models import Decoder, ModelConfig
from agentgym_jax.rollout import RolloutSettings, SamplingConfig, run_episodes, save_jsonl
from agentgym_jax.rollout import records as records_lib
from agentgym_jax.rollout import sampler
from agentgym_jax.rollout.envs import DEFAULT_ACKNOWLEDGEMENT
from agentgym_jax.rollout.records import segments
from agentgym_jax.sharding import make_mesh
from agentgym_jax.tokenization import ChatTokenizer
from agentgym_jax.train import trajectories
from environments.scripted.env import BOXES, INSTRUCTION
from environments.workers import EnvPool, StepOutcome

SAMPLING = SamplingConfig(temperature=1.0, max_reply_tokens=12)
GREEDY = SamplingConfig(temperature=0.0, max_reply_tokens=12)


@pytest.fixture(scope="module")
def tok():
  corpus = [INSTRUCTION, " ".join(BOXES), "Action: open the box\nThought: I craft 4 planks.",
            environments.env_class("textcraft").instruction,
            environments.env_class("babyai").instruction] * 10
  return ChatTokenizer.train_bpe(corpus, vocab_size=384)


def _model(tok, seed=0, num_layers=2):
  """A random decoder (d 64) whose end-of-turn token is likely enough to be sampled."""
  cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                    num_layers=num_layers, num_heads=4, num_kv_heads=2, initializer_range=0.3)
  model = Decoder(cfg, rngs=nnx.Rngs(seed))
  embed = model.backbone.embed
  embed[...] = embed[...].at[tok.end_of_turn_ids[0]].multiply(4.0)
  return model


@pytest.fixture(scope="module")
def model(tok):
  return _model(tok)


class Recorder:
  """Wraps a pool and records what each slot received and answered."""

  def __init__(self, pool):
    self.pool = pool
    self.env_cls = getattr(pool, "env_cls", None)
    self.responses = collections.defaultdict(list)
    self.observations = collections.defaultdict(list)

  def reset(self, task_ids):
    outs = self.pool.reset(task_ids)
    for slot, out in enumerate(outs):
      self.observations[slot] = [out.observation]
    return outs

  def step(self, slots, responses):
    outs = self.pool.step(slots, responses)
    for slot, response, out in zip(slots, responses, outs):
      self.responses[slot].append(response)
      self.observations[slot].append(out.observation)
    return outs


class FakePool:
  """Task k lasts (k % 4) + 1 turns, then terminates with reward 0.25 * (k % 4 + 1)."""

  env_cls = None

  def reset(self, task_ids):
    self.tasks, self.turns = list(task_ids), [0] * len(task_ids)
    return [StepOutcome(f"Task {t} begins.", 0.0, False, False,
                        {"instruction": "Play.", "category": f"kind {t % 2}"})
            for t in task_ids]

  def step(self, slots, responses):
    outs = []
    for slot, response in zip(slots, responses):
      self.turns[slot] += 1
      length = self.tasks[slot] % 4 + 1
      done = self.turns[slot] >= length
      reward = 0.25 * length if done else 0.01 * self.turns[slot]
      outs.append(StepOutcome(f"Turn {self.turns[slot]}: you said {len(response)} chars.",
                              reward, done, False,
                              {"success": done, "score": 10 * reward, "action": response[:5]}))
    return outs


def _spy_decode(monkeypatch):
  """Records (active, tokens, counts) of every decode call."""
  calls = []
  real = sampler.decode

  def spy(*args, **kwargs):
    active = np.asarray(args[4].running)  # read before the call donates it
    cache, logits, turn = real(*args, **kwargs)
    calls.append((active, np.asarray(turn.tokens), np.asarray(turn.counts)))
    return cache, logits, turn
  monkeypatch.setattr(sampler, "decode", spy)
  return calls


def _forward_logprobs(model, traj):
  logits = nnx.jit(lambda m, t, v: m(t, v))(model, traj.tokens, traj.valid)
  logp = jax.nn.log_softmax(logits, axis=-1)
  nxt = jnp.take_along_axis(logp[:, :-1], jnp.asarray(traj.tokens)[:, 1:, None], axis=-1)[..., 0]
  return np.concatenate([np.zeros((traj.batch_size, 1)), np.asarray(nxt)], axis=1)


@pytest.mark.parametrize("env_name", ["scripted", "textcraft", "babyai"])
def test_token_exactness_against_real_env(tok, model, env_name, monkeypatch):
  calls = _spy_decode(monkeypatch)
  task_ids = environments.task_splits(env_name)["test"][:2]
  graphdef, state = nnx.split(model)
  with EnvPool(env_name, num_workers=1) as pool:
    rec = Recorder(pool)
    settings = RolloutSettings(sampling=SAMPLING, group_size=2, max_turns=3, max_context=1024,
                               compact=False)
    traj, stats = run_episodes((graphdef, state), tok, rec, task_ids, settings, rng=7)
  episodes = stats["episodes"]
  assert traj.batch_size == 4 and traj.group_id.tolist() == [0, 0, 1, 1]
  assert traj.task_id.tolist() == [task_ids[0]] * 2 + [task_ids[1]] * 2
  saw_end, saw_cap = False, False
  for row, e in enumerate(episodes):
    segs = segments(traj, row)
    assert segs[0]["role"] == "prompt"
    assert segs[0]["tokens"] == tok.encode_opening(e.messages[:3])
    agent = [s for s in segs if s["role"] == "agent"]
    assert len(agent) == e.num_turns == len(rec.responses[row])
    for turn, seg in enumerate(agent):
      active, tokens, counts = calls[turn]
      assert active[row]
      # Exactly the ids the sampler drew, and the env got exactly their text.
      assert seg["tokens"] == tokens[row, :counts[row]].tolist()
      ended = seg["tokens"][-1] in tok.end_of_turn_ids
      saw_end, saw_cap = saw_end or ended, saw_cap or not ended
      reply = seg["tokens"][:-1] if ended else seg["tokens"]
      assert tok.decode(reply) == rec.responses[row][turn]
    for seg in segs:
      if seg["role"] == "observation":
        turn = seg["turn"]
        closing = [] if agent[turn]["tokens"][-1] in tok.end_of_turn_ids else [
            tok.end_of_turn_ids[0]]
        assert seg["tokens"] == closing + tok.encode_observation(
            rec.observations[row][turn + 1])
  assert saw_end and saw_cap, "the test model should both stop on <|im_end|> and hit the cap"
  mask = np.asarray(traj.loss_mask)
  assert mask.sum() == stats["rollout/sampled_tokens"]
  assert not (mask & ~np.asarray(traj.valid)).any()


def test_sample_logprobs_match_forward_pass(tok, model):
  graphdef, state = nnx.split(model)
  settings = RolloutSettings(sampling=SAMPLING, max_turns=4, max_context=1024, compact=False)
  traj, _ = run_episodes((graphdef, state), tok, FakePool(), [0, 1, 2, 3], settings, rng=3)
  mask = np.asarray(traj.loss_mask)
  want = _forward_logprobs(model, traj)
  np.testing.assert_allclose(np.asarray(traj.sample_logprobs)[mask], want[mask], atol=1e-4)
  assert (np.asarray(traj.sample_logprobs)[~mask] == 0).all()


def _greedy_without_cache(model, tok, pool, task_ids, max_turns, cap, max_context=512):
  """Reference: each token from a full forward pass over the whole conversation so far."""
  forward = nnx.jit(lambda m, t, v: m(t, v))
  outs = pool.reset(task_ids)
  seqs = []
  for out in outs:
    messages = [{"role": "user", "content": out.info["instruction"]},
                {"role": "assistant", "content": DEFAULT_ACKNOWLEDGEMENT},
                {"role": "user", "content": out.observation}]
    seqs.append(tok.encode_opening(messages))
  running = [True] * len(seqs)
  for _ in range(max_turns):
    replies = [[] for _ in seqs]
    for _ in range(cap):
      tokens = np.zeros((len(seqs), max_context), np.int32)
      valid = np.zeros((len(seqs), max_context), bool)
      for i, s in enumerate(seqs):
        tokens[i, :len(s)], valid[i, :len(s)] = s, True
      logits = np.asarray(forward(model, tokens, valid))
      for i, s in enumerate(seqs):
        if running[i] and not (replies[i] and replies[i][-1] in tok.end_of_turn_ids):
          nxt = int(np.argmax(logits[i, len(s) - 1]))
          s.append(nxt)
          replies[i].append(nxt)
    slots = [i for i in range(len(seqs)) if running[i]]
    texts = [tok.decode(replies[i][:-1] if replies[i][-1] in tok.end_of_turn_ids
                        else replies[i]) for i in slots]
    for i, out in zip(slots, pool.step(slots, texts)):
      if out.terminated or out.truncated:
        running[i] = False
      else:
        closing = [] if replies[i][-1] in tok.end_of_turn_ids else [tok.end_of_turn_ids[0]]
        seqs[i] += closing + tok.encode_observation(out.observation)
  return seqs


def test_cache_matches_reencoding_every_turn(tok, model):
  graphdef, state = nnx.split(model)
  settings = RolloutSettings(sampling=GREEDY, max_turns=3, max_context=1024, compact=False)
  traj, stats = run_episodes((graphdef, state), tok, FakePool(), [1, 2, 3, 6], settings, rng=0)
  reference = _greedy_without_cache(model, tok, FakePool(), [1, 2, 3, 6], 3,
                                    GREEDY.max_reply_tokens)
  for row, want in enumerate(reference):
    n = int(np.asarray(traj.valid[row]).sum())
    got = np.asarray(traj.tokens[row, :n]).tolist()
    # The runner does not append the final observation after the last turn.
    assert got == want[:n]
  assert traj.num_turns.tolist() == [2, 3, 3, 3]


def test_twenty_turns_compile_a_bounded_number_of_times(tok):
  # A model of its own (1 layer: compiles faster), so no other test has compiled for it yet.
  model = _model(tok, seed=1, num_layers=1)
  graphdef, state = nnx.split(model)
  before = (sampler.extend._cache_size(), sampler.decode._cache_size())
  with EnvPool("scripted", num_workers=1,
               env_kwargs=dict(max_steps=100, filler_words=8, vary_filler=True)) as pool:
    rec = Recorder(pool)
    settings = RolloutSettings(sampling=SamplingConfig(max_reply_tokens=8), max_turns=20,
                               max_context=2048, compact=False)
    traj, stats = run_episodes((graphdef, state), tok, rec, [0, 1, 2, 3], settings, rng=1)
  lengths = {len(tok.encode_observation(o)) for obs in rec.observations.values() for o in obs}
  assert len(lengths) >= 5  # observation chunks of many different lengths
  successes = int(np.asarray(traj.success).sum())
  assert (traj.num_turns == 20).sum() + successes == 4
  extends = sampler.extend._cache_size() - before[0]
  decodes = sampler.decode._cache_size() - before[1]
  # The cache grows through 256, 384, 512, 768, 1024, 1536 (and 2048) slots (~1400 tokens
  # after 20 turns): decode compiles once per cache length; extend once per (chunk bucket,
  # cache length) met.
  assert decodes <= 7 and extends <= 10, (extends, decodes)


def test_stop_rules_and_rewards(tok, model):
  graphdef, state = nnx.split(model)
  # Task 1 ends after 2 turns, task 3 would need 4: the turn limit cuts it at 3.
  settings = RolloutSettings(sampling=SAMPLING, group_size=2, max_turns=3, max_context=1024,
                             compact=False)
  traj, stats = run_episodes((graphdef, state), tok, FakePool(), [1, 3], settings, rng=0)
  assert [e.stop_reason for e in stats["episodes"]] == ["terminated"] * 2 + ["max_turns"] * 2
  assert traj.group_id.tolist() == [0, 0, 1, 1]
  assert traj.num_turns.tolist() == [2, 2, 3, 3]
  assert traj.terminated.tolist() == [True, True, False, False]
  assert traj.truncated.tolist() == [False, False, True, True]
  rewards = np.asarray(traj.rewards)
  mask = np.asarray(traj.loss_mask)
  for row in range(4):
    last_agent = np.flatnonzero(mask[row])[-1]
    assert np.flatnonzero(rewards[row]).tolist() == [last_agent]
    # The last step's reward is the outcome (task 3 is still running at the cut: 0.03).
    assert rewards[row, last_agent] == pytest.approx([0.5, 0.03][row // 2])
    # turn_rewards: what each step added to the reward, on the turn's last sampled token
    # (FakePool reports 0.01 x turn while running): they sum to the outcome.
    turn_rewards = np.asarray(traj.turn_rewards[row])
    ends = [np.flatnonzero(mask[row] & (np.asarray(traj.turn_index[row]) == t))[-1]
            for t in range(traj.num_turns[row])]
    assert np.flatnonzero(turn_rewards).tolist() == ends
    assert turn_rewards[ends[0]] == pytest.approx(0.01)
    assert turn_rewards.sum() == pytest.approx(rewards[row, last_agent])
  assert traj.success.tolist() == [True, True, False, False]
  assert traj.score.tolist() == pytest.approx([5.0, 5.0, 0.3, 0.3])
  from agentgym_jax.train import metrics as metrics_lib  # pylint: disable=import-outside-toplevel
  counted = metrics_lib.episode_metrics(jax.device_get(traj), stats["episodes"])
  assert counted["episodes/stop_terminated"] == 0.5 and counted["episodes/stop_max_turns"] == 0.5
  assert counted["episodes/stop_context"] == 0.0
  assert traj.tokens.shape[1] in (64, 96, 128, 192, 256, 384, 512)


class RefusingPool(FakePool):
  """FakePool whose environment refuses the action of every first and third turn."""

  def step(self, slots, responses):
    return [StepOutcome(o.observation, o.reward, o.terminated, o.truncated,
                        dict(o.info, invalid_action=self.turns[s] in (1, 3)))
            for o, s in zip(super().step(slots, responses), slots)]


def test_invalid_action_reward_shapes_the_refused_turns_only(tok, model):
  graphdef, state = nnx.split(model)
  # Task 1 terminates on turn 2 (reward 0.5), task 3 is cut at turn 3 (reward 0.03 so far).
  settings = RolloutSettings(sampling=SAMPLING, group_size=1, max_turns=3, max_context=1024,
                             invalid_action_reward=-0.1)
  traj, stats = run_episodes((graphdef, state), tok, RefusingPool(), [1, 3], settings, rng=0)
  mask, turn_index = np.asarray(traj.loss_mask), np.asarray(traj.turn_index)
  expected_turns = [[0.01 - 0.1, 0.49], [0.01 - 0.1, 0.01, 0.01 - 0.1]]
  for row, expected in enumerate(expected_turns):
    ends = [np.flatnonzero(mask[row] & (turn_index[row] == t))[-1] for t in range(len(expected))]
    assert np.asarray(traj.turn_rewards[row])[ends] == pytest.approx(expected)
    assert np.asarray(traj.rewards[row]).sum() == pytest.approx(sum(expected))
  assert [e.invalid_actions for e in stats["episodes"]] == [1, 2]
  assert traj.success.tolist() == [True, False]  # the environment's, unshaped
  assert traj.score.tolist() == pytest.approx([5.0, 0.3])
  from agentgym_jax.train import metrics as metrics_lib  # pylint: disable=import-outside-toplevel
  counted = metrics_lib.episode_metrics(jax.device_get(traj), stats["episodes"])
  assert counted["episodes/invalid_action_rate"] == pytest.approx(3 / 5)


class KeyedPool(FakePool):
  """FakePool whose states have keys that its words do not tell apart: every task starts in
  state "start", and after turn k every episode of task t is in state "t-k" (t odd) or "any-k"
  (t even: even tasks share their states), whatever the agent said."""

  @staticmethod
  def key(task, turn):
    return "start" if turn == 0 else f"{task if task % 2 else 'any'}-{turn}"

  def reset(self, task_ids):
    outs = super().reset(task_ids)
    return [StepOutcome(o.observation, o.reward, o.terminated, o.truncated,
                        dict(o.info, state_key=self.key(t, 0))) for o, t in zip(outs, task_ids)]

  def step(self, slots, responses):
    outs = super().step(slots, responses)
    return [StepOutcome(o.observation, o.reward, o.terminated, o.truncated,
                        dict(o.info, state_key=self.key(self.tasks[s], self.turns[s])))
            for o, s in zip(outs, slots)]


def test_turn_anchors_group_exactly_the_turns_that_acted_from_one_state(tok, model):
  graphdef, state = nnx.split(model)

  def same_pairs(anchors, states):
    """Pairs of (episode, turn) with equal anchors, and pairs with equal states."""
    items = list(states)
    return ({(a, b) for a in items for b in items if anchors[a] == anchors[b]},
            {(a, b) for a in items for b in items if states[a] == states[b]})

  settings = RolloutSettings(sampling=SAMPLING, group_size=2, max_turns=3, max_context=1024)
  # Without a state key the anchor is the observation text the turn answered.
  traj, stats = run_episodes((graphdef, state), tok, FakePool(), [1, 3, 2], settings, rng=0)
  anchors = np.asarray(traj.turn_anchors)
  assert anchors.shape[1] >= 3
  texts = {(b, k): e.messages[2 + 2 * k]["content"]
           for b, e in enumerate(stats["episodes"]) for k in range(e.num_turns)}
  got, want = same_pairs({i: anchors[i] for i in texts}, texts)
  assert got == want and len(want) > len(texts)  # some turns do share a text
  for b, e in enumerate(stats["episodes"]):
    assert (anchors[b, e.num_turns:] == -1).all()

  # With one, the key decides, not the words.
  traj, stats = run_episodes((graphdef, state), tok, KeyedPool(), [1, 3, 2, 6], settings,
                             rng=0)
  anchors = np.asarray(traj.turn_anchors)
  keys = {(b, k): KeyedPool.key(e.task_id, k)
          for b, e in enumerate(stats["episodes"]) for k in range(e.num_turns)}
  got, want = same_pairs({i: anchors[i] for i in keys}, keys)
  assert got == want
  assert anchors[4, 1] == anchors[6, 1] != anchors[0, 1]  # tasks 2 and 6 share "any-1"


def test_context_limit_truncates(tok, model):
  graphdef, state = nnx.split(model)
  opening = len(tok.encode_opening([{"role": "user", "content": "Play."},
                                    {"role": "assistant", "content": DEFAULT_ACKNOWLEDGEMENT},
                                    {"role": "user", "content": "Task 3 begins."}]))
  limit = opening + 60
  settings = RolloutSettings(sampling=SAMPLING, max_turns=10, max_context=limit, compact=False)
  traj, stats = run_episodes((graphdef, state), tok, FakePool(), [3, 3, 3, 3], settings, rng=0)
  assert [e.stop_reason for e in stats["episodes"]] == ["context"] * 4
  assert traj.truncated.all() and not traj.terminated.any()
  assert (np.asarray(traj.valid).sum(1) <= limit).all()
  # An opening that leaves no room for a reply ends before the first turn.
  settings = RolloutSettings(sampling=SAMPLING, max_turns=10, max_context=opening)
  traj, stats = run_episodes((graphdef, state), tok, FakePool(), [3], settings, rng=0)
  assert traj.num_turns.tolist() == [0] and not np.asarray(traj.loss_mask).any()


def test_compaction_and_sharding_do_not_change_samples(tok, model, monkeypatch):
  graphdef, state = nnx.split(model)
  # Two episodes end after one turn, so the batch shrinks from 4 rows to 2.
  settings = RolloutSettings(sampling=SAMPLING, max_turns=2, max_context=1024)
  run = lambda mesh=None, **kw: run_episodes((graphdef, state), tok, FakePool(), [0, 1, 4, 5],
                                             dataclasses.replace(settings, **kw), rng=11,
                                             mesh=mesh)[0]
  plain = run(compact=False)
  calls = _spy_decode(monkeypatch)
  compacted = run(compact=True)
  assert [len(active) for active, _, _ in calls] == [4, 2]
  mesh = make_mesh([("data", -1), ("fsdp", 1), ("tensor", 1)], devices=jax.devices()[:4])
  sharded = run(compact=True, mesh=mesh)
  calls.clear()
  devices = []
  spied = sampler.decode
  monkeypatch.setattr(sampler, "decode", lambda *args, **kwargs: devices.append(
      args[2].lengths.sharding.device_set) or spied(*args, **kwargs))
  # Two replicas of 2 rows each, on 2 local devices; then each on half of the 4-device mesh.
  replicas = run(compact=True, replicas=2)
  assert sorted(len(active) for active, _, _ in calls) == [1, 1, 2, 2]  # each compacts alone
  assert devices[:2] == [{d} for d in jax.local_devices()[:2]]
  replicas_on_mesh = run(compact=True, mesh=mesh, replicas=2)
  # A cache of max_context slots from the start, attention bounded to the rows' bucket.
  caches = []
  monkeypatch.setattr(sampler, "decode", lambda *args, **kwargs: caches.append(
      (args[2].max_len, args[2].view_len)) or spied(*args, **kwargs))
  full_cache = run(compact=True, grow_cache=False)
  assert set(caches) == {(1024, 256)}
  assert plain.num_turns.tolist() == [1, 2, 1, 2]
  for other in (compacted, sharded, replicas, replicas_on_mesh, full_cache):
    np.testing.assert_array_equal(other.tokens, plain.tokens)
    # Other batch shapes sum attention in another order: float32 rounding, nothing more.
    np.testing.assert_allclose(other.sample_logprobs, plain.sample_logprobs, atol=1e-4)


def test_each_replica_keeps_its_own_lockstep(tok, model, monkeypatch):
  """A replica's environments step and its next turn is dispatched before the other
  replica's replies are taken, so no device waits for another replica's host work."""
  graphdef, state = nnx.split(model)
  events = []
  spied = sampler.decode
  monkeypatch.setattr(sampler, "decode", lambda *args, **kwargs: events.append(
      ("decode", next(iter(args[2].lengths.sharding.device_set)).id)) or spied(*args, **kwargs))

  class Pool(FakePool):
    def step(self, slots, responses):
      events.append(("step", tuple(slots)))
      return super().step(slots, responses)

  # Task 3 lasts 4 turns: all four episodes run both turns, two on each replica.
  settings = RolloutSettings(sampling=SAMPLING, max_turns=2, max_context=1024, replicas=2)
  _, stats = run_episodes((graphdef, state), tok, Pool(), [3, 3, 3, 3], settings, rng=0)
  first, second = (("decode", d.id) for d in jax.local_devices()[:2])
  assert events == [first, second, ("step", (0, 1)), first, ("step", (2, 3)), second,
                    ("step", (0, 1)), ("step", (2, 3))]
  assert len(stats["turn_seconds"]) == 2


def test_overlapped_env_steps_sample_what_lockstep_samples(tok, model, monkeypatch):
  graphdef, state = nnx.split(model)
  settings = RolloutSettings(sampling=SAMPLING, group_size=2, max_turns=3, max_context=1024)
  run = lambda pool, **kw: run_episodes((graphdef, state), tok, pool, [0, 1, 2, 3, 5, 6],
                                        dataclasses.replace(settings, **kw), rng=3)
  lockstep, lock_stats = run(FakePool())
  assert len(lock_stats["turn_seconds"]) == 3
  overlapped, stats = run(FakePool(), overlap_env=True)
  assert stats["turn_seconds"] == [] and stats["rollout/sampled_tokens"] == (
      lock_stats["rollout/sampled_tokens"])
  # A real pool whose steps take 0.3 s: one cohort decodes while the other's steps run.
  events = []
  real_decode, real_collect = sampler.decode, EnvPool.collect
  monkeypatch.setattr(sampler, "decode", lambda *args, **kwargs: events.append(
      ("decode", set(np.flatnonzero(np.asarray(args[4].running))))) or real_decode(
          *args, **kwargs))
  with EnvPool("scripted", num_workers=1, threads_per_worker=12,
               env_kwargs=dict(step_latency_s=0.3)) as pool:
    monkeypatch.setattr(pool, "submit", lambda slots, responses, submit=pool.submit: (
        events.append(("submit", set(slots))), submit(slots, responses))[1])
    scripted_lock, _ = run(pool, compact=False)
    events.clear()
    scripted_overlapped, _ = run(pool, overlap_env=True, compact=False)
  # Cohorts of 6 rows: the second decodes right after the first's replies went out.
  kinds = [kind for kind, _ in events]
  assert kinds[:4] == ["decode", "decode", "submit", "submit"]
  assert [len(rows) for _, rows in events[:4]] == [6, 6, 6, 6]
  for a, b in ((lockstep, overlapped), (scripted_lock, scripted_overlapped)):
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_array_equal(b.loss_mask, a.loss_mask)
    np.testing.assert_array_equal(b.num_turns, a.num_turns)
    np.testing.assert_allclose(b.sample_logprobs, a.sample_logprobs, atol=1e-4)
    np.testing.assert_allclose(b.rewards, a.rewards)


def test_rows_run_a_share_of_the_batch_with_its_keys_and_groups(tok, model):
  graphdef, state = nnx.split(model)
  settings = RolloutSettings(sampling=SAMPLING, group_size=2, max_turns=2, max_context=1024)
  run = lambda rows=None: run_episodes((graphdef, state), tok, FakePool(), [0, 1, 4], settings,
                                       rng=5, rows=rows)
  whole, _ = run()
  # A multi-host process's share: rows 3..5 of the 6, alone in their own batch.
  part, stats = run(rows=[3, 4, 5])
  assert [e.group_id for e in stats["episodes"]] == [1, 2, 2]
  np.testing.assert_array_equal(part.group_id, whole.group_id[3:])
  np.testing.assert_array_equal(part.task_id, whole.task_id[3:])
  length = min(part.tokens.shape[1], whole.tokens.shape[1])
  np.testing.assert_array_equal(part.tokens[:, :length], whole.tokens[3:, :length])
  with pytest.raises(ValueError, match=r"rows must lie in \[0, 6\)"):
    run(rows=[6])


def test_replicas_must_fit_the_devices(tok, model):
  graphdef, state = nnx.split(model)
  settings = RolloutSettings(sampling=SAMPLING, max_turns=1, max_context=1024)
  run = lambda mesh=None, **kw: run_episodes((graphdef, state), tok, FakePool(), [0, 1],
                                             dataclasses.replace(settings, **kw), mesh=mesh)
  with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
    run(replicas=len(jax.local_devices()) + 1)
  mesh = make_mesh([("data", -1), ("fsdp", 1), ("tensor", 1)], devices=jax.devices()[:4])
  with pytest.raises(ValueError, match="must divide the mesh's data axis"):
    run(mesh=mesh, replicas=3)
  with pytest.raises(ValueError, match="replicas must be >= 1"):
    run(replicas=0)
  # More replicas than episodes: the empty ones are skipped.
  traj, _ = run(replicas=4)
  assert traj.num_turns.tolist() == [1, 1]


def test_save_jsonl(tok, model, tmp_path):
  graphdef, state = nnx.split(model)
  settings = RolloutSettings(sampling=SAMPLING, max_turns=3, max_context=1024, compact=False)
  traj, stats = run_episodes((graphdef, state), tok, FakePool(), [1, 2, 1, 2], settings, rng=0)
  path = tmp_path / "traj.jsonl"
  save_jsonl(str(path), traj, tok.decode, stats["episodes"])
  save_jsonl(str(path), traj, tok.decode, stats["episodes"], append=True)
  lines = [json.loads(line) for line in path.read_text().splitlines()]
  assert [line["num_turns"] for line in lines] == [2, 3, 2, 3] * 2
  lines = lines[:4]
  for line, e in zip(lines, stats["episodes"]):
    assert "".join(s["text"] for s in line["segments"]) == tok.decode(e.tokens)
    replies = [m["content"] for m in line["messages"][3::2]]
    agent = [s["text"] for s in line["segments"] if s["role"] == "agent"]
    assert [a.removesuffix(tok.end_of_turn) for a in agent] == replies
    assert line["stop_reason"] == "terminated" and line["reward"] == e.reward
    # Per turn: the reply, the environment's parse of it, its answer and that step's reward.
    assert line["category"] == f"kind {e.task_id % 2}"
    assert [t["agent"] for t in line["turns"]] == replies
    assert [t["action"] for t in line["turns"]] == [r[:5] for r in replies]
    assert [t["observation"] for t in line["turns"]] == [
        m["content"] for m in line["messages"][4::2]]
    # Each turn's reward is what its step added (FakePool reports 0.01 x turn while running).
    length = e.task_id % 4 + 1
    assert [t["reward"] for t in line["turns"]] == pytest.approx(
        [0.01] * (length - 1) + [0.25 * length - 0.01 * (length - 1)])


def test_saved_training_step_has_per_token_advantages_and_values(tok, model, tmp_path):
  graphdef, state = nnx.split(model)
  settings = RolloutSettings(sampling=SAMPLING, max_turns=3, max_context=1024, compact=False)
  traj, stats = run_episodes((graphdef, state), tok, FakePool(), [1, 2, 1, 2], settings, rng=0)
  rng = np.random.default_rng(0)
  advantages = rng.normal(size=traj.tokens.shape).astype(np.float32)
  values = rng.normal(size=traj.tokens.shape).astype(np.float32)
  path = trajectories.save_step(str(tmp_path), 7, traj, stats["episodes"], tok.decode, 3,
                                advantages=advantages, values=values)
  assert path == str(tmp_path / "trajectories" / "step_7.jsonl")
  assert os.listdir(tmp_path / "trajectories") == ["step_7.jsonl"]  # no temporary file left
  lines = [json.loads(line) for line in open(path)]
  assert [line["task_id"] for line in lines] == [1, 2, 1]  # the first 3 rows
  for row, line in enumerate(lines):
    assert line["step"] == 7 and len(line["turns"]) == line["num_turns"]
    for seg in line["segments"]:
      cols = slice(seg["start"], seg["start"] + len(seg["tokens"]))
      assert seg["loss_mask"] == int(seg["role"] == "agent")
      assert all(np.asarray(traj.loss_mask)[row, cols] == seg["loss_mask"])
      if seg["role"] != "agent":
        assert "advantages" not in seg
        continue
      assert len(seg["pieces"]) == len(seg["tokens"])
      np.testing.assert_allclose(seg["logprobs"], traj.sample_logprobs[row, cols], atol=1e-4)
      np.testing.assert_allclose(seg["advantages"], advantages[row, cols], atol=1e-4)
      np.testing.assert_allclose(seg["values"], values[row, cols], atol=1e-4)


def test_saved_step_is_written_whole_or_not_at_all(tok, model, tmp_path, monkeypatch):
  """A write that fails part-way (a crash, a full disk) leaves the step's earlier file whole
  and no temporary file behind."""
  graphdef, state = nnx.split(model)
  settings = RolloutSettings(sampling=SAMPLING, max_turns=3, max_context=1024)
  traj, stats = run_episodes((graphdef, state), tok, FakePool(), [1, 2], settings, rng=0)
  path = trajectories.save_step(str(tmp_path), 4, traj, stats["episodes"], tok.decode, 2)
  whole = open(path).read()
  dumps = json.dumps
  calls = []

  def fail_on_second_record(record):
    calls.append(record)
    if len(calls) == 2:
      raise OSError("No space left on device")
    return dumps(record)

  monkeypatch.setattr(records_lib.json, "dumps", fail_on_second_record)
  with pytest.raises(OSError, match="No space"):
    trajectories.save_step(str(tmp_path), 4, traj, stats["episodes"], tok.decode, 2)
  assert len(calls) == 2 and os.listdir(tmp_path / "trajectories") == ["step_4.jsonl"]
  assert open(path).read() == whole


def test_on_ended_counts_every_episode_once_as_it_ends(tok, model):
  graphdef, state = nnx.split(model)
  told = []
  settings = RolloutSettings(sampling=SAMPLING, group_size=2, max_turns=3, max_context=1024)
  _, stats = run_episodes((graphdef, state), tok, FakePool(), [0, 1, 2, 3], settings, rng=0,
                          on_ended=told.append)
  ended_at = collections.Counter(e.num_turns for e in stats["episodes"])
  # After the openings (none ends there), then after turns 1-3: task k lasts k % 4 + 1 turns,
  # and task 3 is cut at the turn limit of 3.
  assert told == [0, ended_at[1], ended_at[2], ended_at[3]] == [0, 2, 2, 4]


def test_bad_arguments(tok, model):
  graphdef, state = nnx.split(model)
  with pytest.raises(ValueError, match="at least one task"):
    run_episodes((graphdef, state), tok, FakePool(), [], RolloutSettings(max_turns=2))
  with pytest.raises(ValueError, match="must be >= 1"):
    RolloutSettings(max_turns=0)
  with pytest.raises(ValueError, match="must be >= 1"):
    RolloutSettings(group_size=0)
  with pytest.raises(ValueError, match="history_turns must be >= 0"):
    RolloutSettings(history_turns=-1)


def test_programs_past_the_budget_go_between_turns_and_the_samples_stay(tok, model):
  """freed_memory.ProgramBudget: a rollout drops the programs past the budget between its turns
  (the next turns load them again) and samples what it samples keeping them."""
  graphdef, state = nnx.split(model)
  settings = RolloutSettings(sampling=GREEDY, max_turns=3, max_context=1024, compact=False)
  run = lambda: run_episodes((graphdef, state), tok, FakePool(), [1, 2, 3, 6], settings, rng=0)
  want, _ = run()
  freed_memory.release_programs()  # so that each turn builds its programs again
  budget = freed_memory.ProgramBudget(1, caches.CompileCounter().built)  # 1 byte: always over
  freed_memory.set_program_budget(budget)
  try:
    got, _ = run()
  finally:
    freed_memory.set_program_budget(None)
  assert budget.releases >= 2  # one in each of the 2 gaps between the 3 turns
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.sample_logprobs, want.sample_logprobs)
