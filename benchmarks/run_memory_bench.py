"""Peak memory of a runlocal training run: process RSS and JAX's live device buffers.

Runs the trainer in-process on a config's runlocal variant and reports
  - peak resident set size of the process (resource.getrusage, includes Python, XLA, the
    compiled executables and the env-pool parent; the env workers are separate processes);
  - bytes of live JAX arrays right after each update (train state + rollout batch + scores),
    the largest value seen, and the train state's own share;
  - live JAX bytes after `train` returns (should be ~0: nothing leaks out of a run).

  python benchmarks/run_memory_bench.py [--config experiments/keypad/learn.py:runlocal]

There is no reference implementation to compare with, so the last line is the peak RSS in MiB
instead of a ratio.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import resource
import sys
import tempfile

import jax

from agentgym_jax import freed_memory
from agentgym_jax.train import loop
import loadavg  # benchmarks/loadavg.py: a script's folder is on sys.path


def load_config(spec: str):
  """`path.py[:arg]` -> the file's get_config(arg).

  Experiment files import their study's shared module as `experiments.<study>.<module>`, as
  under `python -m agentgym_jax.train` from the repository root, so the root goes on the path.
  """
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if root not in sys.path:
    sys.path.insert(0, root)
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("experiment_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg or None)


def live_bytes() -> int:
  return sum(x.nbytes for x in jax.live_arrays())


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="experiments/keypad/learn.py:runlocal")
  args = parser.parse_args()
  loadavg.report("start")
  config = load_config(args.config)

  after_update: list[int] = []
  state_bytes: list[int] = []
  kept_call = freed_memory.KeptPrograms.__call__

  # The trainer runs its update through a KeptPrograms (which compiles the jitted step ahead
  # of time); measuring at that call sees every update whatever the step function is.
  def measured(kept, *step_args):
    out = kept_call(kept, *step_args)
    if kept.phase == "update":
      jax.block_until_ready(out)
      after_update.append(live_bytes())
      state_bytes.append(sum(x.nbytes for x in jax.tree.leaves(out[0])))
    return out

  freed_memory.KeptPrograms.__call__ = measured
  with tempfile.TemporaryDirectory() as workdir:
    loop.train(config, workdir)
  gc.collect()  # the run's objects hold reference cycles; collect them before counting
  rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(f"config: {args.config} ({config.total_steps} steps, "
        f"{config.data.batch_tasks * config.data.group_size} rows/step, "
        f"max_context {config.rollout.max_context})")
  print(f"live JAX arrays after each update: {[round(b / 2**20, 2) for b in after_update]} MiB "
        f"(peak {max(after_update) / 2**20:.2f} MiB; train state {max(state_bytes) / 2**20:.2f} "
        "MiB)")
  print(f"live JAX arrays after train() returned: {live_bytes() / 2**20:.2f} MiB")
  loadavg.report("end")
  print(f"peak RSS: {rss_mib:.0f} MiB")


if __name__ == "__main__":
  main()
