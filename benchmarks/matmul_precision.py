"""The three matmuls of a projection, float32 against bf16 operands summed in float32.

For each projection of SmolLM2-135M on a packed row of N tokens (x [N, In] @ W [In, Out]):
the forward (x @ W), the backward's input gradient (g @ W^T) and its kernel gradient
(x^T @ g), each jitted alone, timed in float32 and with both operands cast to bf16 inside the
program and the products summed in float32 (`model.matmul_precision = "bfloat16"`,
`models/decoder.py:dot`). GFLOP/s of each, best of --repeats; the last line is
`ratio: <the forward matmuls' float32 seconds / their bf16 seconds>`, over all projections.

  python benchmarks/matmul_precision.py [--tokens 6144] [--repeats 10]

On a CPU without a fast bf16 matmul (no AMX) expect ratios below 1.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import loadavg  # benchmarks/loadavg.py: a script's folder is on sys.path

# SmolLM2-135M's projections (decoder.py's fused layout): name -> (In, Out).
PROJECTIONS = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
               "lm_head": (576, 49152)}


def _dot(x, w, x_axis, w_axis, bf16):
  if bf16:
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  return jax.lax.dot_general(x, w, (((x_axis,), (w_axis,)), ((), ())),
                             preferred_element_type=jnp.float32)


def _seconds(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tokens", type=int, default=6144)
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args()
  loadavg.report("start")
  n = args.tokens
  keys = iter(jax.random.split(jax.random.key(0), 3 * len(PROJECTIONS)))
  totals = {False: 0.0, True: 0.0}
  print(f"{'projection':10s} {'matmul':15s} {'float32':>9s} {'bf16 ops':>9s}  GFLOP/s")
  for name, (fan_in, fan_out) in PROJECTIONS.items():
    x = jax.random.normal(next(keys), (n, fan_in))
    w = jax.random.normal(next(keys), (fan_in, fan_out))
    g = jax.random.normal(next(keys), (n, fan_out))
    flops = 2 * n * fan_in * fan_out
    cases = {"forward x.W": (x, w, 1, 0), "input grad g.W^T": (g, w, 1, 1),
             "kernel grad x^T.g": (x, g, 0, 0)}
    for case, (a, b, a_axis, b_axis) in cases.items():
      speed = {}
      for bf16 in (False, True):
        fn = jax.jit(lambda a, b, bf16=bf16: _dot(a, b, a_axis, b_axis, bf16))
        speed[bf16] = flops / _seconds(fn, a, b, repeats=args.repeats) / 1e9
      if case.startswith("forward"):
        for bf16 in (False, True):
          totals[bf16] += flops / (speed[bf16] * 1e9)
      print(f"{name:10s} {case:17s} {speed[False]:7.0f} {speed[True]:9.0f}")
  loadavg.report("end")
  print(f"ratio: {totals[False] / totals[True]:.2f}")


if __name__ == "__main__":
  main()
