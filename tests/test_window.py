"""History window: each turn's context is the opening and the last k turns (token ids checked
against what the cache was fed), per-turn rows keep the sampler's log-prob contract, and with
a window covering the whole episode they give the packed row's loss."""

import collections
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from agentgym_jax import settings as settings_lib
from agentgym_jax.models import Decoder, ModelConfig
from agentgym_jax.rl import advantages
from agentgym_jax.rl import logprobs as logprobs_lib
from agentgym_jax.rollout import RolloutSettings, SamplingConfig, run_episodes, window
from agentgym_jax.rollout import batch as batch_lib
from agentgym_jax.rollout import episodes as episodes_lib
from agentgym_jax.rollout.records import segments
from agentgym_jax.tokenization import ChatTokenizer
from agentgym_jax.train import config as base
from agentgym_jax.train import update as update_lib
from environments.workers import StepOutcome

SAMPLING = SamplingConfig(temperature=1.0, max_reply_tokens=6)


@pytest.fixture(scope="module")
def tok():
  corpus = ["Find the key.", "You are in room 3. Doors lead north and east.",
            "Action: go north\nThought: the key may be there."] * 10
  return ChatTokenizer.train_bpe(corpus, vocab_size=320)


@pytest.fixture(scope="module")
def model(tok):
  cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, initializer_range=0.3)
  decoder = Decoder(cfg, rngs=nnx.Rngs(0))
  embed = decoder.backbone.embed
  embed[...] = embed[...].at[tok.end_of_turn_ids[0]].multiply(4.0)
  return decoder


class LongPool:
  """Task k lasts k turns (k >= 1); an observation depends on the reply's length, and the last
  step rewards 1 when the reply has an odd number of characters, so samples of a task differ."""

  env_cls = None

  def reset(self, task_ids):
    self.tasks, self.turns = list(task_ids), [0] * len(task_ids)
    return [StepOutcome(f"Find the key. You are in room {t}.", 0.0, False, False,
                        {"instruction": "Play."}) for t in task_ids]

  def step(self, slots, responses):
    outs = []
    for slot, response in zip(slots, responses):
      self.turns[slot] += 1
      done = self.turns[slot] >= self.tasks[slot]
      reward = float(len(response) % 2) if done else 0.0
      outs.append(StepOutcome(f"Room {self.turns[slot]}{'!' * (len(response) % 3)}.",
                              reward, done, False, {"success": reward > 0}))
    return outs


def _spy_contexts(monkeypatch):
  """Replays the cache's inputs on the host: what each row holds at every decode call.

  Returns the list of [rows] token lists, one per decode (rows = episodes: no compaction).
  """
  held: dict[batch_lib.DecodeBatch, dict[int, list[int]]] = collections.defaultdict(dict)
  seen = []
  real_append, real_copy = batch_lib.DecodeBatch._append, batch_lib.DecodeBatch._copy_from
  real_rewind, real_decode = batch_lib.DecodeBatch.rewind, batch_lib.DecodeBatch.decode

  def append(self, chunks, starts, max_chunk, pad_id):
    for row, chunk in enumerate(chunks):
      held[self].setdefault(row, []).extend(chunk)
      assert len(held[self][row]) - len(chunk) == starts[row]
    return real_append(self, chunks, starts, max_chunk, pad_id)

  def copy_from(self, source, rows, source_rows, tokens):
    for row in rows:  # an opening prefilled once for several rows
      held[self][row] = list(held[source][source_rows[row]])
    return real_copy(self, source, rows, source_rows, tokens)

  def rewind(self, rewound, lengths):
    for row in np.flatnonzero(rewound):
      del held[self][row][lengths[row]:]
    return real_rewind(self, rewound, lengths)

  def decode(self, *args, **kwargs):
    active = np.asarray(self.turn.running)  # read before the call donates it
    real_decode(self, *args, **kwargs)
    counts = np.asarray(self.turn.counts)
    assert (np.asarray(self.cache.lengths)[active] - counts[active] + 1
            == [len(held[self][r]) for r in np.flatnonzero(active)]).all()
    seen.append({r: list(held[self][r]) for r in np.flatnonzero(active)})
    for r in np.flatnonzero(active):  # all but the last sampled token enter the cache
      held[self][r].extend(np.asarray(self.turn.tokens)[r, :int(counts[r]) - 1].tolist())

  monkeypatch.setattr(batch_lib.DecodeBatch, "_append", append)
  monkeypatch.setattr(batch_lib.DecodeBatch, "_copy_from", copy_from)
  monkeypatch.setattr(batch_lib.DecodeBatch, "decode", decode)
  monkeypatch.setattr(batch_lib.DecodeBatch, "rewind", rewind)
  return seen


