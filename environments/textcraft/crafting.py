"""TextCraft's crafting tree: Minecraft 1.16 crafting recipes as a dependency graph.

The rules follow AgentGym's agentenv-textcraft `CraftingTree` exactly, with one change: recipe
files are read in sorted file-name order (AgentGym iterates `os.listdir`, whose order depends
on the file system). The order matters, because a recipe that would close a dependency cycle
is dropped, which changes items' depths and so the goal list.

  * Only `crafting_shaped` and `crafting_shapeless` recipes count. A shaped recipe needs, per
    key, as many items as the key occurs in the pattern; a shapeless one counts repeated
    ingredients. A list of alternatives means its first entry.
  * A recipe whose single input is a `*_block` (e.g. iron ingots from an iron block) is
    skipped; so is one whose output already is a transitive input of one of its inputs.
  * A recipe's `group` becomes its output's tag (oak planks -> `minecraft:planks`); a recipe
    may ask for any item of a tag. An input tag that no craftable item carries becomes a
    plain, gettable item (`minecraft:oak_logs`).
  * Depth: 0 for an item without recipe, else the minimum over its recipes of (the maximum
    input depth + 1). Goals are the items with a recipe, stably sorted by depth.

The recipes ship as `data/recipes.json` (file name -> recipe JSON, sorted by file name; see
`data/README.md` for their origin and licence).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
from importlib import resources
from typing import Any

_PREFIX = "minecraft:"
_CRAFTING_TYPES = ("minecraft:crafting_shaped", "minecraft:crafting_shapeless")


# The names and field order of these two classes are part of the observation text: a failed
# craft answers "Could not find a valid recipe for ItemTagWithCount(item_tag=ItemTag(...),
# count=1)", the repr AgentGym's server prints.
@dataclasses.dataclass(frozen=True)
class ItemTag:
  """An item id (`minecraft:oak_planks`) or a tag (`minecraft:planks`); tag outputs have both."""

  tag: str | None = None
  item_id: str | None = None

  @property
  def name(self) -> str:
    return self.item_id or self.tag


@dataclasses.dataclass
class ItemTagWithCount:
  item_tag: ItemTag
  count: int


@dataclasses.dataclass(frozen=True)
class Recipe:
  input_items: tuple[ItemTagWithCount, ...]
  output_item: ItemTagWithCount

  @property
  def recipe_str(self) -> str:
    """The crafting-command line, e.g. "craft 4 oak planks using 1 oak logs"."""
    inputs = ", ".join(f"{i.count} {item_id_to_str(i.item_tag.name)}" for i in self.input_items)
    return (f"craft {self.output_item.count} {item_id_to_str(self.output_item.item_tag.name)} "
            f"using {inputs}")


def item_id_to_str(item_id: str) -> str:
  """`minecraft:dark_oak_planks` -> `dark oak planks`."""
  return item_id.replace(_PREFIX, "").replace("_", " ")


def _ingredient(entry: Any) -> tuple[str, bool]:
  """(name, is_tag) of a recipe ingredient; a list of alternatives means its first entry."""
  if isinstance(entry, list):
    entry = entry[0]
  if "item" in entry:
    return entry["item"], False
  if "tag" in entry:
    return entry["tag"], True
  raise ValueError(f"TextCraft recipe ingredient {entry!r} has neither 'item' nor 'tag'.")


class CraftingTree:
  """Recipes by output item and by output tag, with the cycle and depth rules above."""

  def __init__(self, recipes: dict[str, dict[str, Any]]):
    """`recipes`: recipe file stem -> recipe JSON, in the order they are to be loaded."""
    self.item_recipes: dict[str, list[Recipe]] = {}
    self.tag_recipes: dict[str, list[Recipe]] = {}
    self.item_set: set[str] = set()
    self.tag_set: set[str] = set()
    self.item_to_tag: dict[str, str] = {}
    self._dependencies: dict[str, set[str]] = {}
    self._depth: dict[str, int] = {}
    for details in recipes.values():
      self._add_recipe(details)
    self._untag_uncraftable_inputs()

  # ----- loading ---------------------------------------------------------------------------

  def _inputs(self, details: dict[str, Any]) -> list[ItemTagWithCount]:
    counts: dict[tuple[str, bool], int] = {}
    if details["type"] == "minecraft:crafting_shaped":
      for key, entry in details["key"].items():
        name = _ingredient(entry)
        counts[name] = sum(line.count(key) for line in details["pattern"])
    else:
      for entry in details["ingredients"]:
        name = _ingredient(entry)
        counts[name] = counts.get(name, 0) + 1
    inputs = []
    for (name, is_tag), count in counts.items():
      (self.tag_set if is_tag else self.item_set).add(name)
      inputs.append(ItemTagWithCount(ItemTag(tag=name) if is_tag else ItemTag(item_id=name), count))
    return inputs

  def _add_recipe(self, details: dict[str, Any]) -> None:
    if details["type"] not in _CRAFTING_TYPES:
      return
    inputs = self._inputs(details)
    result = details["result"]
    if isinstance(result, str):
      output_id, output_count = result, 1
    else:
      output_id, output_count = result["item"], result.get("count") or 1
    self.item_set.add(output_id)
    if len(inputs) == 1 and inputs[0].item_tag.name.endswith("_block"):
      return
    output_tag = None
    if "group" in details:
      output_tag = _PREFIX + details["group"]
      if output_tag != output_id:
        self.tag_set.add(output_tag)
        self.item_to_tag[output_id] = output_tag
    recipe = Recipe(tuple(inputs), ItemTagWithCount(ItemTag(output_tag, output_id), output_count))

    dependencies = self._dependencies.setdefault(output_id, set())
    names = [i.item_tag.name for i in inputs]
    if any(output_id in self._dependencies.get(name, ()) for name in names):
      return  # would close a cycle
    self.item_recipes.setdefault(output_id, []).append(recipe)
    for name in names:
      dependencies.add(name)
      dependencies.update(self._dependencies.get(name, ()))
    if output_tag is not None:
      self.tag_recipes.setdefault(output_tag, []).append(recipe)

  def _untag_uncraftable_inputs(self) -> None:
    """An input tag that no craftable item carries becomes a plain (gettable) item."""
    untagged = set()
    for recipes in self.item_recipes.values():
      for recipe in recipes:
        for item in recipe.input_items:
          tag = item.item_tag.tag
          if item.item_tag.item_id is None and not any(
              i in self.item_recipes for i in self.items_with_tag(tag)):
            item.item_tag = ItemTag(item_id=tag)
            untagged.add(tag)
    self.item_set |= untagged
    self.tag_set -= untagged

  # ----- queries ---------------------------------------------------------------------------

  def items_with_tag(self, tag: str) -> list[str]:
    return [item for item, item_tag in self.item_to_tag.items() if item_tag == tag]

  def is_craftable(self, name: str) -> bool:
    return name in self.item_recipes or name in self.tag_recipes

  def is_gettable(self, item_id: str) -> bool:
    """Whether `get N <item>` works: a known item without recipe that is not a tag."""
    return (item_id in self.item_set and item_id not in self.tag_set and
            not self.is_craftable(item_id))

  def recipes_for(self, name: str) -> list[Recipe]:
    return self.item_recipes.get(name) or self.tag_recipes.get(name) or []

  def min_depth(self, name: str) -> int:
    if name not in self._depth:
      recipes = self.recipes_for(name)
      self._depth[name] = min(
          (max(self.min_depth(i.item_tag.name) + 1 for i in r.input_items) for r in recipes),
          default=0)
    return self._depth[name]

  def goals(self) -> list[str]:
    """Every craftable item, stably sorted by depth: task N's goal is `goals()[N % len]`."""
    return sorted(self.item_recipes, key=self.min_depth)

  def craft(self, request: Recipe) -> ItemTagWithCount | None:
    """The output of the first recipe for `request`'s output item whose inputs the request
    names exactly (same items, or items of a slot's tag, with the same counts); else None."""
    for recipe in self.item_recipes.get(request.output_item.item_tag.item_id, ()):
      offered = list(request.input_items)
      for slot in recipe.input_items:
        match = self._find_matching(slot.item_tag, offered)
        if match is None or match.count != slot.count:
          break
        offered.remove(match)
      else:
        if not offered:
          return recipe.output_item
    return None

  def _find_matching(self, slot: ItemTag, offered: list[ItemTagWithCount]):
    for item in offered:
      if slot.item_id is not None:
        if item.item_tag.item_id == slot.item_id:
          return item
      elif (item.item_tag.tag == slot.tag or
            self.item_to_tag.get(item.item_tag.item_id) == slot.tag):
        return item
    return None

  def recipe_tree(self, name: str) -> list[Recipe]:
    """Every recipe that can take part in crafting `name`, depth first, each once."""
    recipes: list[Recipe] = []
    seen_items: set[str] = set()

    def visit(item: str) -> None:
      if item in seen_items:
        return
      seen_items.add(item)
      for recipe in self.recipes_for(item):
        if recipe not in recipes:
          recipes.append(recipe)
        for i in recipe.input_items:
          visit(i.item_tag.name)

    visit(name)
    return recipes

  @functools.cached_property
  def item_uses(self) -> dict[str, list[Recipe]]:
    """Input name -> every recipe (by item, then by tag) that consumes it."""
    uses: dict[str, list[Recipe]] = {}
    for table in (self.item_recipes, self.tag_recipes):
      for recipes in table.values():
        for recipe in recipes:
          for i in recipe.input_items:
            uses.setdefault(i.item_tag.name, []).append(recipe)
    return uses

  # ----- the expert ------------------------------------------------------------------------

  def concrete_item(self, slot: ItemTag) -> str:
    """An item to put in `slot`: the slot's item, or the shallowest obtainable item of its tag
    (ties broken by name)."""
    if slot.item_id is not None:
      return slot.item_id
    candidates = [i for i in self.items_with_tag(slot.tag)
                  if i in self.item_recipes or self.is_gettable(i)]
    if not candidates:
      raise ValueError(f"No obtainable item carries tag {slot.tag}.")
    return min(candidates, key=lambda i: (self.min_depth(i), i))

  def easiest_recipe(self, item_id: str) -> Recipe | None:
    """The first recipe of least depth for `item_id`; None for a gettable item."""
    recipes = self.item_recipes.get(item_id)
    if not recipes:
      return None
    return min(recipes, key=lambda r: max(
        self.min_depth(self.concrete_item(i.item_tag)) for i in r.input_items))

  def plan(self, goal: str, inventory: dict[str, int]) -> list[str]:
    """Actions that craft `goal` from `inventory` (item id -> count), first action first.

    Gets base items in the exact amounts needed and crafts along the easiest recipes. Each
    item's easiest recipe uses only shallower items, so acquiring a recipe's inputs deepest
    first never consumes an input gathered before.
    """
    inventory = collections.Counter(inventory)
    actions: list[str] = []

    def acquire(item_id: str, count: int) -> None:
      missing = count - inventory[item_id]
      if missing <= 0:
        return
      recipe = self.easiest_recipe(item_id)
      if recipe is None:
        actions.append(f"get {missing} {item_id_to_str(item_id)}")
        inventory[item_id] += missing
        return
      times = math.ceil(missing / recipe.output_item.count)
      slots = [(self.concrete_item(i.item_tag), i.count) for i in recipe.input_items]
      needed = collections.Counter()
      for concrete, slot_count in slots:
        needed[concrete] += slot_count
      for concrete in sorted(needed, key=self.min_depth, reverse=True):
        acquire(concrete, needed[concrete] * times)
      inputs = ", ".join(f"{n} {item_id_to_str(c)}" for c, n in slots)
      command = (f"craft {recipe.output_item.count} {item_id_to_str(item_id)} using {inputs}")
      for _ in range(times):
        actions.append(command)
        inventory.subtract(needed)
        inventory[item_id] += recipe.output_item.count

    acquire(goal, 1)
    return actions


@functools.cache
def default_tree() -> CraftingTree:
  """The tree over the shipped Minecraft 1.16 recipes (built once per process, ~50 ms)."""
  text = resources.files("environments.textcraft").joinpath("data/recipes.json").read_text()
  return CraftingTree(json.loads(text))
