"""Sampler: filtering golden values, greedy, per-row stops, log-probs, chunked extend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentgym_jax.models import Decoder, KVCache, ModelConfig
from agentgym_jax.rl.logprobs import token_logprobs
from agentgym_jax.rollout import sampler
from agentgym_jax.rollout.batch import DecodeBatch
from agentgym_jax.rollout.sampler import SamplingConfig
from agentgym_jax.rollout.trajectory import bucket_length
from agentgym_jax.sharding import make_mesh

VOCAB = 97
CFG = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2)
PROBS = np.asarray([0.5, 0.3, 0.15, 0.05])


@pytest.fixture(scope="module")
def model():
  return Decoder(CFG, rngs=nnx.Rngs(0))


def _keys(n, seed=0):
  return jax.random.split(jax.random.key(seed), n)


def _prefill(model, prompts, max_len=64):
  """Extends an empty cache with right-padded prompts; returns cache, logits."""
  graphdef, state = nnx.split(model)
  lens = np.asarray([len(p) for p in prompts], np.int32)
  tokens = np.zeros((len(prompts), bucket_length(lens.max(), 16)), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  cache = KVCache.init(CFG, len(prompts), max_len)
  logits = jnp.zeros((len(prompts), VOCAB))
  return sampler.extend(graphdef, state, cache, logits, tokens, lens)


PROMPTS = [[5, 17, 3, 9], [11, 2, 40, 41, 42, 43, 44], [7], [60, 61, 62]]


def test_filter_top_p_golden():
  logits = jnp.log(jnp.asarray([PROBS]))
  kept = lambda cfg: np.flatnonzero(np.asarray(sampler.filter_logits(logits, cfg))[0] > -1e29)
  # Kept while the mass before a token is below top_p: 0.5 -> {0}, 0.7 -> {0, 1}.
  assert kept(SamplingConfig(top_p=0.5)).tolist() == [0]
  assert kept(SamplingConfig(top_p=0.7)).tolist() == [0, 1]
  assert kept(SamplingConfig(top_p=0.81)).tolist() == [0, 1, 2]
  # Top-p applies after the temperature: at T=2 probs ~ sqrt(p) = [.379, .294, .208, .120],
  # so top_p=0.7 keeps three tokens.
  assert kept(SamplingConfig(temperature=2.0, top_p=0.7)).tolist() == [0, 1, 2]
  assert kept(SamplingConfig(top_k=2)).tolist() == [0, 1]
  assert kept(SamplingConfig(top_k=3, top_p=0.7)).tolist() == [0, 1]
  filtered = np.asarray(sampler.filter_logits(logits, SamplingConfig(temperature=2.0)))[0]
  np.testing.assert_allclose(filtered, np.log(PROBS) / 2, rtol=1e-6)


def test_top_p_sampling_frequencies():
  n = 4000
  logits = jnp.log(jnp.tile(jnp.asarray(PROBS, jnp.float32), (n, 1)))
  tokens, logprobs = sampler.sample_tokens(logits, _keys(n), SamplingConfig(top_p=0.7))
  counts = np.bincount(np.asarray(tokens), minlength=4) / n
  assert counts[2] == counts[3] == 0
  np.testing.assert_allclose(counts[:2], [0.5 / 0.8, 0.3 / 0.8], atol=0.03)
  # The log-prob is under the distribution sampled from: renormalised over the kept tokens.
  np.testing.assert_allclose(np.asarray(logprobs), np.log(PROBS / 0.8)[np.asarray(tokens)],
                             rtol=1e-5)


def test_sampling_logprobs_golden_top_k_and_top_p():
  """Hand-computed: top-k = 2 keeps 0.5, 0.3 -> log(0.5 / 0.8), log(0.3 / 0.8); top-p = 0.5
  keeps 0.5 alone -> log 1 = 0; T = 2 with top-k = 2 renormalises sqrt(p) over two tokens."""
  logits = jnp.log(jnp.asarray([PROBS]))
  lp = lambda cfg: np.asarray(sampler.sampling_logprobs(logits, cfg))[0]
  np.testing.assert_allclose(lp(SamplingConfig(top_k=2))[:2], [np.log(0.625), np.log(0.375)],
                             rtol=1e-6)
  np.testing.assert_allclose(lp(SamplingConfig(top_p=0.5))[0], 0.0, atol=1e-7)
  root = np.sqrt(PROBS[:2])
  np.testing.assert_allclose(lp(SamplingConfig(temperature=2.0, top_k=2))[:2],
                             np.log(root / root.sum()), rtol=1e-6)
  for cfg in (SamplingConfig(top_k=2), SamplingConfig(top_p=0.5)):
    assert (lp(cfg)[2:] < -1e29).all()  # filtered tokens: no mass
  # Off: the full softmax at T, what the trainer scores (rl.logprobs.token_logprobs).
  np.testing.assert_allclose(lp(SamplingConfig()), np.log(PROBS), rtol=1e-6)


def test_filtered_logprobs_differ_from_trainers_by_the_kept_mass():
  """The correction the sampler docstring describes: for a sampled token the trainer's
  full-softmax log-prob minus the sampler's is log Z, Z the kept mass, so the truncated
  importance weight exp(logp_update - logp_rollout) is p / q = Z; without filtering it is 1."""
  n = 64
  logits = jax.random.normal(jax.random.key(3), (n, VOCAB)) * 2
  for cfg, kept_mass in ((SamplingConfig(top_k=2), None), (SamplingConfig(top_p=0.6), None),
                         (SamplingConfig(), 1.0)):
    tokens, rollout = sampler.sample_tokens(logits, _keys(n, 7), cfg)
    # token_logprobs scores tokens[t + 1] with logits[t], reported at position t + 1.
    seq = jnp.stack([jnp.zeros_like(tokens), tokens], axis=1)
    update = np.asarray(token_logprobs(jnp.stack([logits, logits], axis=1), seq))[:, 1]
    probs = np.asarray(jax.nn.softmax(logits))
    kept = np.asarray(sampler.filter_logits(logits, cfg)) > -1e29
    z = (probs * kept).sum(-1) if kept_mass is None else np.full(n, kept_mass)
    np.testing.assert_allclose(np.exp(update - np.asarray(rollout)), z, rtol=1e-4)


def test_greedy_and_top_k_one_are_argmax():
  logits = jax.random.normal(jax.random.key(1), (16, VOCAB)) * 3
  argmax = np.asarray(jnp.argmax(logits, -1))
  greedy, lp = sampler.sample_tokens(logits, _keys(16), SamplingConfig(temperature=0.0))
  np.testing.assert_array_equal(greedy, argmax)
  np.testing.assert_allclose(lp, np.asarray(jax.nn.log_softmax(logits))[np.arange(16), argmax],
                             rtol=1e-6)
  top1, lp1 = sampler.sample_tokens(logits, _keys(16, 5), SamplingConfig(temperature=0.7,
                                                                         top_k=1))
  np.testing.assert_array_equal(top1, argmax)
  np.testing.assert_allclose(lp1, 0.0, atol=1e-6)  # all the kept mass is on the argmax


def test_sampling_config_rejects_bad_values():
  for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
              dict(max_reply_tokens=0)):
    with pytest.raises(ValueError):
      SamplingConfig(**bad)


def _decode(model, end_ids, caps, active=None,
            sampling=SamplingConfig(temperature=1.0, max_reply_tokens=12)):
  graphdef, state = nnx.split(model)
  cache, logits = _prefill(model, PROMPTS)
  b = len(PROMPTS)
  active = np.ones(b, bool) if active is None else np.asarray(active)
  # Token i of row b is drawn with key fold_in(_keys(b)[b], i).
  turn = sampler.Turn.idle(_keys(b), sampling.max_reply_tokens).replace(
      running=jnp.asarray(active))
  cache, _, turn = sampler.decode(graphdef, state, cache, logits, turn,
                                  np.asarray(caps, np.int32), end_ids, sampling)
  return cache, np.asarray(turn.tokens), np.asarray(turn.logprobs), np.asarray(turn.counts)


def test_decode_stops_per_row_on_end_token_and_cap(model):
  # Reference: the same random streams without end tokens, every row runs to the cap.
  _, free, _, counts = _decode(model, (), [12] * 4)
  assert counts.tolist() == [12] * 4
  # Stop on the first token that row 0 draws for the first time at step >= 3 (and wherever
  # another row meets it first).
  first = next(i for i in range(3, 12) if free[0, i] not in free[0, :i])
  end = int(free[0, first])
  cache, tokens, _, counts = _decode(model, (end, VOCAB + 5), [12, 12, 5, 1])
  expected = []
  for row, cap in enumerate([12, 12, 5, 1]):
    hits = np.flatnonzero(free[row, :cap] == end)
    expected.append(int(hits[0]) + 1 if hits.size else cap)
  assert expected[0] == first + 1 and expected[3] == 1
  assert counts.tolist() == expected
  for row, n in enumerate(expected):
    np.testing.assert_array_equal(tokens[row, :n], free[row, :n])
    assert (tokens[row, n:] == 0).all()
  # The last sampled token of each row stays pending (not in the cache).
  lens = np.asarray([len(p) for p in PROMPTS])
  np.testing.assert_array_equal(np.asarray(cache.lengths), lens + counts - 1)


def test_inactive_rows_do_not_move(model):
  cache, tokens, logprobs, counts = _decode(model, (), [6] * 4, active=[True, False, True, False])
  assert counts.tolist() == [6, 0, 6, 0]
  assert (tokens[[1, 3]] == 0).all() and (logprobs[[1, 3]] == 0).all()
  lens = np.asarray([len(p) for p in PROMPTS])
  np.testing.assert_array_equal(np.asarray(cache.lengths), lens + [5, 0, 5, 0])


def test_sample_logprobs_match_forward_pass(model):
  _, tokens, logprobs, counts = _decode(model, (), [10] * 4)
  seqs = [np.concatenate([p, tokens[row, :counts[row]]]) for row, p in enumerate(PROMPTS)]
  padded = np.zeros((4, 32), np.int32)
  valid = np.zeros((4, 32), bool)
  for row, seq in enumerate(seqs):
    padded[row, :len(seq)], valid[row, :len(seq)] = seq, True
  full = np.asarray(jax.nn.log_softmax(nnx.jit(lambda m, t, v: m(t, v))(model, padded, valid)))
  for row, prompt in enumerate(PROMPTS):
    seq = seqs[row]
    want = full[row, np.arange(len(prompt) - 1, len(seq) - 1), seq[len(prompt):]]
    np.testing.assert_allclose(logprobs[row, :counts[row]], want, atol=1e-4)


def test_extend_in_pieces_equals_one_chunk(model):
  graphdef, state = nnx.split(model)
  cache_a, logits_a = _prefill(model, PROMPTS)
  # Same prompts, first 3 tokens then the rest; row 2 (one token) is done after piece one.
  cache_b = KVCache.init(CFG, 4, 64)
  logits_b = jnp.zeros((4, VOCAB))
  for lo, hi in ((0, 3), (3, 16)):
    pieces = [p[lo:hi] for p in PROMPTS]
    tokens = np.zeros((4, 16), np.int32)
    for i, p in enumerate(pieces):
      tokens[i, :len(p)] = p
    cache_b, logits_b = sampler.extend(graphdef, state, cache_b, logits_b, tokens,
                                       np.asarray([len(p) for p in pieces], np.int32))
  np.testing.assert_array_equal(cache_a.lengths, cache_b.lengths)
  np.testing.assert_allclose(logits_a, logits_b, atol=1e-5)


def test_extend_gives_model_logits_at_last_token(model):
  """The sampler's extend is the model's cached forward, read at each row's last new token."""
  graphdef, state = nnx.split(model)
  tokens = np.asarray([[5, 17, 3, 9, 0, 0], [11, 2, 40, 41, 42, 43]], np.int32)
  num_new = np.asarray([4, 6], np.int32)
  ref_cache, cache = KVCache.init(CFG, 2, 32), KVCache.init(CFG, 2, 32)
  logits = jnp.zeros((2, VOCAB))
  for chunk, n in ((tokens, num_new), (tokens[:, 1:4], np.asarray([3, 1], np.int32))):
    ref_logits, ref_cache = model.extend(jnp.asarray(chunk), jnp.asarray(n), ref_cache)
    cache, logits = sampler.extend(graphdef, state, cache, logits, chunk, n)
    np.testing.assert_allclose(logits, np.asarray(ref_logits)[np.arange(2), n - 1], atol=1e-5)
  np.testing.assert_array_equal(cache.lengths, ref_cache.lengths)


