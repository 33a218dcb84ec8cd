"""TextCraft (AgentGym's agentenv-textcraft) as a `TextEnv`: craft a Minecraft item in text.

Task id N -> goal `goals[N % 544]`, the craftable items stably sorted by recipe depth (see
`crafting.py`; recipe files load in sorted order, so the 544 goals number 125/291/117/11 at
depths 1/2/3/4). The first observation lists crafting commands and the goal:

  Crafting commands:
  craft 1 birch button using 1 birch planks
  ...

  Goal: craft birch boat.

The commands are every recipe that can take part in crafting the goal plus up to 10
distractors (recipes that consume one of those ingredients), shuffled. AgentGym draws them with
`random.seed(42)` but iterates Python sets of strings, so its text changes with
PYTHONHASHSEED. We run the same draws with a `random.Random(42)` of our own over sorted lists
instead of sets: an instance depends only on its goal, in every process.

Actions (after AgentGym's client-side extraction, `parse_action`), tried as prefixes:
  * `craft [N] <item> using <N> <item>, <N> <item>, ...`: the inputs must match one recipe of
    the item exactly (counts equal, no extras, any order; a tag slot such as "planks" takes a
    concrete item such as "oak planks"). The output count typed is ignored. Answers
    "Crafted 4 minecraft:oak_planks", "Could not find enough items to craft minecraft:X",
    "Could not find a valid recipe for ItemTagWithCount(...)" or "Wrong item format: <piece>".
  * `get <N> <item>`: any item without a recipe, in any amount: "Got N <item>", else
    "Could not find <item>".
  * `inventory`: "Inventory: [oak planks] (4) " or "Inventory: You are not carrying anything."
  * anything else: "Could not execute <action>" (also for the empty action).
A response with more than one "Action:" gets AgentGym's client error and changes nothing.

Reward 1 and termination when a craft produces the goal; 0 otherwise (failures never end an
episode; the rollout's turn limit does). Rewards are the same in both reward modes.
Deviations from AgentGym: a craft that names one item twice needs the sum of those counts in
the inventory (AgentGym checks each entry alone and then fails while removing them); a count
of more than 9 digits is refused with a message (AgentGym's int() could raise).
"""

from __future__ import annotations

import random
import re
from typing import Any

from environments.base import (MULTIPLE_ACTIONS, MULTIPLE_ACTIONS_OBSERVATION, ReActEnv,
                               parse_single_action)
from environments.textcraft import crafting
from environments.textcraft.crafting import ItemTag, ItemTagWithCount, Recipe, item_id_to_str

INSTRUCTION = (
    "You are crafting items in Minecraft. Each task gives you some crafting commands of the "
    "form \"craft [target object] using [input ingredients]\" and a goal item to craft.\n"
    "Every round I give you an observation and you answer with your next action. You can "
    "\"get\" an ingredient (from your inventory or from the environment; do not say which), "
    "look at what you carry with \"inventory\", or \"craft\" a target with one of the crafting "
    "commands.\n"
    "Answer strictly in this format:\"Thought:\nyour thoughts.\n\nAction:\nyour next action\"\n\n"
    "Remember:\n"
    "1. Always give the quantity in \"get\" and \"craft\". Examples: get 1 lapis lazuli; craft "
    "1 blue dye using 1 lapis lazuli; craft 1 golden carrot using 8 gold nugget, 1 carrot\n"
    "2. Use only the crafting commands given. Where a command asks for a generic ingredient "
    "such as \"planks\", name a specific kind instead, e.g. \"dark oak planks\".\n\n")

DISTRACTORS = 10  # AgentGym's `max_distractor`
_SEED = 42  # AgentGym reseeds `random` with 42 at every reset
_MAX_COUNT_DIGITS = 9  # beyond this Python's int() may refuse the string; no recipe needs it

_CRAFT = re.compile(r"craft (.*) using (.*)")
_GET = re.compile(r"get ([0-9]+) (.*)")
_INVENTORY = re.compile(r"inventory")
_COUNT = re.compile(r"([0-9]+) (.*)")


class _ActionFailed(Exception):
  """An action that does not apply; its message is the observation."""


def commands_for(tree: crafting.CraftingTree, goal: str) -> list[str]:
  """The crafting-command lines shown for `goal`: its recipe tree plus distractors, shuffled.

  AgentGym's draws (`random.sample` of up to 10 uses per ingredient of every recipe, then 10
  distractors, then a shuffle) with a fixed-seed generator over sorted lists.
  """
  rng = random.Random(_SEED)
  recipes = tree.recipe_tree(goal)
  candidates = []
  for recipe in recipes:
    for item in recipe.input_items:
      uses = tree.item_uses.get(item.item_tag.name, [])
      candidates.extend(rng.sample(uses, min(len(uses), DISTRACTORS)))
  needed = sorted({r.recipe_str for r in recipes})
  distractors = sorted({r.recipe_str for r in candidates} - set(needed))
  commands = needed + rng.sample(distractors, min(len(distractors), DISTRACTORS))
  rng.shuffle(commands)
  return commands


