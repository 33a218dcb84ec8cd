"""BabyAI observations as text and macro actions, as AgentGym's agentenv-babyai builds them.

`render` turns the agent's 7x7 egocentric view into a description and the set of actions
available now, each a list of minigrid primitives (0 left, 1 right, 2 forward, 3 pickup,
4 drop, 5 toggle). Everything here reproduces the upstream server's rules, quirks included:

  * Cells are scanned from the farthest row to the agent's row, left to right; cells with a
    negative coordinate and the agent's own cell are skipped. Doors, keys, balls, boxes, goals,
    lava and walls are kept with their Manhattan distance and stably sorted by it. Equal names
    are numbered 1, 2, ... in that order.
  * A path is a breadth-first search over (position, direction) with moves [forward, left,
    right], confined to an 8x7 window derived from the view (one row or column wider than the
    view on some sides), blocked by walls, boxes, lava, balls and keys but not by doors or
    unseen cells. States are marked visited when dequeued and a state's parent is overwritten
    each time it is enqueued, as upstream does; this decides which of several shortest paths
    a macro takes, and so its primitive count and reward.
  * `pickup X k` and `go to X k` number only the objects of that name that have a path, so k
    can differ from the description's number; doors are numbered over all doors of the name.

Action names: "turn left", "turn right", "move forward", "pickup <color> <type> <k>", "drop",
"go through <color> open door <k>", "toggle and go through <color> closed|locked door <k>",
"toggle", "go to goal", "go to <name> <k>" and "check available actions".
One upstream message is fixed: the no-path error of "toggle and go through" printed a Python
dict (`red closed door {'red closed door': 1}`); we print the action's name instead.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
from minigrid.core.constants import DIR_TO_VEC, IDX_TO_COLOR, IDX_TO_OBJECT, STATE_TO_IDX

LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE = range(6)

_IDX_TO_STATE = {index: state for state, index in STATE_TO_IDX.items()}
_VISIBLE_TYPES = ("door", "key", "ball", "box", "goal", "lava", "wall")
_BLOCKING_TYPES = ("wall", "box", "lava", "ball", "key")  # for paths and for dropping
DIRS = [tuple(int(c) for c in v) for v in DIR_TO_VEC]
CHECK = "check available actions"


@dataclasses.dataclass(frozen=True)
class Seen:
  """One visible object: `name` is "<color> <type>" or "<color> <state> door"."""

  name: str
  type: str
  pos: tuple[int, int]
  distance: int


@dataclasses.dataclass
class View:
  """A rendered observation: the description, and each available action's primitives."""

  description: str
  actions: dict[str, list[int]]
  errors: dict[str, str]  # specific refusals for known-but-impossible actions

  def actions_text(self) -> str:
    """`Available actions: ["turn left", ...]`, the line that ends every observation."""
    return "Available actions: [" + ", ".join(f'"{a}"' for a in self.actions) + "]"


def _window(top_left: np.ndarray, f: np.ndarray, r: np.ndarray, view: int):
  """The coordinate ranges a path may use (upstream's arithmetic, asymmetry included)."""
  border = top_left + view * (r - f)
  ranges = []
  for axis in range(2):
    if border[axis] < top_left[axis]:
      ranges.append(range(int(border[axis]), int(top_left[axis]) + 1))
    else:
      ranges.append(range(int(top_left[axis]), int(border[axis])))
  return ranges[0], ranges[1]


def find_path(start: tuple[int, int], direction: int, target: tuple[int, int],
              blocked: set[tuple[int, int]], window, arrive: bool) -> list[int] | None:
  """Primitives that bring the agent onto `target` (arrive) or facing it; None if no path."""
  window_x, window_y = window
  parents: dict[tuple, tuple] = {}
  visited = set()
  queue = collections.deque([(start, direction)])
  while queue:
    state = queue.popleft()
    visited.add(state)
    (x, y), d = state
    if (target == (x, y)) if arrive else (target == (x + DIRS[d][0], y + DIRS[d][1])):
      path = []
      while state != (start, direction):
        state, action = parents[state]
        path.append(action)
      return path[::-1]
    for action in (FORWARD, LEFT, RIGHT):
      if action == FORWARD:
        nxt = ((x + DIRS[d][0], y + DIRS[d][1]), d)
      else:
        nxt = ((x, y), (d + (1 if action == RIGHT else -1)) % 4)
      pos = nxt[0]
      if (pos[0] not in window_x or pos[1] not in window_y or nxt in visited or
          pos in blocked):
        continue
      queue.append(nxt)
      parents[nxt] = (state, action)
  return None


def _relative(front: int, right: int) -> str:
  if right == 0:
    return f"right in front of you {front} steps away. "
  side = "right" if right > 0 else "left"
  return f"{front} steps in front of you and {abs(right)} steps to your {side}. "