@pytest.mark.parametrize("sharded", [False, True])
def test_shared_openings_are_prefilled_once_with_the_numbers_of_a_plain_prefill(
    model, sharded, monkeypatch):
  """Duplicate openings (a group's samples) are prefilled once, the prefix shared by all once;
  the rows end up holding what prefilling each of them gives."""
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(0)
  prefix = rng.integers(3, VOCAB, 40).tolist()
  a, b, c = (prefix + rng.integers(3, VOCAB, n).tolist() for n in (5, 9, 1))
  mesh = make_mesh([("data", -1), ("fsdp", 1), ("tensor", 1)],
                   devices=jax.devices()[:2]) if sharded else None
  batch = lambda: DecodeBatch(graphdef, state, 6, 1024, True, mesh, 8)
  fed = []
  real_extend = sampler.extend
  monkeypatch.setattr(sampler, "extend", lambda *args: fed.append(int(np.sum(args[5]))) or (
      real_extend(*args)))
  starts = np.asarray([0, 0, 0, 0, 0, 3])
  chunks = [a, a, b, c, a, [7, 8]]  # the last row is mid-episode: appended, not shared
  plain = batch()
  plain.cache = plain.cache.replace(lengths=jnp.asarray(starts, jnp.int32))
  plain._append(chunks, starts, 512, 0)
  assert sum(fed) == 3 * 45 + 49 + 41 + 2
  fed.clear()
  shared = batch()
  shared.cache = shared.cache.replace(lengths=jnp.asarray(starts, jnp.int32))
  shared.extend(chunks, starts, 512, 0)
  # Distinct openings a, b, c; their 40 shared tokens once, then each one's own tail.
  assert sum(fed) == 40 + 5 + 9 + 1 + 2
  np.testing.assert_array_equal(shared.cache.lengths, [45, 45, 49, 41, 45, 5])
  np.testing.assert_array_equal(shared.cache.lengths, plain.cache.lengths)
  np.testing.assert_allclose(shared.logits, plain.logits, atol=1e-5)
  for layer in range(CFG.num_layers):
    for row, n in enumerate(np.asarray(plain.cache.lengths)):
      np.testing.assert_allclose(shared.cache.k[layer][row, ..., 3:n],
                                 plain.cache.k[layer][row, ..., 3:n], atol=1e-5)
      np.testing.assert_allclose(shared.cache.v[layer][row, :, 3:n],
                                 plain.cache.v[layer][row, :, 3:n], atol=1e-5)


