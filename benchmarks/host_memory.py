"""`--keep_freed_memory` of the training benchmarks: freed host memory stays in the process, so
that a jitted CPU step reuses it instead of faulting in fresh pages.

XLA:CPU gives each execution of a jitted function one temporary buffer: 815 MB for the update
of `update_bench.py` (4M parameters, 8 x 512 tokens). glibc serves a block that large with a
fresh mmap and unmaps it when it is freed, so every step touches hundreds of MB of new pages
(~210,000 minor page faults and 0.3-0.4 s of kernel time per update on the project's 2-core
virtual machines, where a first touch costs more than on bare metal and more again after
another process freed memory). Kept, the buffer of one step is the buffer of the next, and a
bench times both sides' arithmetic without the kernel's share, which varies from run to run.

Two glibc settings and one JAX setting do it:
- no mmap for any block size, and the heap given back to the kernel only above 2 GB of free
  top (mallopt);
- JAX's CPU client runs a one-device computation on the calling thread instead of a worker
  thread (`jax_cpu_enable_async_dispatch=False`). The calling thread is the main one, whose
  malloc arena is the heap; a worker thread's own arena is capped at 64 MB, so glibc maps a
  larger block anyway. torch's eager ops run on the main thread already.

Why this is a benchmark option and not the trainer's default: the rollout dispatches its
replicas' decode loops back to back so that they run concurrently, which synchronous dispatch
would serialise. The other way to reach the heap, one malloc arena for all threads, made
XLA's compiler threads contend for its lock: a keypad learning study (tests/test_learning.py,
ppo) took 51 s instead of 38 s, and it slowed the update itself (776-810 ms against 717-733 ms
this way).

Must run before JAX starts its backend: the dispatch mode is fixed when the client is made.
"""

from __future__ import annotations

import argparse
import ctypes
import platform

import jax

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_TRIM_ABOVE = 2 ** 31 - 1  # mallopt takes a C int


def keep_freed_memory() -> bool:
  """Applies the settings above; returns whether they were applied (False without glibc, e.g.
  on macOS or musl)."""
  if platform.libc_ver()[0] != "glibc":
    return False
  jax.config.update("jax_cpu_enable_async_dispatch", False)
  libc = ctypes.CDLL(None)  # the libc this process already runs on
  # mallopt returns 1 on success, 0 on a value it rejects.
  return all([libc.mallopt(_M_MMAP_MAX, 0), libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_ABOVE)])


def add_option(parser: argparse.ArgumentParser) -> None:
  """Adds `--keep_freed_memory` to a training benchmark's flags (apply it with
  `args.keep_freed_memory and keep_freed_memory()`, before JAX starts its backend)."""
  parser.add_argument("--keep_freed_memory", action="store_true",
                      help="glibc keeps freed memory in the process, for both sides "
                           "(benchmarks/host_memory.py): steps without fresh page faults")
