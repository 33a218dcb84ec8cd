"""One agent turn without re-encoding: prefill, then per-token decode, ours vs `generate`.

Workload: B rows of a P-token prompt (random ids), then N sampled tokens each at temperature 1
(no end-of-turn token stops a row early). This is a rollout's first turn, where the KV cache
kept across turns gives no advantage (rollout_bench.py measures the turns after it).

* ours: the rollout's own calls on one device (`rollout.batch.DecodeBatch`): the prefill
  appends the prompt in `sampler.chunk_pieces` of at most 512 tokens, the cache grown to the
  bucket each piece reaches, then `sampler.decode` samples N tokens in one jitted while loop.
* reference: `LlamaForCausalLM.generate` with the same weights and a KV cache, with 1 or 2
  torch threads, whichever runs the turn faster now. One call per turn; a logits processor
  notes when the prefill's logits arrive, which splits the call into prefill and decode (two
  calls subtracted from each other gave negative decode times on small workloads).

Best of `--repeats` after a warm-up, alternating between the two. Prints prefill tokens/s,
decode ms per step and whole-turn ms of each; the last line is
`ratio: <reference decode ms per step / ours>`.

    .venv/bin/python benchmarks/decode_bench.py [--model 4m --rows 32 --prompt 192 --new 32]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
import torch
import transformers
from flax import nnx

from agentgym_jax.rollout import sampler
from agentgym_jax.rollout.batch import DecodeBatch
import loadavg  # benchmarks/loadavg.py: a script's folder is on sys.path
# benchmarks/bench_models.py
from bench_models import NAMES, build_model, pick_torch_threads, torch_copy


def ours_turn(graphdef, state, ids: np.ndarray, new: int) -> tuple[float, float]:
  """Seconds of our prefill and of our N-token decode of rows `ids` [B, P]."""
  rows, prompt = ids.shape
  batch = DecodeBatch(graphdef, state, rows, limit=1 << 30, grow=True, mesh=None,
                      max_reply_tokens=new)
  batch.assign(np.arange(rows), jax.random.split(jax.random.key(0), rows))
  batch.start(np.ones(rows, bool), np.zeros(rows, np.int32))
  chunks = ids.tolist()
  jax.block_until_ready((batch.cache, batch.turn))
  start = time.perf_counter()
  batch.extend(chunks, np.zeros(rows, np.int64), max_chunk=512, pad_id=0)
  batch.logits.block_until_ready()
  prefilled = time.perf_counter()
  # No end-of-turn id can be sampled (-1): every row decodes all N tokens.
  batch.decode(prompt + new, (-1,), sampler.SamplingConfig(max_reply_tokens=new))
  batch.turn.counts.block_until_ready()
  assert int(batch.turn.counts.min()) == new
  return prefilled - start, time.perf_counter() - prefilled


class _FirstLogits(transformers.LogitsProcessor):
  """Notes when `generate` first hands out logits: the prefill's, before any decode step."""

  def __init__(self):
    self.at = None

  def __call__(self, input_ids, scores):
    if self.at is None:
      self.at = time.perf_counter()
    return scores


def reference_turn(hf_model, ids: torch.Tensor, new: int) -> tuple[float, float]:
  """Seconds of `generate`'s prefill and of its decode, sampling `new` tokens after rows
  `ids` [B, P]."""
  clock = _FirstLogits()
  start = time.perf_counter()
  with torch.inference_mode():
    hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                      temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new,
                      min_new_tokens=new, pad_token_id=0,
                      logits_processor=transformers.LogitsProcessorList([clock]))
  end = time.perf_counter()
  return clock.at - start, end - clock.at


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", choices=NAMES, default="4m")
  parser.add_argument("--rows", type=int, default=32)
  parser.add_argument("--prompt", type=int, default=192, help="prompt tokens per row (P)")
  parser.add_argument("--new", type=int, default=32, help="sampled tokens per row (N)")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  if args.new < 2:
    parser.error(f"--new {args.new}: at least 2 sampled tokens, so that there is a decode step.")
  loadavg.report("start")

  tok, model = build_model(args.model)
  cfg = model.cfg
  graphdef, state = nnx.split(model)
  hf_model = torch_copy(model)
  ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (args.rows, args.prompt))
  torch_ids = torch.from_numpy(ids)

  ours_turn(graphdef, state, ids, args.new)  # compiles
  reference_turn(hf_model, torch_ids, args.new)  # warm-up
  threads = pick_torch_threads(hf_model, cfg.vocab_size, args.rows, args.new)

  ours_runs, ref_runs = [], []
  for _ in range(args.repeats):
    ours_runs.append(ours_turn(graphdef, state, ids, args.new))
    ref_runs.append(reference_turn(hf_model, torch_ids, args.new))
  # Best prefill and best decode of the repeats, each side alike.
  ours, ref = (tuple(map(min, zip(*runs))) for runs in (ours_runs, ref_runs))
  steps = args.new - 1  # both sample the first token from the prefill's logits
  print(f"workload: {args.model} model, {args.rows} rows x {args.prompt} prompt tokens, then "
        f"{args.new} sampled tokens; best of {args.repeats}; reference: torch with {threads} "
        f"thread(s)")
  tokens = args.rows * args.prompt
  for name, (prefill, decode) in (("ours", ours), ("reference", ref)):
    print(f"{name}: prefill {prefill * 1e3:.0f} ms ({tokens / prefill:.0f} tokens/s), decode "
          f"{decode / steps * 1e3:.2f} ms per step, turn {(prefill + decode) * 1e3:.0f} ms")
  print(f"whole turn, reference / ours: {sum(ref) / sum(ours):.2f}; prefill: "
        f"{ref[0] / ours[0]:.2f}")
  loadavg.report("end")
  print(f"ratio: {ref[1] / ours[1]:.2f}")


if __name__ == "__main__":
  main()
