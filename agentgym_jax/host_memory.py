"""Large host buffers go back to the operating system when freed (glibc's malloc).

On CPU, XLA's buffers — a layer's weights (MiB), a KV-cache layer, a step's temporaries — are
plain `malloc` allocations. glibc serves one from `mmap` only above a threshold that it raises
to the size of each mmapped block freed (up to 32 MiB), so after the first steps most of a run's
buffers come from its heaps, and a heap returns memory only from its top: the resident size of
a long run then follows the largest mix of buffers it has ever held rather than what it holds
now (benchmarks/README.md, "Memory", has the measurement on the main job). A fixed threshold of
1 MiB keeps every buffer of that size or more in its own mapping, unmapped when freed; the cost
is a page fault per fresh page, small beside a step's compute.

`keep_resident_memory_flat()` sets it from inside the process (the entry points call it first),
unless the user set glibc's own `MALLOC_MMAP_THRESHOLD_`, which then wins. Elsewhere than glibc
it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 1 << 20  # bytes: buffers of this size or more are mapped on their own.


def keep_resident_memory_flat(threshold: int = MMAP_THRESHOLD) -> bool:
  """Makes glibc map buffers of `threshold` bytes or more on their own (returned to the OS when
  freed) and trim its heaps above that much free memory; True when set. A no-op (False) when
  MALLOC_MMAP_THRESHOLD_ is in the environment or the C library is not glibc."""
  if "MALLOC_MMAP_THRESHOLD_" in os.environ:
    return False
  name = ctypes.util.find_library("c")
  try:
    libc = ctypes.CDLL(name or "libc.so.6")
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  ok = mallopt(_M_MMAP_THRESHOLD, threshold) == 1 and mallopt(_M_TRIM_THRESHOLD, threshold) == 1
  if not ok:
    logging.warning("mallopt refused an mmap threshold of %d bytes; freed host buffers may stay "
                    "resident.", threshold)
  return ok
