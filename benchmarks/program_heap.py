"""What the host memory a kept XLA:CPU program holds is made of, compiled and loaded.

`benchmarks/program_memory.py` measures how much resident memory each kept executable of the
model adds (tens of MiB for SmolLM2-135M, blocks unrolled); this says what that memory is. It
builds the model's forward (8 rows, no remat, as program_memory.py) at one width with a fresh
persistent compilation cache, twice: compiled, then dropped (`freed_memory.release_programs`)
and loaded from the cache, the way a run under `compile.max_resident_gib` gets it back. Each
build and first call runs under memray's native tracker (PyPI `memray`, the `profile` extra),
and the allocations still live afterwards are summed by the part of XLA or JAX that made them
(`PARTS`, matched against their native stacks): what keeping the program costs, part by part.

  pip install -e ".[profile]"
  python benchmarks/program_heap.py [--model smollm2 --width 64]

The last line is `ratio: <MiB loaded / MiB compiled>`. Allocations freed after the tracker
stops (the call's temporaries, released as its buffers' last users finish) count as held:
the `device buffers` row is that, not program memory.
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx

from agentgym_jax import caches, freed_memory
import loadavg  # benchmarks/loadavg.py: a script's folder is on sys.path
from bench_models import NAMES, build_model  # benchmarks/bench_models.py

# (row, native frame substrings). An allocation goes to the row of the innermost frame of its
# stack that one of them matches (rows tried in order for each frame).
PARTS = (
    ("device buffers", ("CpuDeviceMemory",)),
    ("HLO module as a proto (kept for memory stats)", ("::ToProto",)),
    ("buffer assignment", ("BufferAssignment::", "HloDataflowAnalysis::", "HloAliasAnalysis::")),
    ("HLO module", ("HloModule::", "HloComputation::", "HloInstruction::")),
    ("thunks", ("Thunk",)),
    ("machine code (LLVM)", ("llvm::",)),
    ("JAX (Python, MLIR)", ("_PyEval", "mlir::")),
)
OTHER = "other"


def part_of(frames: list[str]) -> str:
  """The `PARTS` row of an allocation made under `frames` (innermost first), or OTHER."""
  for frame in frames:
    for name, keys in PARTS:
      if any(key in frame for key in keys):
        return name
  return OTHER


def held_by_part(path: str) -> dict[str, int]:
  """Bytes of the allocations still live at the end of memray capture `path`, by `PARTS`."""
  import memray  # pylint: disable=import-outside-toplevel
  held = collections.Counter()
  for record in memray.FileReader(path).get_leaked_allocation_records(merge_threads=True):
    held[part_of([frame[0] for frame in record.hybrid_stack_trace(max_stacks=64)])] += (
        record.size)
  return dict(held)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="smollm2", choices=NAMES)
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--width", type=int, default=64)
  args = parser.parse_args()
  try:
    import memray  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise SystemExit("program_heap.py needs memray: pip install -e \".[profile]\"") from error
  freed_memory.return_freed_memory()
  work = tempfile.mkdtemp(prefix="program_heap_")
  caches.use_compilation_cache(os.path.join(work, "cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  loadavg.report("start")
  _, model = build_model(args.model)
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(state, tokens):
    return nnx.merge(graphdef, state).backbone(tokens, jnp.ones(tokens.shape, bool)).sum()

  # A first program at another width, so that what the process builds once (thread pools,
  # the tracker's own first allocations) is not charged to the measured one.
  jax.block_until_ready(forward(state, jnp.ones((args.rows, args.width + 16), jnp.int32)))
  tokens = jnp.ones((args.rows, args.width), jnp.int32)
  totals = {}
  for how in ("compiled", "loaded"):
    freed_memory.release_programs()
    path = os.path.join(work, f"{how}.bin")
    with memray.Tracker(path, native_traces=True):
      jax.block_until_ready(forward(state, tokens))
    held = held_by_part(path)
    totals[how] = sum(v for k, v in held.items() if k != "device buffers")
    print(f"{how}: {totals[how] / 2**20:.1f} MiB held besides device buffers")
    for name in [*(name for name, _ in PARTS), OTHER]:
      print(f"  {name:48s} {held.get(name, 0) / 2**20:7.2f} MiB")
  loadavg.report("end")
  print(f"ratio: {totals['loaded'] / max(totals['compiled'], 1):.2f}")


if __name__ == "__main__":
  main()
