"""Rebuilds the SciWorld package data: `data/games.json` and `data/splits.json`.

    python -m environments.sciworld.build_data     # ~2 min: it runs the gold path of test picks

Splits. AgentGym's own 200 test ids (`sciworld_test.json`) are not public, so we choose them:
  * test (200 ids): ScienceWorld's own *test* variations, taken round-robin over the 23 task
    types (lowest variation first), so every task type is tested on worlds ScienceWorld holds
    out. A variation is taken only if ScienceWorld's gold action sequence completes it within
    AgentGym's 100-move limit; otherwise the next one of the same task is tried. This keeps
    the test split's ceiling at 100% (the expert solves every test id). It drops some
    boil/melt/freeze/change-of-state variations, whose gold paths need 115-370 moves (mostly
    waiting while heating or cooling); those tasks stay in the test split with other variations.
  * train: all of ScienceWorld's *train* variations of the 23 task types, unfiltered.
ScienceWorld's dev variations are in neither and stay free for validation.
"""

from __future__ import annotations

import json
import pathlib

from environments.sciworld import games
from environments.sciworld.env import SciWorldEnv

NUM_TEST = 200


def expert_solves(env: SciWorldEnv, task_id: int) -> bool:
  """Whether the gold action sequence succeeds on `task_id` within the env's step limit."""
  env.reset(options={"task_id": task_id})
  for _ in range(10 * env.step_limit):  # free actions (look, examine) cost no move
    _, _, terminated, truncated, info = env.step(env.expert_action())
    if terminated or truncated:
      return bool(info["success"])
  return False


def build_splits(sw, env: SciWorldEnv, rows) -> dict[str, list[int]]:
  """Train/test task ids as the module docstring describes.

  Args:
    sw: a raw `scienceworld.ScienceWorldEnv`, for ScienceWorld's variation split (it reports
      a task's split only once the task is loaded).
    env: a `SciWorldEnv` with AgentGym's step limit, to run the expert on test candidates.
    rows: `games.build_index` rows.
  """
  train, pools = [], []
  for row in rows:
    sw.load(row["task_name"], 0, "")
    train += [row["first_index"] + v for v in sorted(sw.get_variations_train())]
    pools.append([row["first_index"] + v for v in sorted(sw.get_variations_test())])
  test = []
  while len(test) < NUM_TEST and any(pools):
    for pool in pools:
      while pool and len(test) < NUM_TEST:
        candidate = pool.pop(0)
        if expert_solves(env, candidate):
          test.append(candidate)
          break
  return {"train": sorted(train), "test": sorted(test)}


def main() -> None:
  import scienceworld

  data = pathlib.Path(__file__).parent / "data"
  sw = scienceworld.ScienceWorldEnv("", envStepLimit=100)
  try:
    rows = games.build_index(sw)
    total = sum(row["num_variations"] for row in rows)
    if total != games.NUM_GAMES:
      raise RuntimeError(f"scienceworld {scienceworld.__version__} gives {total} games, AgentGym "
                         f"has {games.NUM_GAMES}; the task tables differ, so ids would not match.")
    index = {"scienceworld_version": scienceworld.__version__,
             "skipped_task_ids": list(games.SKIPPED_TASK_IDS), "num_games": total, "tasks": rows}
    (data / "games.json").write_text(json.dumps(index, indent=1) + "\n")
    games.task_table.cache_clear()  # the env below must map ids with the index just written
    with SciWorldEnv() as env:
      splits = build_splits(sw, env, rows)
  finally:
    sw.close()
  (data / "splits.json").write_text(json.dumps(splits) + "\n")
  print(f"{total} games, {len(splits['train'])} train / {len(splits['test'])} test ids -> {data}")

if __name__ == "__main__":
  main()
