"""freed_memory: freed large buffers leave the process's resident memory (glibc)."""

import logging
import os
import platform
import subprocess
import sys

import pytest

from agentgym_jax import freed_memory

# A child allocates 100 buffers of 4 MiB, each followed by a small one it keeps, after freeing
# one 16 MiB buffer (which makes glibc raise its mmap threshold above 4 MiB), then frees the
# big ones: its resident MiB while holding them and after.
_PROBE = """
import sys
import numpy as np
from agentgym_jax import freed_memory
if sys.argv[1] == "flat":
  assert freed_memory.return_freed_memory()
def rss():
  for line in open("/proc/self/status"):
    if line.startswith("VmRSS"):
      return int(line.split()[1]) / 1024
big = np.ones(16 << 20, np.uint8)
del big
blocks, keepers = [], []
for _ in range(100):
  blocks.append(np.ones(4 << 20, np.uint8))
  keepers.append(np.ones(64 << 10, np.uint8))
held = rss()
del blocks
print(held, rss())
"""


def _held_and_after(mode: str) -> tuple[float, float]:
  # glibc's own settings stay out of the child: the probe compares its default with ours.
  env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
  out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                       check=True, env=env)
  held, after = map(float, out.stdout.split())
  return held, after


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_buffers_leave_resident_memory_only_with_the_fixed_threshold():
  held, after = _held_and_after("default")
  assert after > held - 100, "glibc's default keeps the freed 400 MiB resident (heap holes)"
  held, after = _held_and_after("flat")
  assert held > 400 and after < held - 350, (held, after)


def test_the_users_own_threshold_wins(monkeypatch):
  monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
  assert freed_memory.return_freed_memory() is False


def test_released_programs_are_built_again_and_give_the_same_result():
  import jax
  import jax.numpy as jnp
  f = jax.jit(lambda x: jnp.tanh(x) * 2)
  x = jnp.arange(4.0)
  before = f(x)
  assert f._cache_size() == 1
  freed_memory.release_programs()
  assert f._cache_size() == 0
  assert (f(x) == before).all() and f._cache_size() == 1


def test_a_program_budget_releases_past_its_resident_bytes_when_programs_were_built(
    monkeypatch, caplog):
  built, held = [0], [100]
  releases = []

  def release():
    releases.append(built[0])
    held[0] -= 50  # the programs' memory goes back

  monkeypatch.setattr(freed_memory, "release_programs", release)
  budget = freed_memory.ProgramBudget(100, lambda: built[0], resident=lambda: held[0])
  built[0] = 3
  assert not budget.check() and releases == []  # 100 bytes held: within the budget
  held[0] = 120
  assert budget.check() and releases == [3] and held[0] == 70  # past it: released
  held[0] = 130
  assert not budget.check()  # nothing built since: nothing to drop
  built[0] = 5
  freed_memory.set_program_budget(budget)
  try:
    freed_memory.release_if_over_budget()
    assert releases == [3, 5] and budget.releases == 2
  finally:
    freed_memory.set_program_budget(None)
  freed_memory.release_if_over_budget()  # no budget: nothing happens
  assert releases == [3, 5]
  # A budget below what the run holds without programs says so, once.
  held[0], built[0] = 300, 9
  with caplog.at_level(logging.WARNING):
    assert budget.check() and budget.check() is False
    built[0] = 10
    assert budget.check()
  assert sum("compile.max_resident_gib" in r.getMessage() for r in caplog.records) == 1
  # Where resident memory cannot be read, nothing is released.
  assert not freed_memory.ProgramBudget(1, lambda: 7, resident=lambda: None).check()
  assert freed_memory.budget_of(0.0, lambda: 0) is None
  assert freed_memory.budget_of(1.5, lambda: 0).max_resident_bytes == 3 * 2**29
  with pytest.raises(ValueError, match="max_resident_bytes must be > 0"):
    freed_memory.ProgramBudget(0, lambda: 0)


def test_resident_bytes_reads_this_process():
  held = freed_memory.resident_bytes()
  assert held is None or 10 * 2**20 < held < 64 * 2**30


def test_ahead_of_a_phase_releases_by_the_rise_it_measured(monkeypatch):
  built, held, peak, resets = [0], [40], [0], []
  releases = []

  def release():
    releases.append(built[0])
    held[0] -= 20

  def reset():
    resets.append(held[0])
    peak[0] = held[0]
    return True

  monkeypatch.setattr(freed_memory, "release_programs", release)
  budget = freed_memory.ProgramBudget(100, lambda: built[0], resident=lambda: held[0],
                                      high_water=(reset, lambda: peak[0]))
  built[0] = 1
  # A phase not seen yet: released whenever programs were built since the last drop.
  with budget.ahead_of("update"):
    peak[0] += 30  # the update's temporaries, gone at its end
  assert releases == [1] and budget.rises == {"update": 30} and resets == [20]
  built[0], held[0] = 2, 60
  with budget.ahead_of("update"):  # 60 held + 30 of rise: within 100
    peak[0] += 25
  assert releases == [1] and budget.rises == {"update": 30}  # the largest rise is kept
  held[0] = 75
  with budget.ahead_of("update"):  # 75 + 30 would pass 100
    pass
  assert releases == [1, 2] and held[0] == 55
  # Where the high-water mark cannot be reset, no rise is measured.
  built[0] = 3
  blind = freed_memory.ProgramBudget(100, lambda: built[0], resident=lambda: held[0],
                                     high_water=(lambda: False, lambda: 10**9))
  built[0] = 4
  with blind.ahead_of("checkpoint"):
    pass
  assert blind.rises == {} and releases == [1, 2, 4]
  # With no budget set the module's safe point does nothing.
  built[0] = 5
  with freed_memory.ahead_of("update"):
    pass
  assert releases == [1, 2, 4]


