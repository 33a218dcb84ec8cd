"""What one row of the update costs to build, compiled and then loaded from the cache, for each
layer loop.

For each --loops choice, a fresh compilation cache and two processes: the first compiles the
trainer's update for one row of --length tokens (`memory_bench.seconds_per_update`: random
weights and tokens, the main job's loss mask) and times it; the second, the same program, which
it loads from the first's cache. Build seconds are each process's `caches.CompileCounter`
(JAX's events: the backend compile, and within it a cache hit's load), so they
include the few small programs that initialise the weights; with a real model the update's
are nearly all of them.

  python benchmarks/compile_bench.py [--config experiments/smollm2/babyai.py:stage=rl,init=none]
      [--length 2048] [--loops unroll,scan] [--repeats 3]

The last line is `ratio: <first loop's load seconds / last loop's>`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def child(config_spec: str, length: int, loop: str, repeats: int) -> dict:
  """In this process: the update of one `length`-token row with `loop` (the main job's
  blockwise attention and remat), its build seconds (compile, and the part that was a cache
  hit's load) and its fastest step."""
  import jax  # pylint: disable=import-outside-toplevel
  from agentgym_jax import caches  # pylint: disable=import-outside-toplevel
  from agentgym_jax import plan as plan_lib  # pylint: disable=import-outside-toplevel
  import memory_bench  # pylint: disable=import-outside-toplevel
  caches.use_compilation_cache(os.environ["COMPILE_BENCH_CACHE"])
  counter = caches.CompileCounter()
  config = memory_bench.one_row_config(config_spec, memory_bench.Choice("auto", loop, True),
                                       length)
  run = plan_lib.Run.build(config, jax.devices()[:1])
  step = memory_bench.seconds_per_update(run, length, repeats, memory_bench.HEADS["agent"](length))
  built = counter.take()
  return {"build": built["compile/seconds"], "load": built["compile/load_seconds"],
          "tokens_per_s": length / step}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="experiments/smollm2/babyai.py:stage=rl,init=none")
  parser.add_argument("--length", type=int, default=2048)
  parser.add_argument("--loops", default="unroll,scan")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--child", default="", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child(args.config, args.length, args.child, args.repeats)), flush=True)
    return
  import loadavg  # pylint: disable=import-outside-toplevel  (benchmarks/loadavg.py)
  loadavg.report("start")
  print(f"config: {args.config}; one {args.length}-token row of the update on one CPU device")
  print("loop     compile s  hit's load s  tokens/s (compiled, loaded)", flush=True)
  loads = []
  for loop in args.loops.split(","):
    with tempfile.TemporaryDirectory() as cache:
      found = []
      for _ in ("compile", "load"):
        out = subprocess.run(
            [sys.executable, __file__, f"--config={args.config}", f"--length={args.length}",
             f"--repeats={args.repeats}", f"--child={loop}"],
            env={**os.environ, "COMPILE_BENCH_CACHE": cache}, capture_output=True, text=True,
            check=False)
        if out.returncode:
          raise SystemExit(f"{loop}: the child process failed:\n{out.stderr[-3000:]}")
        found.append(json.loads(out.stdout.strip().splitlines()[-1]))
    compiled, loaded = found
    loads.append(loaded["load"])
    print(f"{loop:7s}  {compiled['build'] - compiled['load']:9.1f}  {loaded['load']:12.1f}  "
          f"{compiled['tokens_per_s']:8.0f} {loaded['tokens_per_s']:8.0f}", flush=True)
  loadavg.report("end")
  print(f"ratio: {loads[0] / max(loads[-1], 1e-9):.2f}")


if __name__ == "__main__":
  main()