def test_chunk_and_cache_buckets():
  assert [bucket_length(n, 16) for n in (1, 16, 17, 25, 100, 129, 200, 512)] == [
      16, 16, 24, 32, 128, 192, 256, 512]
  # Powers of two from 256, capped at the limit.
  assert [sampler.cache_bucket(n, 1152) for n in (0, 256, 300, 513, 1024, 1100, 5000)] == [
      256, 256, 512, 1024, 1024, 1152, 1152]


def test_chunk_pieces():
  assert sampler.chunk_pieces(0) == []
  assert sampler.chunk_pieces(16) == [(16, 16)]
  assert sampler.chunk_pieces(17) == [(16, 16), (1, 16)]
  assert sampler.chunk_pieces(67) == [(64, 64), (3, 16)]
  assert sampler.chunk_pieces(190) == [(64, 64), (64, 64), (16, 16), (16, 16), (16, 16),
                                       (14, 16)]
  assert sampler.chunk_pieces(1500) == [(512, 512), (512, 512), (256, 256), (64, 64),
                                        (64, 64), (64, 64), (16, 16), (12, 16)]
  # No call takes more than max_piece tokens; the cap is a width of its own.
  assert sampler.chunk_pieces(700, max_piece=500) == [(500, 500), (64, 64), (64, 64), (64, 64),
                                                      (8, 16)]
  assert sampler.chunk_pieces(40, max_piece=20) == [(20, 20), (20, 20)]
  widths = set()
  for n in range(1, 1200):
    pieces = sampler.chunk_pieces(n)
    widths.update(w for _, w in pieces)
    assert sum(t for t, _ in pieces) == n
    assert all(t == w for t, w in pieces[:-1])  # only the last call pads
    assert pieces[-1][1] - pieces[-1][0] < 16
  assert widths == {16, 64, 256, 512}
  with pytest.raises(ValueError, match="max_piece must be >= 16"):
    sampler.chunk_pieces(10, max_piece=8)
