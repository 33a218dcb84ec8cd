"""`--keep_freed_memory` of the training benchmarks: glibc's malloc told to keep freed memory
in the process, so that a jitted CPU step reuses it instead of faulting in fresh pages.

XLA:CPU gives each execution of a jitted function one temporary buffer: 815 MB for the update
of `update_bench.py` (4M parameters, 8 x 512 tokens). glibc serves a block that large with a
fresh mmap and unmaps it when it is freed, so every step touches hundreds of MB of new pages
(~210,000 minor page faults and 0.3-0.4 s of kernel time per update on the project's 2-core
virtual machines, where a first touch costs more than on bare metal and more again after
another process freed memory). torch's eager step faults about as often. Kept, the buffer of
one step is the buffer of the next, and a bench times both sides' arithmetic without the
kernel's share, which varies from run to run.

Three mallopt settings do it: no mmap for any block size, the heap given back to the kernel
only above 2 GB of free top, and one malloc arena for all threads (a thread's own arena is capped
at 64 MB, so glibc would map a large block anyway; with 2-8 arenas the buffer still came mapped
afresh in most runs). The one arena is why this is a benchmark option and not the trainer's
default: every thread then takes the same lock, and XLA's compiler threads contend for it. A
keypad learning study (tests/test_learning.py, ppo) took 51 s instead of 38 s, tests/test_update.py
51 s instead of 37 s, with 8x the voluntary context switches.

Must run before JAX starts its backend: threads pick their arena when they first allocate.
"""

from __future__ import annotations

import ctypes
import platform

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_TRIM_ABOVE = 2 ** 31 - 1  # mallopt takes a C int


def keep_freed_memory() -> bool:
  """Sets the three glibc malloc options; returns whether they were set (False without glibc,
  e.g. on macOS or musl)."""
  if platform.libc_ver()[0] != "glibc":
    return False
  libc = ctypes.CDLL(None)  # the libc this process already runs on
  # mallopt returns 1 on success, 0 on a value it rejects.
  return all([libc.mallopt(_M_ARENA_MAX, 1), libc.mallopt(_M_MMAP_MAX, 0),
              libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_ABOVE)])
