"""Asynchronous vs synchronous rollout: trained tokens per second of the same training run.

Workload: experiments/keypad/learn.py's run (a random 2-layer d64 model, GRPO, 8 tasks x 8
samples, 4-token replies, up to 3 turns) on the `scripted` environment, each of whose steps
waits `--env_latency` seconds (as a remote environment server's round trip does), for
`--steps` steps. Synchronous: `rollout.max_staleness=0` (sample, then update, in turn).
Asynchronous: `rollout.max_staleness=--staleness` with `algo.tis_cap=2`, the rollout on the
trainer's devices, or on `--rollout_devices` CPU devices of its own (the process then has one
more device per rollout device: `--xla_force_host_platform_device_count`).

Each run goes through the trainer's command line in a process of its own, after an untimed
warm-up run of the same config that fills a shared compilation cache. Timed: the main loop's
wall time of steps 2..N (`time/step`, which holds the update, the scoring and, asynchronously,
the wait for the rollout thread), so the start-up and step 1's compilations are out of it;
trained tokens: `update/trained_tokens` of the same steps (the runs train the same tasks; the
stale policy's episodes differ a little in length). Prints both runs and their
rollout/update times; the last line is `ratio: <async trained tokens/s / sync>`.

The ratio measures the machine as much as the code: run it on a quiet machine (the load
average is printed at the start and before the result, with a warning above one process per
CPU; benchmarks/README.md has the numbers).

    .venv/bin/python benchmarks/async_bench.py [--env_latency 0.05 --steps 8 --staleness 1
        --rollout_devices 0 --layers 2 --hidden 64 --reply_tokens 4]

The model's size and the reply length set how the step's time splits between decoding,
waiting for the environments and the update; the run prints each part. Overlap can only hide
the shorter of (rollout, update), and on a machine's shared cores only the rollout's waits:
with rollout D + E (decoding, environment waits) and update U, the ratio is at most
(D + E + U) / max(D + E, D + U).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import loadavg  # benchmarks/loadavg.py: a script's folder is on sys.path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "experiments/keypad/learn.py:algo=grpo"


def _run(workdir: str, cache: str, overrides: list[str], devices: int) -> list[dict]:
  """One training run through the command line; returns its metrics, one dict per step."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  result = subprocess.run(
      [sys.executable, "-m", "agentgym_jax.train", f"--config={CONFIG}", f"--workdir={workdir}",
       "--config.log.progress_bar=False", "--config.eval.every_steps=0",
       "--config.checkpoint.every_steps=0", "--config.checkpoint.export_hf=False", *overrides],
      cwd=REPO, env=env, capture_output=True, text=True, check=False)
  if result.returncode:
    raise SystemExit(f"The run in {workdir} failed:\n{result.stderr[-3000:]}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _summary(lines: list[dict]) -> dict[str, float]:
  """Trained tokens, seconds and the mean rollout/update times of steps 2..N."""
  timed = [m for m in lines if m["step"] >= 2]
  seconds = sum(m["time/step"] for m in timed)
  tokens = sum(m["update/trained_tokens"] for m in timed)
  mean = lambda key: sum(m.get(key, 0.0) for m in timed) / len(timed)
  return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
          "rollout_s": mean("time/rollout"), "update_s": mean("time/update"),
          "wait_s": mean("time/rollout_wait"), "success": mean("episodes/success_rate")}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--env_latency", type=float, default=0.05,
                      help="seconds every environment step waits")
  parser.add_argument("--steps", type=int, default=8, help="training steps of each run (>= 2)")
  parser.add_argument("--staleness", type=int, default=1, help="the async run's max_staleness")
  parser.add_argument("--rollout_devices", type=int, default=0,
                      help="CPU devices of the async rollout's own (0: the trainer's)")
  parser.add_argument("--layers", type=int, default=2, help="the model's blocks")
  parser.add_argument("--hidden", type=int, default=64, help="the model's width")
  parser.add_argument("--reply_tokens", type=int, default=4,
                      help="tokens decoded per turn (rollout.max_reply_tokens)")
  args = parser.parse_args()
  if args.steps < 2 or args.staleness < 1:
    raise SystemExit("--steps must be >= 2 (step 1 is not timed) and --staleness >= 1.")
  env = ["--config.env.name=scripted",
         f"--config.env.kwargs={{'step_latency_s': {args.env_latency}, 'max_steps': 3}}",
         f"--config.model.arch.num_layers={args.layers}",
         f"--config.model.arch.hidden_size={args.hidden}",
         f"--config.rollout.max_reply_tokens={args.reply_tokens}",
         # Room for 3 turns of replies (rows are as long as the longest episode).
         "--config.rollout.max_context=512", "--config.model.arch.max_position_embeddings=512"]
  asynchronous = [f"--config.rollout.max_staleness={args.staleness}",
                  "--config.algo.tis_cap=2.0",
                  f"--config.rollout.devices={args.rollout_devices}"]
  runs = {"sync": ([], 1), "async": (asynchronous, 1 + args.rollout_devices)}
  loadavg.report("start")
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    cache = os.path.join(tmp, "jax_cache")
    for name, (overrides, devices) in runs.items():
      _run(os.path.join(tmp, f"{name}_warmup"), cache,
           env + overrides + ["--config.total_steps=2"], devices)
      results[name] = _summary(_run(os.path.join(tmp, name), cache,
                                    env + overrides + [f"--config.total_steps={args.steps}"],
                                    devices))
      r = results[name]
      print(f"{name:5s}: {r['tokens']:.0f} trained tokens in {r['seconds']:.1f} s = "
            f"{r['tokens_per_s']:.1f} tokens/s; per step: rollout {r['rollout_s']:.2f} s, "
            f"update {r['update_s']:.2f} s, waited for the rollout {r['wait_s']:.2f} s; "
            f"training success {r['success']:.2f}", flush=True)
  loadavg.report("end")
  print(f"ratio: {results['async']['tokens_per_s'] / results['sync']['tokens_per_s']:.3f}")


if __name__ == "__main__":
  main()
