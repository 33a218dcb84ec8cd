"""Freed large host buffers go back to the operating system (glibc's malloc).

On CPU, XLA's buffers (a layer's weights, a KV-cache layer, a step's temporaries) are plain
`malloc` allocations. glibc serves a block from `mmap` only above a threshold that it raises to
the size of each mapped block freed (up to 32 MiB), so after the first steps most of a run's
buffers of a few MiB come from its heaps, and a heap gives memory back only from its top: the
resident size of a long run then follows the largest mix of buffers it has held rather than
what it holds now. With a fixed threshold of 1 MiB every buffer that large has its own mapping,
unmapped when freed; the price is a page fault per fresh page, small beside a step of a real
model's compute (benchmarks/README.md, "Memory", has both sides on the main job).

`benchmarks/host_memory.py --keep_freed_memory` is the opposite trade, for timing benchmarks
only: it keeps every freed block so that a small model's step is timed without page faults.

`return_freed_memory()` sets the threshold from inside the process (the trainer and evaluate
call it first), unless the user set glibc's own `MALLOC_MMAP_THRESHOLD_`, which then wins. Where
the C library is not glibc it does nothing.

Programs hold memory too: on XLA:CPU every executable of the model (an extend at one chunk
width and cache length, a decode loop, an update) keeps about 40 MiB of SmolLM2-135M resident
while JAX holds it, and a run meets a new shape every few steps, so resident memory climbs by
hundreds of MiB a step. `release_programs()` drops them all; the next call of each jitted
function traces again and loads its program from the persistent compilation cache
(agentgym_jax/caches.py) instead of compiling it. A `ProgramBudget` does so once
`compile.max_programs` programs have been built since its last release, at the safe points that
ask it (`release_if_over_budget`): between a step's batch and its update, so that the rollout's
programs are not held through the update's peak, and between the turns of a rollout, so that a
held-out evaluation of many tasks (each turn a new extend width and cache length: 100 programs
in one evaluation of the main job) does not hold them all.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import platform
from typing import Callable

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 1 << 20  # bytes: blocks of this size or more are mapped on their own.


def return_freed_memory(threshold: int = MMAP_THRESHOLD) -> bool:
  """Makes glibc map blocks of `threshold` bytes or more on their own (unmapped when freed)
  and trim its heaps above that much free memory; True when set. A no-op (False) when
  MALLOC_MMAP_THRESHOLD_ is in the environment or the C library is not glibc."""
  if "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
    return False
  libc = ctypes.CDLL(None)  # the libc this process already runs on
  # mallopt returns 1 on success, 0 on a value it rejects.
  ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(
      libc.mallopt(_M_TRIM_THRESHOLD, threshold))
  if not ok:
    logging.warning("glibc refused an mmap threshold of %d bytes; freed host buffers may stay "
                    "resident.", threshold)
  return ok


def release_programs() -> None:
  """Drops every program JAX holds (jax.clear_caches) and gives the heap pages they used back
  to the operating system (glibc's malloc_trim; elsewhere only the first)."""
  import jax  # pylint: disable=import-outside-toplevel
  jax.clear_caches()
  gc.collect()
  if platform.libc_ver()[0] == "glibc":
    ctypes.CDLL(None).malloc_trim(0)


class ProgramBudget:
  """Drops every program (`release_programs`) once more than `max_programs` were built since the
  last drop, when asked at a point where no traced function is running (`check`).

  `built` counts the executables the process has built so far (`caches.CompileCounter.built`).
  """

  def __init__(self, max_programs: int, built: Callable[[], int]):
    if max_programs < 1:
      raise ValueError(f"ProgramBudget: max_programs must be >= 1, got {max_programs}.")
    self.max_programs, self._built = max_programs, built
    self._released_at = built()
    self.releases = 0

  def check(self) -> bool:
    """Releases when over budget; True when it did."""
    if self._built() - self._released_at <= self.max_programs:
      return False
    release_programs()
    self._released_at = self._built()
    self.releases += 1
    return True


# The process's budget (None: programs are kept), set by the trainer for its synchronous loop.
_budget: ProgramBudget | None = None


def set_program_budget(budget: ProgramBudget | None) -> None:
  """Makes `budget` the one `release_if_over_budget` asks (None: keep every program). Only a
  process whose jitted functions all run on one thread may set one: a release while another
  thread traces or runs would race it."""
  global _budget
  _budget = budget


def release_if_over_budget() -> None:
  """A safe point (no traced function running): drops the programs if the budget says so."""
  if _budget is not None:
    _budget.check()
