"""The order in which training tasks are drawn: shuffled epochs over a split, by cursor.

The stream of task ids is a pure function of (task ids, seed): epoch e is a permutation drawn
from seed and e, and epochs are concatenated. A step takes the next `batch` ids at the cursor,
so the whole data-order state is one integer, saved with each checkpoint; a resumed run draws
exactly the tasks the uninterrupted run would have drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TaskStream:
  """Shuffled epochs over `task_ids`; `take(cursor, n)` reads n ids from position cursor.

  Args:
    task_ids: the split's task ids.
    seed: run seed; the same seed gives the same order.
  """

  def __init__(self, task_ids: Sequence[int], seed: int):
    if len(task_ids) == 0:
      raise ValueError("The task split is empty; check data.split and the environment's "
                       "data/splits.json.")
    self.task_ids = np.asarray(task_ids, np.int64)
    self.seed = seed

  def _epoch(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(self.task_ids)

  def take(self, cursor: int, n: int) -> list[int]:
    """Ids at positions cursor .. cursor + n - 1 of the endless shuffled stream."""
    size = len(self.task_ids)
    out = []
    position = cursor
    while len(out) < n:
      epoch, offset = divmod(position, size)
      chunk = self._epoch(epoch)[offset:offset + n - len(out)]
      out.extend(int(t) for t in chunk)
      position += len(chunk)
    return out
