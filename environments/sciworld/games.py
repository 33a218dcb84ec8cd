"""AgentGym's 4,639-game index for ScienceWorld: task id -> (task name, variation).

AgentGym's SciWorld server numbers every (task, variation) pair of ScienceWorld: it walks
ScienceWorld's task table in `tasks.json` order, skips the seven tasks
{5-1, 5-2, 9-1, 9-2, 9-3, 10-1, 10-2} (grow-plant, grow-fruit, the inclined-plane and the
mendelian-genetics tasks), and appends `(task_name, variation)` for every variation of every
remaining task. A task id N is an index into that list. `data/games.json` stores the list in
compressed form (one row per task: name, number of variations, first index); it is derived
from scienceworld's own tables by `build_index` and rebuilt, with the splits, by
`python -m environments.sciworld.build_data`.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

# ScienceWorld task ids that AgentGym's server leaves out of its index.
SKIPPED_TASK_IDS = ("5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2")
NUM_GAMES = 4639


@functools.cache
def task_table() -> tuple[dict[str, Any], ...]:
  """The shipped index rows: {"task_id", "task_name", "num_variations", "first_index"}."""
  with resources.files(__package__).joinpath("data/games.json").open() as f:
    return tuple(json.load(f)["tasks"])


def game(task_id: int) -> tuple[str, int]:
  """(ScienceWorld task name, variation index) of AgentGym game `task_id`.

  Raises:
    ValueError: `task_id` is outside [0, 4639).
  """
  if not 0 <= task_id < NUM_GAMES:
    raise ValueError(f"SciWorld task_id must be in [0, {NUM_GAMES}), got {task_id}.")
  for row in reversed(task_table()):
    if task_id >= row["first_index"]:
      return row["task_name"], task_id - row["first_index"]
  raise AssertionError("unreachable: the first row starts at index 0")


def build_index(sw) -> list[dict[str, Any]]:
  """The index rows, read from a live `scienceworld.ScienceWorldEnv` `sw` (needs the JVM)."""
  rows, first = [], 0
  for task_id, task_name in sw.tasks.items():  # tasks.json order, as AgentGym iterates it
    if task_id in SKIPPED_TASK_IDS:
      continue
    count = int(sw.get_max_variations(task_name))
    rows.append({"task_id": task_id, "task_name": task_name, "num_variations": count,
                 "first_index": first})
    first += count
  return rows
