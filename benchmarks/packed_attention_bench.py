"""One layer's attention, forward + backward, of a group of episodes sharing an opening: as
separate right-padded rows (causal blockwise, what the update trains today) against one packed
row (`Segments`: the opening once, the continuations back to back; blockwise at several block
sizes, and the XLA form's full mask). The separate rows also run at the packed form's default
block, to tell what packing saves from what smaller blocks do.

SmolLM2-135M's attention (3 kv heads of 3 query heads, head_dim 64), float32, one group of
BabyAI's update: an opening of 490 tokens and 4 continuations, each row padded to 1,536.

  python benchmarks/packed_attention_bench.py [--opening 490] [--row 1536]
      [--continuations 300,250,350,280] [--blocks 32,64,128,256,512] [--repeats 7]

Last line: `ratio: <separate rows / packed row at the default block>`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from agentgym_jax.models import attention as attn
import loadavg  # benchmarks/loadavg.py: a script's folder is on sys.path

KV_HEADS, GROUP, HEAD_DIM = 3, 3, 64


def _median_seconds(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _grad(form):
  """d/d(q, k, v) of sum(form(q, k, v, valid) ** 2), jitted."""
  return jax.jit(jax.grad(lambda q, k, v, valid: jnp.sum(form(q, k, v, valid) ** 2),
                          argnums=(0, 1, 2)))


def _qkv(rows: int, t: int):
  keys = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(keys[0], (rows, t, KV_HEADS, GROUP, HEAD_DIM)),
          jax.random.normal(keys[1], (rows, t, KV_HEADS, HEAD_DIM)),
          jax.random.normal(keys[2], (rows, t, KV_HEADS, HEAD_DIM)))


def _packed_row(opening: int, continuations: list[int]):
  """valid [1, T] and Segments of [opening | continuations | padding to a multiple of 64]."""
  n = opening + sum(continuations)
  t = -(-n // 64) * 64
  starts, positions = np.zeros(t, np.int32), np.zeros(t, np.int32)
  positions[:opening] = np.arange(opening)
  at = opening
  for c in continuations:
    starts[at:at + c], positions[at:at + c] = at, opening + np.arange(c)
    at += c
  shared_end = np.where(np.arange(t) >= opening, opening, 0).astype(np.int32)
  segments = attn.Segments(positions=jnp.asarray(positions)[None],
                           starts=jnp.asarray(starts)[None],
                           shared_start=jnp.zeros((1, t), jnp.int32),
                           shared_end=jnp.asarray(shared_end)[None])
  return jnp.arange(t)[None] < n, segments


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--opening", type=int, default=490)
  parser.add_argument("--row", type=int, default=1536, help="the separate rows' padded length")
  parser.add_argument("--continuations", default="300,250,350,280")
  parser.add_argument("--blocks", default="32,64,128,256,512")
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args()
  continuations = [int(c) for c in args.continuations.split(",")]
  loadavg.report("start")

  row = args.row
  valid = jnp.arange(row)[None] < (args.opening + jnp.asarray(continuations))[:, None]
  separate = _median_seconds(
      _grad(lambda q, k, v, valid: attn.self_attention(q, k, v, valid, "blockwise")),
      (*_qkv(len(continuations), row), valid), args.repeats)
  print(f"{len(continuations)} rows of {row}, causal blockwise: {separate * 1e3:.0f} ms")
  positions = jnp.broadcast_to(jnp.arange(row), valid.shape)
  small = _median_seconds(_grad(lambda q, k, v, valid: attn.flash_attention(
      q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), positions, valid,
      attn._SEGMENT_BLOCK, attn._SEGMENT_BLOCK)), (*_qkv(len(continuations), row), valid),
                          args.repeats)
  print(f"the same, blocks of {attn._SEGMENT_BLOCK} (the packed form's default): "
        f"{small * 1e3:.0f} ms")

  valid, segments = _packed_row(args.opening, continuations)
  qkv = _qkv(1, valid.shape[1])
  packed = lambda impl: _grad(
      lambda q, k, v, valid: attn.segment_attention(q, k, v, valid, segments, impl))
  default_block = attn._SEGMENT_BLOCK
  default = None
  for block in [int(b) for b in args.blocks.split(",")]:
    attn._SEGMENT_BLOCK = block
    seconds = _median_seconds(packed("blockwise"), (*qkv, valid), args.repeats)
    default = seconds if block == default_block else default
    print(f"1 packed row of {valid.shape[1]} ({int(valid.sum())} valid), blockwise, blocks of "
          f"<= {block}{' (default)' if block == default_block else ''}: {seconds * 1e3:.0f} ms")
  attn._SEGMENT_BLOCK = default_block
  xla = _median_seconds(packed("xla"), (*qkv, valid), args.repeats)
  print(f"1 packed row, XLA form (full mask): {xla * 1e3:.0f} ms")
  loadavg.report("end")
  if default is None:
    default = _median_seconds(packed("blockwise"), (*qkv, valid), args.repeats)
  print(f"ratio: {separate / default:.2f}")


if __name__ == "__main__":
  main()
