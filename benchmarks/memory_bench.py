"""The update's memory and speed against row length, for each attention kernel and layer loop.

For one row of a config's update (one task, one sample, one micro-batch, `rollout.max_context`
set to each length), compiles the trainer's own update (`plan.Run`, `update.make_update_step`)
for this machine's CPU and reads its temporaries from XLA's memory analysis; at the lengths of
--time_lengths it also runs the update on random weights and tokens and reports tokens/s and
the model FLOP/s as a fraction of a jitted f32 matmul's, measured in the same run (its MFU;
remat's recomputed forward is not counted as model FLOPs; the LM head is counted at every
position).

The row's loss mask is the main job's layout (`main_job_loss_mask`: a tenth of the row, the
agent's replies). --heads says where the update's LM head scores: `agent`, the trainer's
(those agent tokens, `update.scored_positions`), and/or `every`, every position of the row
(the update before it scored the agent tokens only, and what `python -m agentgym_jax.plan`
compiles).

  python benchmarks/memory_bench.py \
      [--config experiments/smollm2/babyai.py:stage=rl,init=none] \
      [--lengths 1024,2048,4096,8192] [--time_lengths 1024,2048] \
      [--choices blockwise/scan/remat,blockwise/unroll,xla/unroll] [--heads agent,every]
      [--repeats 2]

A choice is attention/layer_loop[/remat][/bf16] (bf16: `model.matmul_precision=bfloat16`).
The last line is `ratio: <last choice's temporaries / first choice's>` at the longest length,
the first head's:
with the defaults, how many times less memory the blockwise scan with remat needs than the XLA
form unrolled.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentgym_jax import plan as plan_lib
from agentgym_jax.models import Decoder
from agentgym_jax.train import state as state_lib
from agentgym_jax.train import update as update_lib
import loadavg  # benchmarks/loadavg.py: a script's folder is on sys.path
from flops import matmul_peak, train_flops_per_step  # benchmarks/flops.py
from run_memory_bench import load_config  # benchmarks/run_memory_bench.py
from update_bench import make_batch  # benchmarks/update_bench.py

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Choice:
  """An attention kernel, a layer loop, whether to remat and whether the matmuls take bf16
  operands (`model.matmul_precision`): attention/layer_loop[/remat][/bf16]."""

  attention: str
  layer_loop: str
  remat: bool
  bf16: bool = False

  @classmethod
  def parse(cls, text: str) -> "Choice":
    parts = text.split("/")
    flags = parts[2:]
    if len(parts) < 2 or flags not in ([], ["remat"], ["bf16"], ["remat", "bf16"]):
      raise SystemExit(f"--choices: {text!r} is not attention/layer_loop[/remat][/bf16]")
    return cls(parts[0], parts[1], "remat" in flags, "bf16" in flags)

  def __str__(self) -> str:
    return (f"{self.attention}/{self.layer_loop}" + ("/remat" if self.remat else "")
            + ("/bf16" if self.bf16 else ""))


def one_row_config(spec: str, choice: Choice, length: int):
  """The config's update cut to one row of `length` tokens, with `choice`'s model settings."""
  config = load_config(spec)
  with config.unlocked():
    config.data.batch_tasks = config.data.group_size = 1
    config.algo.minibatches = config.algo.microbatches = config.algo.epochs = 1
    config.algo.pack_rows = 1  # one row: nothing to pack with
    config.rollout.max_context = length
    config.model.attention, config.model.layer_loop = choice.attention, choice.layer_loop
    config.model.remat = choice.remat
    config.model.matmul_precision = "bfloat16" if choice.bf16 else "float32"
    if config.model.source == "random" and not config.model.arch.vocab_size:
      config.model.arch.vocab_size = 512
  return config


def main_job_loss_mask(length: int) -> np.ndarray:
  """[1, length] bool, the agent tokens of a row laid out as the main job's: turns of 480
  tokens (fewer in a short row), each an observation and then a reply of a tenth of it (48
  tokens), so about 10% of the row is trained, ~100 of ~1,000 tokens as in the main job."""
  turn = min(480, length // 2)
  return (np.arange(length) % turn >= turn - turn // 10)[None]


def temporaries(run: plan_lib.Run, positions: np.ndarray | None) -> int:
  """Bytes of temporaries of the run's update, compiled for this CPU, its LM head at
  `positions` ([1, P], `update.scored_positions`) or at every position (None)."""
  step = update_lib.make_update_step(run.policy_def, run.critic_def, run.optimizers,
                                     run.update_cfg, run.mesh, run.shardings)
  batch = run.batch()
  if positions is not None:
    batch["scored_positions"] = jax.ShapeDtypeStruct(positions.shape, jnp.int32,
                                                     sharding=batch["tokens"].sharding)
  return plan_lib._compile("update", lambda: step.lower(run.state, batch)).temporaries  # pylint: disable=protected-access


# Where the update's LM head scores a row of a length: [1, P] positions, or None (every one).
HEADS = {"agent": lambda length: update_lib.scored_positions(main_job_loss_mask(length)),
         "every": lambda length: None}


def seconds_per_update(run: plan_lib.Run, length: int, repeats: int,
                       positions: np.ndarray | None) -> float:
  """The fastest of `repeats` updates of one random row (after one to compile), on random
  weights of the run's model, its LM head at `positions` (as `temporaries`)."""
  policy = Decoder(run.cfg, rngs=nnx.Rngs(0))
  split = state_lib.split_models(policy, None, keep_reference=run.spec.keep_reference,
                                 optimizers=run.optimizers, mesh=run.mesh)
  state = state_lib.init_train_state(policy=split.policy, critic=None,
                                     keep_reference=run.spec.keep_reference,
                                     optimizers=run.optimizers, seed=0,
                                     shardings=split.shardings)
  host = make_batch(1, length, run.cfg.vocab_size)
  host["valid"][:] = True  # a full row: the length timed is the length computed
  mask = main_job_loss_mask(length)
  zeros = np.zeros((1, length), np.float32)
  batch = update_lib.build_batch(
      run.spec, tokens=host["tokens"], valid=host["valid"], loss_mask=mask,
      old_logprobs=zeros, advantages=mask.astype(np.float32), ref_logprobs=zeros,
      returns=zeros, values=zeros, rollout_logprobs=zeros,
      scored_positions=positions)
  step = update_lib.make_update_step(split.policy_def, None, run.optimizers, run.update_cfg,
                                     run.mesh, split.shardings)
  state, _ = jax.block_until_ready(step(state, batch))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    state, _ = jax.block_until_ready(step(state, batch))
    times.append(time.perf_counter() - start)
  return min(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="experiments/smollm2/babyai.py:stage=rl,init=none")
  parser.add_argument("--lengths", default="1024,2048,4096,8192")
  parser.add_argument("--time_lengths", default="1024,2048",
                      help="lengths at which the update is also run and timed")
  parser.add_argument("--choices", default="blockwise/scan/remat,blockwise/unroll,xla/unroll")
  parser.add_argument("--heads", default="agent",
                      help="where the LM head scores: agent (the trainer's), every (position)")
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  lengths = [int(n) for n in args.lengths.split(",")]
  timed = {int(n) for n in args.time_lengths.split(",") if n}
  choices = [Choice.parse(c) for c in args.choices.split(",")]
  heads = args.heads.split(",")
  if not set(heads) <= set(HEADS):
    raise SystemExit(f"--heads: {args.heads!r} names none of {sorted(HEADS)}")
  loadavg.report("start")
  peak = matmul_peak()() if timed else None
  if peak:
    print(f"f32 matmul peak (2048^3, jitted): {peak / 1e9:.1f} GFLOP/s", flush=True)
  print(f"config: {args.config}; one row per update on one CPU device")
  print("choice                      length  head   scored  temporaries  tokens/s   MFU",
        flush=True)
  found: dict[tuple[Choice, int, str], int] = {}
  for choice in choices:
    for length in lengths:
      run = plan_lib.Run.build(one_row_config(args.config, choice, length), jax.devices()[:1])
      for head in heads:
        positions = HEADS[head](length)
        found[choice, length, head] = temporaries(run, positions)
        speed = mfu = "-"
        if length in timed:
          seconds = seconds_per_update(run, length, args.repeats, positions)
          speed = f"{length / seconds:.0f}"
          mfu = f"{train_flops_per_step(run.cfg, 1, length) / seconds / peak:.0%}"
        scored = length - 1 if positions is None else positions.shape[1]
        print(f"{str(choice):26s}  {length:6d}  {head:5s}  {scored:6d}"
              f"  {found[choice, length, head] / GiB:8.2f} GiB  {speed:>8s}  {mfu:>4s}",
              flush=True)
  loadavg.report("end")
  longest = max(lengths)
  last, first = found[choices[-1], longest, heads[0]], found[choices[0], longest, heads[0]]
  print(f"ratio: {last / max(first, 1):.2f}")


if __name__ == "__main__":
  main()
