"""The load-average lines every benchmark prints at its start and end (and how the process
manages host memory).

A ratio taken while other processes compete for the CPUs says more about them than about the
code: the two contestants suffer unequally. Each script prints the load before its first
measurement and again before its result line, with a warning when the 1-minute load exceeds
one runnable process per CPU. The end figure includes the benchmark's own threads.
"""

from __future__ import annotations

import os


def report(when: str, malloc_kept: bool | None = None) -> None:
  """Prints `load average at <when>: ...` and, above 1.0 per CPU, a warning line after it.

  With `malloc_kept` (whether `host_memory.keep_freed_memory` took effect), also a line saying
  how this process manages freed host memory: it moves CPU step times by up to a third.
  """
  # Rounded as printed, so that the warning agrees with the figure a reader sees.
  one, five, fifteen = (round(x, 2) for x in os.getloadavg())
  cpus = os.cpu_count() or 1
  print(f"load average at {when}: {one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min) on "
        f"{cpus} CPUs", flush=True)
  if one > cpus:
    print(f"WARNING: load {one:.2f} is above 1.0 per CPU: other processes compete for the "
          f"CPUs; this run's timings are not a quiet machine's", flush=True)
  if malloc_kept is not None:
    how = ("kept in the process" if malloc_kept else "returned to the kernel (glibc defaults)")
    print(f"freed host memory: {how}, for every contestant alike (benchmarks/host_memory.py)",
          flush=True)
