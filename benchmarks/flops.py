"""FLOP accounting of the benchmarks: matmul peaks measured now, and the FLOPs of a training
step, so that a throughput can be read as a fraction of what this machine can do.

The peak is measured for both frameworks: they multiply matrices with different libraries
(XLA:CPU calls YNNPACK or Eigen, PyTorch its oneDNN/MKL sgemm), and on some CPUs one library is
faster at the same n x n x n product. A gap between the two peaks is a gap our code cannot
close; a gap between the two fractions of their own peaks is one it can."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from agentgym_jax.models import ModelConfig


def matmul_peak(n: int = 2048, reps: int = 3):
  """Returns fn() -> best-of-`reps` f32 FLOP/s of a jitted n x n x n matmul, measured now."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  return _best_rate(lambda: f(a).block_until_ready(), 2 * n ** 3, reps)


def torch_matmul_peak(n: int = 2048, reps: int = 3):
  """`matmul_peak` for PyTorch's own matmul on the CPU, with its current thread count."""
  import torch  # pylint: disable=import-outside-toplevel
  a = torch.randn(n, n)
  return _best_rate(lambda: torch.mm(a, a), 2 * n ** 3, reps)


def _best_rate(fn, flops: float, reps: int):
  """Runs fn once (compilation, warm-up); returns () -> flops / the fastest of `reps` calls."""
  fn()
  return lambda: flops / min(_timed(fn) for _ in range(reps))


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def train_flops_per_step(cfg: ModelConfig, batch: int, length: int) -> float:
  """6 x matmul parameters x tokens, plus attention scores and mixing (12 L T H Dh per token)."""
  # The embedding gather is free; the LM head is a V x H matmul (the same matrix when tied,
  # which num_params counts once).
  embed = cfg.vocab_size * cfg.hidden_size
  matmul_params = cfg.num_params - embed + (embed if cfg.tie_embeddings else 0)
  per_token = 6 * matmul_params + 12 * cfg.num_layers * length * cfg.num_heads * cfg.head_dim
  return per_token * batch * length