class TextCraftEnv(ReActEnv):
  """Craft `goals[task_id % 544]` from the listed crafting commands."""

  name = "textcraft"
  instruction = INSTRUCTION
  expert_thought = "I follow the crafting plan."

  def __init__(self, reward_mode: str = "normalized"):
    super().__init__(reward_mode)
    self.tree = crafting.default_tree()
    self.goals = self.tree.goals()
    self.goal: str | None = None
    self.commands: list[str] = []
    self.inventory: dict[str, int] = {}  # item id -> count, in the order items arrived

  # ----- TextEnv ---------------------------------------------------------------------------

  def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
    if task_id < 0:
      raise ValueError(f"textcraft: task ids are >= 0, got {task_id}.")
    self.goal = self.goals[task_id % len(self.goals)]
    self.commands = commands_for(self.tree, self.goal)
    self.inventory = {}
    observation = ("Crafting commands:\n" + "\n".join(self.commands) +
                   f"\n\nGoal: craft {item_id_to_str(self.goal)}.")
    depth = self.tree.min_depth(self.goal)
    return observation, {"goal": self.goal, "depth": depth, "category": f"depth{depth}"}

  def _step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
    if action == MULTIPLE_ACTIONS:
      return (MULTIPLE_ACTIONS_OBSERVATION, 0.0, False, False,
              self._info(False) | {"invalid_action": True})
    invalid = False
    try:
      observation, success = self._apply(action)
    except _ActionFailed as failure:
      observation, success, invalid = str(failure), False, True
    reward = 1.0 if success else 0.0
    return observation, reward, success, False, self._info(success) | {"invalid_action": invalid}

  # AgentGym's TextCraft client, as BabyAI's: the single "Action:" line, reduced to
  # [A-Za-z0-9, ].
  parse_action = staticmethod(parse_single_action)

  def expert_action(self) -> str:
    """The next step of a plan that gets base items and crafts along the easiest recipes."""
    if self.goal is None:
      raise RuntimeError("textcraft: call reset() before expert_action().")
    plan = self.tree.plan(self.goal, self.inventory)
    return plan[0] if plan else "inventory"

  def random_action(self, rng: random.Random) -> str:
    """A listed crafting command, or getting one of the items such a command uses."""
    command = rng.choice(self.commands)
    if rng.random() < 0.5:
      return command
    ingredient = rng.choice(command.split(" using ", 1)[1].split(", "))
    return "get " + ingredient

  # ----- the game --------------------------------------------------------------------------

  def _info(self, success: bool) -> dict[str, Any]:
    return {"success": success, "score": 1.0 if success else 0.0, "goal": self.goal}

  def _apply(self, action: str) -> tuple[str, bool]:
    """(observation, whether the goal was crafted); raises _ActionFailed."""
    if match := _CRAFT.match(action):
      return self._craft(match.group(1), match.group(2))
    if match := _GET.match(action):
      item, amount = match.group(2), _count(match.group(1), action)
      item_tag = self._item(item)
      if item_tag.item_id is None or not self.tree.is_gettable(item_tag.item_id):
        raise _ActionFailed(f"Could not find {item}")
      self._add(item_tag.item_id, amount)
      return f"Got {amount} {item}", False
    if _INVENTORY.match(action):
      if not self.inventory:
        return "Inventory: You are not carrying anything.", False
      return "Inventory: " + "".join(
          f"[{item_id_to_str(i)}] ({n}) " for i, n in self.inventory.items()), False
    raise _ActionFailed(f"Could not execute {action}")

  def _craft(self, output: str, inputs: str) -> tuple[str, bool]:
    if match := _COUNT.match(output):
      output_count, output = _count(match.group(1), output), match.group(2)
    else:
      output_count = 1
    request_inputs = []
    for piece in inputs.split(","):
      match = _COUNT.match(piece.strip())
      if not match:
        raise _ActionFailed(f"Wrong item format: {piece.strip()}")
      request_inputs.append(
          ItemTagWithCount(self._item(match.group(2)), _count(match.group(1), piece)))
    request = Recipe(tuple(request_inputs), ItemTagWithCount(self._item(output), output_count))
    needed: dict[str | None, int] = {}
    for item in request.input_items:
      needed[item.item_tag.item_id] = needed.get(item.item_tag.item_id, 0) + item.count
    if any(i is None or self.inventory.get(i, 0) < n for i, n in needed.items()):
      raise _ActionFailed(
          f"Could not find enough items to craft {request.output_item.item_tag.item_id}")
    crafted = self.tree.craft(request)
    if crafted is None:
      raise _ActionFailed(f"Could not find a valid recipe for {request.output_item}")
    for item_id, count in needed.items():
      self.inventory[item_id] -= count
      if self.inventory[item_id] == 0:
        del self.inventory[item_id]
    self._add(crafted.item_tag.item_id, crafted.count)
    return (f"Crafted {crafted.count} {crafted.item_tag.item_id}",
            crafted.item_tag.item_id == self.goal)

  def _item(self, text: str) -> ItemTag:
    """Typed item name -> item or tag (`dark oak planks` -> `minecraft:dark_oak_planks`)."""
    name = "minecraft:" + text.replace(" ", "_")
    return ItemTag(tag=name) if name in self.tree.tag_set else ItemTag(item_id=name)

  def _add(self, item_id: str, count: int) -> None:
    self.inventory[item_id] = self.inventory.get(item_id, 0) + count


def _count(digits: str, context: str) -> int:
  if len(digits) > _MAX_COUNT_DIGITS:
    raise _ActionFailed(f"Could not execute {context}: counts have at most "
                        f"{_MAX_COUNT_DIGITS} digits.")
  return int(digits)