def test_what_a_phase_leaves_running_counts_in_its_rise_under_a_budget_only(monkeypatch):
  # An asynchronous checkpoint's write goes on after its phase's block: under a budget the
  # phase waits for it (`finish`), so that its host copies count in the phase's rise.
  held, peak, finished = [50], [0], []
  monkeypatch.setattr(freed_memory, "release_programs", lambda: None)

  def reset():
    peak[0] = held[0]
    return True

  def write_in_background():
    peak[0] += 40  # the write's copies, made while it runs
    finished.append(True)

  budget = freed_memory.ProgramBudget(100, lambda: 0, resident=lambda: held[0],
                                      high_water=(reset, lambda: peak[0]))
  with budget.ahead_of("checkpoint", finish=write_in_background):
    assert not finished
  assert finished == [True] and budget.rises == {"checkpoint": 40}
  # With no budget the module's safe point leaves the write in the background.
  freed_memory.set_program_budget(None)
  with freed_memory.ahead_of("checkpoint", finish=write_in_background):
    pass
  assert finished == [True]


def test_high_water_mark_rises_with_a_buffer_and_resets():
  import numpy as np
  if not freed_memory.reset_high_water():
    pytest.skip("this kernel does not let a process reset its high-water mark")
  start = freed_memory.resident_bytes()
  buffer = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
  del buffer
  assert freed_memory.high_water_bytes() >= start + 60 * 2**20
  assert freed_memory.reset_high_water()
  assert freed_memory.high_water_bytes() < start + 32 * 2**20


def test_kept_programs_survive_a_drop_and_go_last(monkeypatch):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from agentgym_jax import caches
  counter = caches.CompileCounter()
  traces = []

  def double(x):
    traces.append(x.shape)
    return x * 2

  kept = freed_memory.KeptPrograms(jax.jit(double), phase="update", max_kept=2)
  scorer = freed_memory.KeptPrograms(jax.jit(lambda x: x - 1), phase="score")
  x3, x4, x5, i4 = jnp.ones(3), jnp.ones(4), jnp.ones(5), jnp.ones(4, jnp.int32)
  other = jax.jit(lambda x: x + 1)
  start = counter.built()
  held = [90]
  budget = freed_memory.ProgramBudget(100, counter.built, resident=lambda: held[0])
  freed_memory.set_program_budget(budget)
  try:
    assert (np.asarray(kept(x3)) == 2).all()  # compared on the host: no program of its own
    assert counter.built() == start + 1 and traces == [(3,)]
    # Only kept programs built since the last drop, and within the budget: nothing dropped.
    assert not budget.check(rise=5)
    freed_memory.release_programs()  # JAX's own caches go; the kept executable stays
    assert (np.asarray(kept(x3)) == 2).all() and traces == [(3,)] and counter.built() == start + 1
    kept(x4)
    kept(x5)  # a third signature: the least recently used, length 3, is let go
    assert traces == [(3,), (4,), (5,)]
    kept(x4)
    assert len(traces) == 3  # still kept
    kept(x3)
    assert traces[-1] == (3,) and len(traces) == 4
    kept(i4)  # another dtype: a signature of its own
    assert len(traces) == 5 and len(kept) == 2
    scorer(x4)
    other(x4)  # a program the budget drops first: enough here
    release = freed_memory.release_programs

    def release_and_free():
      release()
      held[0] -= 10

    monkeypatch.setattr(freed_memory, "release_programs", release_and_free)
    assert budget.check(rise=15, phase="update") and len(kept) == 2 and len(scorer) == 1
    assert budget.releases == 1 and held[0] == 80
    # Still over with nothing else to drop: the other phases' kept programs go, not the phase's.
    assert budget.check(rise=25, phase="update") and len(kept) == 2 and len(scorer) == 0
    scorer(x4)
    # Between a rollout's turns (no phase) every kept program may go.
    held[0] = 120
    freed_memory.release_if_over_budget()
    assert len(kept) == 0 and len(scorer) == 0 and budget.releases == 3
    assert not budget.check()  # nothing left to drop
  finally:
    freed_memory.set_program_budget(None)
  with pytest.raises(ValueError, match="max_kept must be >= 1"):
    freed_memory.KeptPrograms(jax.jit(double), phase="update", max_kept=0)
