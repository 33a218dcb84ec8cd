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
