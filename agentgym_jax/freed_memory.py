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
while JAX holds it (the lowered module and the executable's own structures; neither its
arguments nor, for the most part, machine code), and a run meets a new shape every few
steps. `release_programs()` drops them all; the next call of each jitted function traces again
(one block of the model: its blocks share a trace, models/decoder.py `_extend_block`) and loads
its program from the persistent compilation cache (agentgym_jax/caches.py) instead of
compiling it, a fraction of the compile (benchmarks/README.md, Memory). A `ProgramBudget`
holds the process to `compile.max_resident_gib` of resident memory at its peaks. It drops the
programs at a safe point (no traced function running) that asks it:

- before a heavy phase (`ahead_of`: the update, which adds its temporaries and gradients; the
  scoring of a step's rows by the reference or the critic; a checkpoint's write, which copies
  the train state to the host and, under a budget, is waited for inside the phase: written in
  the background it added its copies to the next phase's peak), when what the process holds
  plus the largest rise that phase has shown in this run would pass the budget (a phase not yet
  seen: whenever programs were built since the last drop). Each run of the phase measures its
  rise as its peak over its start: the kernel's high-water mark (VmHWM, reset before the phase
  through /proc/self/clear_refs; so a budgeted process's own `getrusage` peak is its last
  phase's, and its peak over a run is measured from outside: benchmarks/sample_rss.py);
- between the turns of a rollout (`release_if_over_budget`), when the process holds more than
  the budget, so that a held-out evaluation's programs do not pile up; and before its KV cache
  grows to the next length, counting the grown copy, which lives beside the old one while it is
  made (SmolLM2-135M's 8 rows: 0.70 GiB at 2,048 slots, enough to pass 6 GiB from 5.4).

A budget in bytes rather than programs keeps every program while memory allows (a run whose
shapes repeat then loads nothing after its first steps) and drops them only when they would
push the next peak too high.

The programs of the phases a budget is asked before go last (`KeptPrograms`): the update and
the scoring run right after a drop, so dropping their own programs lowered no peak and cost a
reload at every step (most of what a second run of the main job's BC stage spent building:
experiments/smollm2/README.md).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import gc
import logging
import os
import platform
import weakref
from typing import Any, Callable, Iterator

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
  _give_back()


def _give_back() -> None:
  """Collects what was let go and returns glibc's free heap pages to the operating system."""
  gc.collect()
  if platform.libc_ver()[0] == "glibc":
    ctypes.CDLL(None).malloc_trim(0)


def _status_bytes(field: str) -> int | None:
  try:
    with open("/proc/self/status", encoding="ascii") as status:
      for line in status:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def resident_bytes() -> int | None:
  """This process's resident memory (VmRSS of /proc/self/status); None where there is none."""
  return _status_bytes("VmRSS")


def high_water_bytes() -> int | None:
  """This process's peak resident memory since its start or the last `reset_high_water`
  (VmHWM); None where there is none."""
  return _status_bytes("VmHWM")


def reset_high_water() -> bool:
  """Resets the high-water mark to the current resident memory (Linux: "5" to
  /proc/self/clear_refs); False where the kernel does not allow it."""
  try:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
      refs.write("5")
    return True
  except OSError:
    return False


class ProgramBudget:
  """Drops every program (`release_programs`) when the process holds more than
  `max_resident_bytes`, or would during the phase it is asked before (`ahead_of`), and has built
  programs since the last drop; asked at points where no traced function is running.

  `built` counts the executables the process has built so far (`caches.CompileCounter.built`);
  `resident` reads the process's resident bytes (`resident_bytes`; None: never over);
  `high_water` resets and reads its peak (`reset_high_water`, `high_water_bytes`).
  """

  def __init__(self, max_resident_bytes: int, built: Callable[[], int],
               resident: Callable[[], int | None] = resident_bytes,
               high_water: tuple[Callable[[], bool], Callable[[], int | None]] = (
                   reset_high_water, high_water_bytes)):
    if max_resident_bytes <= 0:
      raise ValueError(f"ProgramBudget: max_resident_bytes must be > 0, got "
                       f"{max_resident_bytes}; compile.max_resident_gib=0 keeps every program.")
    self.max_resident_bytes, self._built, self._resident = max_resident_bytes, built, resident
    self._reset_high_water, self._high_water = high_water
    self._released_at = built()
    self.releases = 0
    self.rises: dict[str, int] = {}  # phase -> the largest rise measured over its start
    self._warned = False

  def check(self, rise: int = 0, phase: str | None = None) -> bool:
    """Releases when the resident memory plus `rise` (bytes the next phase will add) is over
    budget: the programs built since the last drop, then, while still over, the kept programs
    (`KeptPrograms`) of every phase but `phase`; True when it dropped any."""
    held = self._resident()
    if held is None or held + rise <= self.max_resident_bytes:
      return False
    released = False
    if self._built() != self._released_at:
      release_programs()
      logging.info("Dropped the programs built since the last drop (%d): %.2f GiB held + %.2f "
                   "of rise > compile.max_resident_gib=%.2f.", self._built() - self._released_at,
                   held / 2**30, rise / 2**30, self.max_resident_bytes / 2**30)
      self._released_at = self._built()
      released = True
      held = self._resident()
    if held is not None and held + rise > self.max_resident_bytes:
      released = _drop_kept(but=phase) or released
      held = self._resident()
    if released:
      self.releases += 1
    if released and held is not None and held > self.max_resident_bytes and not self._warned:
      self._warned = True
      logging.warning(
          "compile.max_resident_gib=%.2f is below what the run holds without its programs "
          "(%.2f GiB): every safe point now reloads its programs; raise it or set 0.",
          self.max_resident_bytes / 2**30, held / 2**30)
    return released

  @contextlib.contextmanager
  def kept(self) -> Iterator[None]:
    """Programs built in the block survive a drop (`KeptPrograms`): they make none worth doing."""
    before = self._built()
    yield
    self._released_at += self._built() - before

  @contextlib.contextmanager
  def ahead_of(self, phase: str, finish: Callable[[], None] | None = None) -> Iterator[None]:
    """A safe point before `phase` runs in the block: releases when what the process holds plus
    the largest rise `phase` has shown would pass the budget (a phase not yet measured: when
    programs were built since the last drop), then measures this run's rise. `finish`, called
    at the end of the block, waits for what the phase left running in the background (an
    asynchronous checkpoint's write), so that its memory counts in the phase's rise."""
    self.check(self.rises.get(phase, self.max_resident_bytes), phase)
    start = self._resident()
    measured = start is not None and self._reset_high_water()
    yield
    if finish is not None:
      finish()
    peak = self._high_water() if measured else None
    if peak is not None:
      self.rises[phase] = max(self.rises.get(phase, 0), peak - start)


def budget_of(max_resident_gib: float, built: Callable[[], int]) -> ProgramBudget | None:
  """The budget of `compile.max_resident_gib` (0: None, every program kept)."""
  return ProgramBudget(int(max_resident_gib * 2**30), built) if max_resident_gib else None


# The process's budget (None: programs are kept), set by the trainer for its synchronous loop.
_budget: ProgramBudget | None = None


def set_program_budget(budget: ProgramBudget | None) -> None:
  """Makes `budget` the one `release_if_over_budget` asks (None: keep every program). Only a
  process whose jitted functions all run on one thread may set one: a release while another
  thread traces or runs would race it."""
  global _budget
  _budget = budget


def release_if_over_budget(rise: int = 0) -> None:
  """A safe point (no traced function running): drops the programs if the budget says so,
  counting `rise` bytes that the next call will add (a KV cache about to grow)."""
  if _budget is not None:
    _budget.check(rise)


def ahead_of(phase: str, finish: Callable[[], None] | None = None
             ) -> contextlib.AbstractContextManager[None]:
  """The budget's `ProgramBudget.ahead_of(phase, finish)` (no budget: nothing, and `finish` is
  not called: the phase may go on in the background)."""
  return (_budget.ahead_of(phase, finish) if _budget is not None
          else contextlib.nullcontext())


class KeptPrograms:
  """`jitted` (a `jax.jit` function), the program of `phase` (a name `ahead_of` is asked
  before), whose executables `release_programs` leaves alone.

  Each new signature of the arguments (tree, types, shardings) is compiled ahead of time,
  `jitted.lower(*args).compile()`, which reads and writes the persistent compilation cache like
  any compile, and held here rather than in JAX's caches, which a drop clears: the `max_kept`
  most recently used (older ones are let go once the new one is built). Builds here do not make
  a drop worth doing (`ProgramBudget.kept`); a budget still over after dropping the rest drops
  the kept programs of the other phases (`ProgramBudget.check`): the update's peak then holds
  the update's program and not the scorers'. Arguments are passed as to `jitted`, positionally,
  with no static ones.
  """

  def __init__(self, jitted: Any, phase: str, max_kept: int = 1):
    if max_kept < 1:
      raise ValueError(f"KeptPrograms: max_kept must be >= 1, got {max_kept}.")
    self.jitted, self.phase, self.max_kept = jitted, phase, max_kept
    self._compiled: collections.OrderedDict[Any, Any] = collections.OrderedDict()
    _kept.add(self)

  def __len__(self) -> int:
    return len(self._compiled)

  def clear(self) -> None:
    self._compiled.clear()

  @staticmethod
  def _signature(args: tuple[Any, ...]) -> Any:
    import jax  # pylint: disable=import-outside-toplevel
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((jax.typeof(x), getattr(x, "sharding", None)) for x in leaves)

  def __call__(self, *args: Any) -> Any:
    key = self._signature(args)
    compiled = self._compiled.pop(key, None)
    if compiled is None:
      with _budget.kept() if _budget is not None else contextlib.nullcontext():
        compiled = self.jitted.lower(*args).compile()
    self._compiled[key] = compiled  # the most recently used last
    while len(self._compiled) > self.max_kept:
      self._compiled.popitem(last=False)
    return compiled(*args)


_kept: "weakref.WeakSet[KeptPrograms]" = weakref.WeakSet()


def _drop_kept(but: str | None) -> bool:
  """Lets go of the kept programs of every phase but `but` (None: all); True when any held one."""
  dropping = [kept for kept in list(_kept) if kept.phase != but and len(kept)]
  for kept in dropping:
    kept.clear()
  if dropping:
    _give_back()
    logging.info("Dropped the kept programs of %s.", ", ".join(sorted({k.phase for k in dropping})))
  return bool(dropping)