def _run(tok, model, k, tasks=(5, 3, 6, 1), max_turns=6, max_context=1024, **kw):
  graphdef, state = nnx.split(model)
  settings = RolloutSettings(sampling=SAMPLING, max_turns=max_turns, max_context=max_context,
                             history_turns=k, compact=False, **kw)
  return run_episodes((graphdef, state), tok, LongPool(), list(tasks), settings, rng=4)


def test_context_span_is_the_opening_and_the_last_k_turns():
  index = [-1, -1, -1, 0, 0, 0, 1, 1, 2, 2, 2]
  assert window.context_span(index, 0, 2) == (3, 3, 3)
  assert window.context_span(index, 2, 2) == (3, 3, 8)
  assert window.context_span(index, 3, 2) == (3, 6, 11)
  assert window.context_span(index, 3, 1) == (3, 8, 11)
  assert window.context_span(index, 3, 0) == (3, 3, 11)  # 0 keeps every turn
  tokens = list(range(100, 111))
  assert window.context_tokens(tokens, index, 3, 1) == [100, 101, 102, 108, 109, 110]


@pytest.mark.parametrize("k", [1, 2])
def test_context_of_turn_t_holds_exactly_the_opening_and_turns_t_minus_k_to_t_minus_1(
    tok, model, k, monkeypatch):
  seen = _spy_contexts(monkeypatch)
  traj, stats = _run(tok, model, k)
  assert traj.num_turns.tolist() == [5, 3, 6, 1]  # every episode ran to its end
  for row, e in enumerate(stats["episodes"]):
    segs = segments(traj, row)
    opening = segs[0]["tokens"]
    assert opening == tok.encode_opening(e.messages[:3])
    turn_ids = [[i for s in segs if s["turn"] == t for i in s["tokens"]]
                for t in range(e.num_turns)]
    for t in range(e.num_turns):
      want = opening + [i for j in range(max(0, t - k), t) for i in turn_ids[j]]
      assert seen[t][row] == want, (row, t)


def test_turn_rows_recompute_the_sampler_log_probs(tok, model):
  traj, _ = _run(tok, model, 1)
  rows = window.build_turn_rows(jax.device_get(traj), 1, tok.pad_id, multiple=8)
  assert rows.tokens.shape[0] % 8 == 0 and (rows.episode >= 0).sum() == traj.num_turns.sum()
  assert np.asarray(rows.loss_mask).sum() == np.asarray(traj.loss_mask).sum()
  graphdef, state = nnx.split(model)
  logits = nnx.merge(graphdef, state)(rows.tokens, rows.valid)
  logp = np.asarray(logprobs_lib.token_logprobs(logits, rows.tokens))
  mask = np.asarray(rows.loss_mask)
  np.testing.assert_allclose(logp[mask], rows.sample_logprobs[mask], atol=1e-4)
  # Padding rows hold nothing and score finitely.
  assert np.isfinite(logp).all() and not mask[rows.episode < 0].any()


def test_layouts_move_agent_tokens_both_ways(tok, model):
  traj = jax.device_get(_run(tok, model, 2)[0])
  rows = window.build_turn_rows(traj, 2, tok.pad_id, multiple=4)
  x = np.random.default_rng(0).normal(size=traj.tokens.shape).astype(np.float32)
  on_rows = window.to_rows(x, rows.episode, rows.source)
  np.testing.assert_array_equal(np.asarray(on_rows)[rows.loss_mask], x[traj.loss_mask])
  back = window.to_packed(on_rows, rows.episode, rows.source, traj.tokens.shape)
  np.testing.assert_array_equal(np.asarray(back), np.where(traj.loss_mask, x, 0.0))


