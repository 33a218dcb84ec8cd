"""Host memory an XLA program of the model holds while JAX keeps it: blocks unrolled or scanned.

On XLA:CPU each executable of a model holds host memory of its own (its kernels and what the
runtime keeps with them, not its arguments or temporaries), and a rollout builds one per chunk
width and cache length (agentgym_jax/freed_memory.py). This measures that memory for the
model's forward (`Backbone.__call__`, no remat) over --rows rows at each width of --widths,
with the blocks as a Python loop ("unroll", what XLA:CPU programs use today) and as a
`lax.scan` ("scan"): each program is compiled ahead of time and kept, JAX's own caches are
dropped (`freed_memory.release_programs`), and the growth of the process's resident memory is
the program's. Also what building it took (persistent cache off): tracing, lowering to
StableHLO, and XLA's compile; the first two are what a program dropped and reloaded from the
persistent cache pays again besides the load.

  python benchmarks/program_memory.py [--model smollm2 --rows 8 --widths 32,64,128,256]

The last line is `ratio: <MiB a program unrolled / scanned>` (means over the widths).
Resident memory moves by a few MiB on its own (malloc), so single small values are noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

from agentgym_jax import freed_memory
import loadavg  # benchmarks/loadavg.py: a script's folder is on sys.path
from bench_models import NAMES, build_model  # benchmarks/bench_models.py

LOOPS = ("unroll", "scan")


def with_layer_loop(model, loop: str) -> None:
  """Sets `layer_loop` (and no remat) on every module's config, in place."""
  for _, module in nnx.iter_modules(model):
    if hasattr(module, "cfg"):
      module.cfg = dataclasses.replace(module.cfg, layer_loop=loop, remat=False)


def program_mib(model, widths: list[int], rows: int) -> list[tuple[float, float, float, float]]:
  """(MiB held, trace, lower and compile seconds) of the forward program at each width, built
  in turn and kept."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(state, tokens):
    return nnx.merge(graphdef, state).backbone(tokens, jnp.ones(tokens.shape, bool)).sum()

  kept, out = [], []
  for width in widths:
    tokens = jnp.ones((rows, width), jnp.int32)
    freed_memory.release_programs()
    before = freed_memory.resident_bytes()
    times = [time.perf_counter()]
    traced = forward.trace(state, tokens)
    times.append(time.perf_counter())
    lowered = traced.lower()
    times.append(time.perf_counter())
    program = lowered.compile()
    times.append(time.perf_counter())
    del traced, lowered
    jax.block_until_ready(program(state, tokens))
    kept.append(program)  # the executable stays; what JAX cached beside it goes
    freed_memory.release_programs()
    out.append(((freed_memory.resident_bytes() - before) / 2**20,
                *(b - a for a, b in zip(times, times[1:]))))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="smollm2", choices=NAMES)
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--widths", default="32,64,128,256")
  args = parser.parse_args()
  widths = [int(w) for w in args.widths.split(",")]
  freed_memory.return_freed_memory()
  jax.config.update("jax_enable_compilation_cache", False)
  if freed_memory.resident_bytes() is None:
    raise SystemExit("No /proc/self/status here: resident memory cannot be read.")
  loadavg.report("start")
  means = {}
  for loop in LOOPS:
    _, model = build_model(args.model)
    with_layer_loop(model, loop)
    held = program_mib(model, widths, args.rows)
    means[loop] = sum(mib for mib, *_ in held) / len(held)
    for width, (mib, trace, lower, compile_) in zip(widths, held):
      print(f"{loop:6s} width {width}: {mib:5.1f} MiB, traced in {trace:.2f} s, lowered in "
            f"{lower:.2f} s, compiled in {compile_:.1f} s")
  loadavg.report("end")
  print(f"ratio: {means['unroll'] / max(means['scan'], 0.1):.2f}")


if __name__ == "__main__":
  main()
