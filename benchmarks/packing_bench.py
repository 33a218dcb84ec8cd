"""The main job's RL update and reference scoring on packed rows against the rows themselves.

One step's batch of the SmolLM2 BabyAI recipe (`experiments/smollm2/babyai.py:stage=rl`,
random weights): 2 groups of 4 episodes, each group's episodes sharing a 490-token opening and
then going on for --continuations tokens each (BabyAI's: one to five turns of ~100 tokens of
observation and ~25 of reply after the opening), rows padded to the longest episode's bucket.
Each layout is compiled (seconds and XLA's temporaries) and run --repeats times after one
warm-up, and the fastest run is kept.

  python benchmarks/packing_bench.py [--repeats 2] [--continuations 120,380,640,900] \
      [--opening 490] [--config experiments/smollm2/babyai.py:stage=rl,init=none]

Layouts: `rows`, one row per episode in 8 micro-batches (algo.pack_rows=1, the recipe before
packing); `group`, a group per packed row in 2 micro-batches (algo.pack_rows=4); `batch`, the
whole batch in one packed row, each group with its opening (algo.pack_rows=8). The last line
is `ratio: <rows' update seconds / batch's>`.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from agentgym_jax import plan as plan_lib
from agentgym_jax import sharding
from agentgym_jax.models import Decoder
from agentgym_jax.rollout.trajectory import bucket_length
from agentgym_jax.train import packing
from agentgym_jax.train import state as state_lib
from agentgym_jax.train import update as update_lib
import loadavg  # benchmarks/loadavg.py: a script's folder is on sys.path
from run_memory_bench import load_config  # benchmarks/run_memory_bench.py

GROUPS, GROUP_SIZE = 2, 4


def episodes(opening: int, continuations: list[int], vocab: int, seed: int = 0
             ) -> dict[str, np.ndarray]:
  """GROUPS x GROUP_SIZE right-padded rows: a group's shared opening, then each row's own
  turns (observation, then a reply of a fifth of the turn, the agent's tokens)."""
  rng = np.random.default_rng(seed)
  lengths = [opening + n for n in continuations]
  length = bucket_length(max(lengths))
  rows = GROUPS * GROUP_SIZE
  tokens = rng.integers(0, vocab, (rows, length)).astype(np.int32)
  valid = np.zeros((rows, length), bool)
  mask = np.zeros((rows, length), bool)
  for r in range(rows):
    first = r - r % GROUP_SIZE
    tokens[r, :opening] = tokens[first, :opening]
    n = lengths[r % GROUP_SIZE]
    valid[r, :n] = True
    mask[r, opening:n] = np.arange(n - opening) % 125 >= 100
  return {"tokens": tokens, "valid": valid, "loss_mask": mask}


def timed(fn, repeats: int) -> float:
  """The fastest of `repeats` calls of fn() after one warm-up, in seconds."""
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best


def layout_config(spec: str, pack: int, length: int):
  """The config's RL update for one step of GROUPS x GROUP_SIZE rows of `length`, a packed
  row (pack > 1) or a row per micro-batch."""
  config = load_config(spec)
  with config.unlocked():
    config.mode = "rl"
    config.data.batch_tasks, config.data.group_size = GROUPS, GROUP_SIZE
    config.algo.epochs = config.algo.minibatches = 1
    config.rollout.max_context = length
    config.algo.pack_rows = pack
    config.algo.microbatches = GROUPS * GROUP_SIZE // pack
  return config


def run_layout(spec: str, pack: int, host: dict[str, np.ndarray], repeats: int
               ) -> dict[str, float]:
  """Compile seconds, temporaries (GiB) and fastest seconds of the update and the reference
  scorer of config `spec` with algo.pack_rows = pack."""
  run = plan_lib.Run.build(layout_config(spec, pack, host["tokens"].shape[1]),
                           jax.devices()[:1])
  split = state_lib.split_models(Decoder(run.cfg, rngs=nnx.Rngs(0)), None,
                                 keep_reference=run.spec.keep_reference,
                                 optimizers=run.optimizers, mesh=run.mesh)
  state = state_lib.init_train_state(policy=split.policy, critic=None,
                                     keep_reference=run.spec.keep_reference,
                                     optimizers=run.optimizers, seed=0, shardings=split.shardings)
  put = lambda x: sharding.shard_batch(np.asarray(x), run.mesh)
  packed = (None if pack == 1 else update_lib.packed_fields(
      packing.pack_rows(host["tokens"], host["valid"], pack, GROUP_SIZE, pad_id=0), put))
  mask = host["loss_mask"]
  zeros = np.zeros(mask.shape, np.float32)
  positions = update_lib.scored_positions(mask)
  batch = update_lib.build_batch(
      run.spec, tokens=put(host["tokens"]), valid=put(host["valid"]), loss_mask=put(mask),
      advantages=put(mask * 0.5), ref_logprobs=put(zeros), rollout_logprobs=put(zeros),
      scored_positions=None if positions is None else put(positions), packed=packed)
  forward = update_lib.forward_inputs(batch)
  step = update_lib.make_update_step(split.policy_def, None, run.optimizers, run.update_cfg,
                                     run.mesh, split.shardings)
  score, _ = update_lib.make_scorers(split.policy_def, None, run.update_cfg, run.mesh)
  out = {}
  for name, program, args in (("update", step, (state, batch)),
                              ("score", score, (state.policy, forward))):
    start = time.perf_counter()
    compiled = program.lower(*args).compile()
    out[f"{name} compile s"] = time.perf_counter() - start
    out[f"{name} temporaries GiB"] = compiled.memory_analysis().temp_size_in_bytes / (1 << 30)
  # The update donates its state: each call takes the state the last one returned.
  holder = [state]

  def one_update():
    holder[0], metrics = step(holder[0], batch)
    return metrics
  out["update s"] = timed(one_update, repeats)
  out["score s"] = timed(lambda: score(holder[0].policy, forward), repeats)
  out["model tokens"] = float(host["valid"].sum() if pack == 1 else
                              np.asarray(packed["packed"]["valid"]).sum())
  out["row tokens"] = float(np.prod(host["tokens"].shape) if pack == 1 else
                            np.prod(np.asarray(packed["packed"]["tokens"]).shape))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="experiments/smollm2/babyai.py:stage=rl,init=none")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--opening", type=int, default=490, help="tokens a group shares")
  parser.add_argument("--continuations", default="120,380,640,900",
                      help=f"tokens after the opening of each of a group's {GROUP_SIZE} rows")
  args = parser.parse_args()
  continuations = [int(n) for n in args.continuations.split(",")]
  if len(continuations) != GROUP_SIZE:
    raise SystemExit(f"--continuations: give {GROUP_SIZE} lengths, got {continuations}")
  loadavg.report("start")
  length = bucket_length(args.opening + max(continuations))
  vocab = plan_lib.Run.build(layout_config(args.config, 1, length),
                             jax.devices()[:1]).cfg.vocab_size
  host = episodes(args.opening, continuations, vocab)
  print(f"config: {args.config}; {GROUPS} groups x {GROUP_SIZE} rows, opening {args.opening}, "
        f"continuations {continuations}, rows of {host['tokens'].shape[1]}", flush=True)
  found = {}
  for name, pack in (("rows", 1), ("group", GROUP_SIZE), ("batch", GROUPS * GROUP_SIZE)):
    found[name] = run_layout(args.config, pack, host, args.repeats)
    print(f"{name:7s} " + "  ".join(f"{k} {v:.2f}" for k, v in found[name].items()),
          flush=True)
  loadavg.report("end")
  print(f"ratio: {found['rows']['update s'] / found['batch']['update s']:.2f}")


if __name__ == "__main__":
  main()