def test_a_window_runs_turns_past_what_the_packed_context_holds(tok, model):
  graphdef, state = nnx.split(model)
  opening = len(tok.encode_opening(episodes_lib.opening_messages(
      {"instruction": "Play."}, "Find the key. You are in room 8.", None, "OK")))
  limit = opening + 40  # a few turns unwindowed; opening + 1 turn + reply always fits
  packed, _ = _run(tok, model, 0, tasks=(8, 8), max_turns=8, max_context=limit,
                   acknowledgement="OK")
  windowed, stats = _run(tok, model, 1, tasks=(8, 8), max_turns=8, max_context=limit,
                         acknowledgement="OK")
  assert (packed.num_turns < 8).all() and packed.truncated.all()
  assert windowed.num_turns.tolist() == [8, 8] and windowed.terminated.all()
  assert [e.stop_reason for e in stats["episodes"]] == ["terminated"] * 2


def test_a_window_covering_the_episode_changes_nothing(tok, model):
  packed, _ = _run(tok, model, 0)
  covering, _ = _run(tok, model, 6)
  np.testing.assert_array_equal(covering.tokens, packed.tokens)
  np.testing.assert_allclose(covering.sample_logprobs, packed.sample_logprobs, atol=1e-5)


def _layout_loss(model, moved, traj, rows, loss_agg_mode):
  """GRPO advantages on the episodes, then the ppo_clip loss (+ its gradient) of the policy
  `moved` on the packed rows (`rows` None) or on the per-turn rows, as the trainer builds it."""
  graphdef, sampling_params = nnx.split(model)
  trained = traj if rows is None else rows
  old = logprobs_lib.token_logprobs(nnx.merge(graphdef, sampling_params)(
      trained.tokens, trained.valid), trained.tokens)
  old_packed = old if rows is None else window.to_packed(old, rows.episode, rows.source,
                                                         traj.tokens.shape)
  adv, _ = advantages.grpo(traj.rewards, traj.loss_mask, group_ids=traj.group_id)
  if rows is not None:
    adv = window.to_rows(adv, rows.episode, rows.source)
  c = base.base_config()
  c.algo.loss_agg_mode = loss_agg_mode
  c.algo.kl_coef = 0.0  # no reference policy here; the entropy term stays in the loss
  cfg = update_lib.UpdateConfig(algo=settings_lib.algorithm(c), epochs=1, minibatches=1,
                                microbatches=1, temperature=1.0)
  micro = update_lib.build_batch(
      cfg.algo, tokens=trained.tokens, valid=trained.valid, loss_mask=trained.loss_mask,
      old_logprobs=old, advantages=adv,
      seq_tokens=None if rows is None else rows.episode_tokens)
  den = update_lib.losses.aggregation_denominator(trained.loss_mask, loss_agg_mode,
                                                  seq_tokens=micro.get("seq_tokens"))
  loss_fn = functools.partial(update_lib.policy_loss, graphdef=graphdef, cfg=cfg)
  (loss, _), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(moved, micro, den)
  return float(loss), grads, np.asarray(old_packed)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_per_turn_rows_give_the_packed_loss_when_the_window_covers_the_episode(tok, model,
                                                                              mode):
  traj = jax.device_get(_run(tok, model, 6, tasks=(5, 5, 3, 3), max_turns=6)[0])
  traj = traj.replace(group_id=np.asarray([0, 0, 1, 1], np.int32))
  assert np.asarray(traj.rewards).sum(1).std() > 0  # GRPO advantages are not all 0
  rows = window.build_turn_rows(traj, 6, 0, multiple=4)
  _, params = nnx.split(model)
  moved = jax.tree.map(lambda p: p * 1.05, params)  # a policy that moved: ratios != 1
  packed_loss, packed_grads, packed_old = _layout_loss(model, moved, traj, None, mode)
  rows_loss, rows_grads, rows_old = _layout_loss(model, moved, traj, rows, mode)
  mask = np.asarray(traj.loss_mask)
  np.testing.assert_allclose(rows_old[mask], packed_old[mask], atol=1e-5)
  assert abs(packed_loss) > 1e-4
  np.testing.assert_allclose(rows_loss, packed_loss, rtol=1e-5, atol=1e-7)
  for a, b in zip(jax.tree.leaves(rows_grads), jax.tree.leaves(packed_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_negative_history_turns_is_refused():
  with pytest.raises(ValueError, match="history_turns must be >= 0"):
    RolloutSettings(history_turns=-1)