def render(env, image: np.ndarray) -> View:
  """Describes `env`'s current view and lists the actions available in it.

  Args:
    env: the unwrapped minigrid BabyAI env (agent pose, carried object).
    image: the observation's `image`, [view, view, 3] (object, color, state) indices.
  """
  view = env.agent_view_size
  pos = np.array(env.agent_pos)
  d = int(env.agent_dir)
  f, r = np.array(DIRS[d]), np.array(DIRS[(d + 1) % 4])
  top_left = pos + f * (view - 1) - r * (view // 2)
  window = _window(top_left, f, r, view)

  seen: list[Seen] = []
  barriers: list[tuple[str, int]] = []  # walls and boxes straight ahead: (type, distance)
  for j in range(view):
    for i in range(view):
      x, y = (int(c) for c in top_left - f * j + r * i)
      distance = abs(int(pos[0]) - x) + abs(int(pos[1]) - y)
      if x < 0 or y < 0 or distance == 0:
        continue
      obj_type = IDX_TO_OBJECT[int(image[i, j, 0])]
      if obj_type not in _VISIBLE_TYPES:
        continue
      color = IDX_TO_COLOR[int(image[i, j, 1])]
      if obj_type == "door":
        name = f"{color} {_IDX_TO_STATE[int(image[i, j, 2])]} door"
      else:
        name = f"{color} {obj_type}"
      seen.append(Seen(name, obj_type, (x, y), distance))
      rel = (x - int(pos[0]), y - int(pos[1]))
      if obj_type in ("box", "wall") and f[0] * rel[1] - f[1] * rel[0] == 0:
        barriers.append((obj_type, int(f[0] * rel[0] + f[1] * rel[1])))
  seen.sort(key=lambda s: s.distance)
  barriers.sort(key=lambda b: b[1])

  # ----- description -----------------------------------------------------------------------
  if seen:
    parts = ["In front of you in this room, you can see several objects: "]
    numbers = collections.Counter()
    for s in seen:
      if s.type == "wall":
        continue
      rel = (s.pos[0] - int(pos[0]), s.pos[1] - int(pos[1]))
      front = int(f[0] * rel[0] + f[1] * rel[1])
      right = int(r[0] * rel[0] + r[1] * rel[1])
      numbers[s.name] += 1
      parts.append(f"There is a {s.name} {numbers[s.name]} {_relative(front, right)} ")
    description = "".join(parts)
  else:
    description = "You cannot see any objects within sight."
  description += "The room has walls around you. "
  if barriers:
    description += f"You are facing a {barriers[0][0]} {barriers[0][1]} steps away. "
  carrying = env.carrying
  if carrying is not None:
    description += f"You are carrying a {carrying.color} {carrying.type}."
  else:
    description += "You are not carrying anything."

  # ----- actions ---------------------------------------------------------------------------
  blocked = {s.pos for s in seen if s.type in _BLOCKING_TYPES}
  paths: dict[tuple, list[int] | None] = {}

  def path_to(target: tuple[int, int], arrive: bool) -> list[int] | None:
    if (target, arrive) not in paths:
      paths[(target, arrive)] = find_path(
          (int(pos[0]), int(pos[1])), d, target, blocked, window, arrive)
    found = paths[(target, arrive)]
    return None if found is None else list(found)

  actions: dict[str, list[int]] = {"turn left": [LEFT], "turn right": [RIGHT]}
  errors: dict[str, str] = {}
  if not barriers or barriers[0][1] > 1:
    actions["move forward"] = [FORWARD]
  else:
    errors["move forward"] = "There is a barrier in front of you, you can't move forward."

  def add_numbered(verb: str, candidates: list[Seen], suffix: list[int]) -> None:
    count = collections.Counter()
    for s in candidates:
      path = path_to(s.pos, arrive=False)
      first = f"{verb} {s.name} 1"
      k = 1 if first not in actions else count[s.name] + 1
      if path is not None:
        count[s.name] = k
        actions[f"{verb} {s.name} {k}"] = path + suffix
      else:
        errors[f"{verb} {s.name} {k}"] = (
            f"You cannot {verb} {s.name} {k}, as there is no path leading to it.")

  if carrying is None:
    add_numbered("pickup", [s for s in seen if s.type not in ("wall", "door", "goal")],
                 [PICKUP])
    errors["drop"] = "You cannot drop the object, as you are not carrying anything."
  else:
    front_cell = (int(pos[0] + f[0]), int(pos[1] + f[1]))
    if any(s.pos == front_cell and s.type in _BLOCKING_TYPES for s in seen):
      errors["drop"] = "You cannot drop the object, as there is already an object in front of you."
    else:
      actions["drop"] = [DROP]

  doors = collections.Counter()
  for s in seen:
    if s.type != "door":
      continue
    doors[s.name] += 1
    label = f"{s.name} {doors[s.name]}"
    state = s.name.split(" ")[1]
    if state == "open":
      path = path_to(s.pos, arrive=True)
      if path is not None:
        actions[f"go through {label}"] = path
      else:
        errors[f"go through {label}"] = (
            f"You cannot go through {label}, as there is no path leading to it.")
      continue
    if state == "locked":
      if carrying is None or carrying.type != "key":
        errors[f"toggle and go through {label}"] = (
            f"You cannot toggle and go through {label}, as you are not carrying a key.")
        continue
      if carrying.color != s.name.split(" ")[0]:
        errors[f"toggle and go through {label}"] = (
            f"You cannot toggle and go through {label}, as the color of the key you are "
            "carrying does not match the color of door.")
        continue
    path = path_to(s.pos, arrive=False)
    if path is not None:
      actions[f"toggle and go through {label}"] = path + [TOGGLE, FORWARD]
      if not path:
        actions["toggle"] = [TOGGLE]
    else:
      errors[f"toggle and go through {label}"] = (
          f"You cannot toggle and go through {label}, as there is no path leading to it.")
    if state == "closed":
      errors[f"go through {label}"] = (
          f"You cannot go through {label}, as it is closed. You should toggle it first.")

  for s in seen:
    if s.type == "goal":
      path = path_to(s.pos, arrive=True)
      if path is not None:
        actions["go to goal"] = path
      else:
        errors["go to goal"] = "You cannot go to the goal, as there is no path leading to it."

  add_numbered("go to", [s for s in seen if s.type not in ("wall", "goal")], [])
  actions[CHECK] = []
  return View(description, actions, errors)
