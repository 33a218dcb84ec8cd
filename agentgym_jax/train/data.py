"""The order in which training tasks are drawn: shuffled epochs over a split, by cursor.

The stream of task ids is a pure function of (task ids, seed): epoch e is a permutation drawn
from seed and e, and epochs are concatenated. A step takes the next `batch` ids at the cursor,
so the whole data-order state is one integer, saved with each checkpoint; a resumed run draws
exactly the tasks the uninterrupted run would have drawn.

A run over several environments draws from `MixtureStream`: position p of its stream goes to
the environment furthest behind its share (ratio x (p + 1) minus the positions it has had),
which then gives its own stream's next id. Every stretch of positions, each batch among them,
holds each environment's share rounded down or up, and the state is still the one cursor.
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


class MixtureStream:
  """Several `TaskStream`s mixed by ratio, read like one: `take(cursor, n)`.

  Position p goes to stream argmax_i (ratio_i * (p + 1) - c_i(p)), where c_i(p) counts the
  positions before p that went to stream i (ties to the lower i), and takes that stream's
  next id, at position c_i(p) of it. Any n consecutive positions then hold floor or ceil of
  ratio_i * n of stream i's ids (the ratios summing to 1), and the order is a pure function of
  the position: one cursor resumes the mixture. Ratios (1/2, 1/4, 1/4) give 0, 1, 2, 0 and
  again, so each batch of 4 tasks holds 2, 1 and 1; ratios (3/4, 1/4) give 0, 0, 1, 0, so
  batches of 2 hold 2 + 0, then 1 + 1.

  Args:
    streams: one stream per environment, its ids already the mixed run's (`Member.encode`).
    ratios: each stream's share, > 0, summing to 1.
  """

  def __init__(self, streams: Sequence[TaskStream], ratios: Sequence[float]):
    if len(streams) != len(ratios) or not streams:
      raise ValueError(f"MixtureStream needs one ratio per stream, got {len(ratios)} ratios "
                       f"for {len(streams)} streams.")
    if min(ratios) <= 0 or not np.isclose(sum(ratios), 1.0):
      raise ValueError(f"Mixture ratios must be > 0 and sum to 1, got {list(ratios)}.")
    self.streams, self.ratios = list(streams), np.asarray(ratios, np.float64)
    # owners[p]: the stream of position p; rank[p]: p's position in that stream. Extended as
    # far as a take reads.
    self._owners: list[int] = []
    self._ranks: list[int] = []
    self._counts = np.zeros(len(streams), np.int64)

  def _extend(self, end: int) -> None:
    while len(self._owners) < end:
      p = len(self._owners)
      owner = int(np.argmax(self.ratios * (p + 1) - self._counts))
      self._owners.append(owner)
      self._ranks.append(int(self._counts[owner]))
      self._counts[owner] += 1

  def owners(self, cursor: int, n: int) -> list[int]:
    """The stream (environment) index of positions cursor .. cursor + n - 1."""
    self._extend(cursor + n)
    return self._owners[cursor:cursor + n]

  def take(self, cursor: int, n: int) -> list[int]:
    """Ids at positions cursor .. cursor + n - 1 of the mixed stream."""
    self._extend(cursor + n)
    return [self.streams[owner].take(rank, 1)[0]
            for owner, rank in zip(self._owners[cursor:cursor + n],
                                   self._ranks[cursor:cursor + n])]
