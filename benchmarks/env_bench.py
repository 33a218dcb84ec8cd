r"""Environment stepping throughput: `EnvPool` with 1, 2 and 4 workers against an in-process loop.

    .venv/bin/python benchmarks/env_bench.py [--envs babyai,textcraft,sciworld] [--num-envs 64]

For each environment, `--num-envs` instances (test-split tasks) step through the same fixed
list of valid actions, round after round: in one process (a plain loop over the instances,
parsing each response as the pool's workers do), then in pools of 1, 2 and 4 workers (one
batched `step` call per round). After warm-up rounds (JIT of SciWorld's JVMs), the timed rounds
give steps per second. Then the median latency of one `/step` over loopback HTTP
(`RemoteEnv` against `environments.server`) beside the in-process step time.

Reference: the in-process loop. Goals: for BabyAI and TextCraft a pool within 2x of it
(pool/in-process >= 0.5), for SciWorld 2 workers >= 1.6x of it. SciWorld is measured with 1
and with 4 threads per worker (its steps wait on the JVMs, outside the GIL). The last line is
`ratio: <SciWorld, 2 workers x 4 threads / in-process>`.

SciWorld starts one JVM per instance; unless JAVA_TOOL_OPTIONS is set, this script gives them
a small heap and C1-only JIT (~95 MiB each instead of ~500 MiB), in both contestants alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import environments  # noqa: E402
from environments.server import running_server  # noqa: E402
from environments.workers import EnvPool  # noqa: E402

# Valid, non-solving actions; slot s in round r takes ACTIONS[(r + s) % len].
ACTIONS = {
    "babyai": ["turn left", "move forward", "turn right", "move forward",
               "check available actions"],
    "textcraft": ["inventory", "get 1 oak log", "craft 4 oak planks using 1 oak log",
                  "get 2 stick", "inventory"],
    "sciworld": ["look around", "inventory", "open door to kitchen", "go to kitchen",
                 "look at table", "go to hallway"],
}
ROUNDS = {"babyai": 20, "textcraft": 100, "sciworld": 6}
# Threads per worker tried besides 1: SciWorld's steps wait on its JVMs, outside the GIL.
THREADS = {"sciworld": 4}
WARMUP = {"babyai": 2, "textcraft": 5, "sciworld": 6}
LEAN_JVM = "-XX:+UseSerialGC -Xms16m -Xmx512m -XX:TieredStopAtLevel=1 -Xss512k"


def _responses(name: str, round_index: int, count: int) -> list[str]:
  cls = environments.env_class(name)
  actions = ACTIONS[name]
  return [cls.format_action(actions[(round_index + slot) % len(actions)])
          for slot in range(count)]


def in_process(name: str, task_ids: list[int], rounds: int, warmup: int) -> float:
  """Steps per second of a plain loop over the instances in this process."""
  envs = [environments.make(name) for _ in task_ids]
  try:
    for env, task_id in zip(envs, task_ids):
      env.reset(options={"task_id": task_id})
    for round_index in range(warmup + rounds):
      if round_index == warmup:
        start = time.perf_counter()
      for env, response in zip(envs, _responses(name, round_index, len(envs))):
        env.step(env.parse_action(response))
    return len(envs) * rounds / (time.perf_counter() - start)
  finally:
    for env in envs:
      env.close()


def pooled(name: str, task_ids: list[int], workers: int, rounds: int, warmup: int,
           threads: int) -> float:
  """Steps per second of one batched `EnvPool.step` per round."""
  slots = list(range(len(task_ids)))
  with EnvPool(name, num_workers=workers, timeout_s=1800.0,
               threads_per_worker=threads) as pool:
    assert not any(o.failed for o in pool.reset(task_ids))
    for round_index in range(warmup + rounds):
      if round_index == warmup:
        start = time.perf_counter()
      outcomes = pool.step(slots, _responses(name, round_index, len(slots)))
      assert not any(o.failed for o in outcomes), [o.info for o in outcomes if o.failed][:1]
    return len(slots) * rounds / (time.perf_counter() - start)


def loopback_latency(name: str, steps: int = 300) -> tuple[float, float]:
  """Median seconds of one step over loopback HTTP, and of the same step in process."""
  task_id = environments.task_splits(name)["test"][0]
  responses = [r for i in range(steps) for r in _responses(name, i, 1)]
  timings = {}
  with running_server(name) as url:
    for kind in ("remote", "local"):
      env = environments.make("remote", url=url, env_name=name) if kind == "remote" else \
          environments.make(name)
      env.reset(options={"task_id": task_id})
      latencies = []
      for response in responses:
        action = env.parse_action(response)
        start = time.perf_counter()
        _, _, terminated, truncated, _ = env.step(action)
        latencies.append(time.perf_counter() - start)
        if terminated or truncated:
          env.reset(options={"task_id": task_id})
      env.close()
      timings[kind] = statistics.median(latencies)
  return timings["remote"], timings["local"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--envs", default="babyai,textcraft,sciworld")
  parser.add_argument("--num-envs", type=int, default=64)
  parser.add_argument("--workers", default="1,2,4")
  args = parser.parse_args()
  os.environ.setdefault("JAVA_TOOL_OPTIONS", LEAN_JVM)
  worker_counts = [int(w) for w in args.workers.split(",")]
  print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
  header = f"{'env':<10} {'envs':>4} {'in-process':>11}" + "".join(
      f" {f'{w} worker' + ('s' if w > 1 else ''):>17}" for w in worker_counts)
  print(header + "   (steps/s; pool / in-process)")
  ratios: dict[tuple[str, int, int], float] = {}
  for name in args.envs.split(","):
    test_ids = environments.task_splits(name)["test"]
    task_ids = [test_ids[i % len(test_ids)] for i in range(args.num_envs)]
    reference = in_process(name, task_ids, ROUNDS[name], WARMUP[name])
    for threads in (1, THREADS.get(name, 1)) if name in THREADS else (1,):
      label = name if threads == 1 else f"  {threads} thr/w"
      row = f"{label:<10} {len(task_ids):>4} {reference:>11.1f}"
      for workers in worker_counts:
        rate = pooled(name, task_ids, workers, ROUNDS[name], WARMUP[name], threads)
        ratios[name, workers, threads] = rate / reference
        row += f" {rate:>9.1f} ({rate / reference:4.2f}x)"
      print(row, flush=True)
  for name in ("babyai", "textcraft"):
    if name in args.envs.split(","):
      remote, local = loopback_latency(name)
      print(f"{name}: median step latency over loopback HTTP {1000 * remote:.2f} ms "
            f"(in process {1000 * local:.3f} ms)")
  print(f"load average at end: {os.getloadavg()[0]:.2f}")
  if ("sciworld", 2, 1) in ratios:
    print(f"sciworld, 2 workers x 1 thread / in-process: {ratios['sciworld', 2, 1]:.2f}")
  # The pool as configured for SciWorld: 2 workers, THREADS["sciworld"] threads each.
  print(f"ratio: {ratios.get(('sciworld', 2, THREADS['sciworld']), float('nan')):.2f}")


if __name__ == "__main__":
  main()
