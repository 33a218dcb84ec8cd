"""Keeps freed host memory in the process, so that jitted CPU steps reuse it instead of
faulting in fresh pages every call.

XLA:CPU gives each execution of a jitted function one temporary buffer: 815 MB for the update
of `benchmarks/update_bench.py` (4M parameters, 8 x 512 tokens). glibc's malloc serves a block
that large with a fresh mmap and unmaps it when it is freed, so every step touches hundreds of
MB of new pages. Measured on the project's 2-core machines (virtual machines, where a first
touch costs more than on bare metal): 210,000 minor page faults and ~0.3 s of kernel time per
update, and 37% of a 3M-parameter model's forward+backward step. Kept in the heap, the buffer
of one step is the buffer of the next: ~0 faults, the update ~15% faster.

Three glibc settings do it: blocks of any size come from the heap (no mmap), the heap is given
back to the kernel only above 2 GB of free top, and every thread allocates from the main
heap (a thread's own arena is capped at 64 MB, so glibc would map a large block anyway).
The process then holds on to its peak host memory. Accelerator memory is XLA's own and is not
affected.

`keep_freed_memory()` must run before JAX starts its backend: its threads pick their malloc
arena when they first allocate. The project's entry points (trainer, evaluation, replay,
benchmarks) and the test suite call it first thing; set AGENTGYM_JAX_GLIBC_MALLOC=1 to keep
glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import platform

OPT_OUT = "AGENTGYM_JAX_GLIBC_MALLOC"

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_TRIM_ABOVE = 2 ** 31 - 1  # mallopt takes a C int


def keep_freed_memory() -> bool:
  """Sets the three glibc malloc options; returns whether they were set.

  False without glibc (macOS, musl), or when the AGENTGYM_JAX_GLIBC_MALLOC environment variable
  is set to anything but "" or "0".
  """
  if os.environ.get(OPT_OUT, "0") not in ("", "0") or platform.libc_ver()[0] != "glibc":
    return False
  libc = ctypes.CDLL(None)  # the libc this process already runs on
  # mallopt returns 1 on success, 0 on a value it rejects.
  return all([libc.mallopt(_M_ARENA_MAX, 1), libc.mallopt(_M_MMAP_MAX, 0),
              libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_ABOVE)])
