"""TextCraft: goal list, observation and reply formats, the expert, bad input, determinism."""

import fnmatch
import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

import environments
from environments.base import MULTIPLE_ACTIONS, MULTIPLE_ACTIONS_OBSERVATION
from environments.textcraft import crafting
from environments.textcraft.env import TextCraftEnv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BIRCH_BOAT = (  # task 140 (and 140 + 544k): every command line, in the order shown
    "Crafting commands:\n"
    "craft 1 birch button using 1 birch planks\n"
    "craft 4 birch planks using 1 birch logs\n"
    "craft 1 birch boat using 5 birch planks\n"
    "craft 3 birch door using 6 birch planks\n"
    "craft 4 birch stairs using 6 birch planks\n"
    "craft 3 birch fence using 2 stick, 4 birch planks\n"
    "craft 3 birch sign using 6 birch planks, 1 stick\n"
    "craft 6 birch slab using 3 birch planks\n"
    "\n"
    "Goal: craft birch boat.")


@pytest.fixture
def env():
  return TextCraftEnv()


def test_goal_list_matches_sorted_load_order():
  goals = crafting.default_tree().goals()
  tree = crafting.default_tree()
  depths = [tree.min_depth(g) for g in goals]
  # AgentGym's logic over files in sorted order: 125/291/117/11 goals at depths 1/2/3/4.
  assert [depths.count(d) for d in (1, 2, 3, 4)] == [125, 291, 117, 11]
  assert depths == sorted(depths)
  assert (goals[0], goals[124], goals[125], goals[140], goals[420], goals[533], goals[543]) == (
      "minecraft:acacia_planks", "minecraft:yellow_dye", "minecraft:acacia_boat",
      "minecraft:birch_boat", "minecraft:anvil", "minecraft:cyan_banner",
      "minecraft:purple_banner")
  # The whole list, checked once against shared/data/textcraft/derived/goals_sorted_listdir.json.
  assert hashlib.sha256("\n".join(goals).encode()).hexdigest() == (
      "69ba04d326e91a45da677566af9535e83ef1a09d73fd4a2b0c7d25d777eb76ef")


def test_recipe_rules():
  tree = crafting.default_tree()
  # A tag input no craftable item carries becomes a gettable item; planks stay a tag.
  assert tree.is_gettable("minecraft:birch_logs") and "minecraft:planks" in tree.tag_set
  assert tree.item_to_tag["minecraft:oak_planks"] == "minecraft:planks"
  # Block recipes are skipped: iron ingots come from nuggets only, so they are not gettable.
  ingots = [r.recipe_str for r in tree.item_recipes["minecraft:iron_ingot"]]
  assert ingots == ["craft 1 iron ingot using 9 iron nugget"]
  assert not tree.is_gettable("minecraft:iron_ingot")


def test_first_observation_and_info(env):
  observation, info = env.reset(options={"task_id": 140})
  assert observation == BIRCH_BOAT
  assert info["goal"] == "minecraft:birch_boat" and info["category"] == "depth2"
  assert info["task_id"] == 140 and info["instruction"] == env.instruction
  assert env.reset(options={"task_id": 140 + 2 * 544})[0] == BIRCH_BOAT
  assert env.reset(options={"task_id": 0})[0] == (
      "Crafting commands:\ncraft 4 acacia planks using 1 acacia logs\n\n"
      "Goal: craft acacia planks.")


def test_replies(env):
  env.reset(options={"task_id": 140})
  script = [
      ("inventory", "Inventory: You are not carrying anything."),
      ("get 1 birch planks", "Could not find birch planks"),  # craftable
      ("get 1 planks", "Could not find planks"),  # a tag
      ("get 1 unobtainium", "Could not find unobtainium"),
      ("get 2 birch logs", "Got 2 birch logs"),
      ("craft 99 birch planks using 1 birch logs", "Crafted 4 minecraft:birch_planks"),
      ("inventory", "Inventory: [birch logs] (1) [birch planks] (4) "),
      ("craft 1 birch boat using 5 birch planks",
       "Could not find enough items to craft minecraft:birch_boat"),
      ("craft 1 birch boat using 4 birch planks",
       "Could not find a valid recipe for ItemTagWithCount(item_tag=ItemTag(tag=None, "
       "item_id='minecraft:birch_boat'), count=1)"),
      ("craft 1 birch boat using five birch planks", "Wrong item format: five birch planks"),
      ("craft 4 stick using 2 planks", "Could not find enough items to craft minecraft:stick"),
      ("craft 4 stick using 2 birch planks", "Crafted 4 minecraft:stick"),
      ("dance", "Could not execute dance"),
      ("", "Could not execute "),
      ("craft 1 birch planks using 1 birch logs", "Crafted 4 minecraft:birch_planks"),
  ]
  for action, expected in script:
    observation, reward, terminated, truncated, info = env.step(action)
    assert (observation, reward, terminated, truncated) == (expected, 0.0, False, False), action
    assert info["success"] is False
    assert info["invalid_action"] is expected.startswith(("Could not", "Wrong")), action
  observation, reward, terminated, _, info = env.step("craft 1 birch boat using 5 birch planks")
  assert (observation, reward, terminated) == ("Crafted 1 minecraft:birch_boat", 1.0, True)
  assert info["success"] and info["score"] == 1.0
  assert env.inventory == {"minecraft:birch_boat": 1, "minecraft:stick": 4,
                           "minecraft:birch_planks": 1}


def test_action_extraction():
  parse = TextCraftEnv.parse_action
  assert parse("Thought:\nI need logs.\n\nAction:\nget 1 oak_log.") == "get 1 oaklog"
  assert parse("Action: craft 4 oak planks using 1 oak logs\nmore text") == (
      "craft 4 oak planks using 1 oak logs")
  assert parse("Action:   get   2  stick  ") == "get 2 stick"
  assert parse("Action: get 2\tstick") == "get 2stick"  # a tab is removed, not a space
  assert parse("I think so.") == ""
  assert parse("Action: get 1 a\nAction: get 1 b") == MULTIPLE_ACTIONS


def test_expert_solves_every_test_task(env):
  test_ids = environments.task_splits("textcraft")["test"]
  lengths = {}
  for task_id in test_ids:
    reward, info, actions = env.play_expert(task_id, max_steps=60)
    assert reward == 1.0 and info["success"], task_id
    lengths[task_id] = len(actions)
    for action in actions:
      assert TextCraftEnv.parse_action(TextCraftEnv.format_action(action)) == action
  # The anvil (task 420) needs 31 iron ingots crafted from nuggets: 37 actions.
  assert lengths[420] == 37 and max(lengths.values()) == 37


def test_expert_solves_every_goal(env):
  for task_id in range(544):
    reward, _, _ = env.play_expert(task_id, max_steps=60)
    assert reward == 1.0, task_id


def test_expert_continues_from_any_inventory(env):
  env.reset(options={"task_id": 140})
  assert env.expert_action() == "get 2 birch logs"  # 5 planks: two crafts of 4
  env.step("get 1 birch logs")
  assert env.expert_action() == "get 1 birch logs"
  env.step("get 2 birch logs")
  env.step("craft 4 birch planks using 1 birch logs")
  assert env.expert_action() == "craft 4 birch planks using 1 birch logs"
  env.step("craft 4 birch planks using 1 birch logs")
  assert env.expert_action() == "craft 1 birch boat using 5 birch planks"


BAD_RESPONSES = {
    "empty": "",
    "huge": "Action: " + "x" * 100_000,
    "not_utf8": b"Action: \xff\xfe\xfa\xc3\x28 craft \x80",
    "unicode": "Thought: 🤖\nAction: crâft 1 bïrch boat ușing 5 birch plänks ✓",
    "two_actions": "Action: get 1 birch logs\nAction: inventory",
    "babyai": "Action: go to red ball 1",
    "searchqa": "<search>birch boat recipe</search>",
    "sciworld": "Action: open door to kitchen",
}


@pytest.mark.parametrize("kind", sorted(BAD_RESPONSES))
def test_bad_input_is_answered_and_env_lives(env, kind):
  env.reset(options={"task_id": 140})
  action = TextCraftEnv.parse_action(BAD_RESPONSES[kind])
  observation, reward, terminated, truncated, info = env.step(action)
  assert isinstance(observation, str) and observation
  assert len(observation) < 10_000
  assert (reward, terminated, truncated, info["success"]) == (0.0, False, False, False)
  if kind == "two_actions":
    assert observation == MULTIPLE_ACTIONS_OBSERVATION
  else:
    assert observation.startswith(("Could not", "Wrong item format")), observation
  assert env.inventory == {}
  assert env.step("get 1 birch logs")[0] == "Got 1 birch logs"


@pytest.mark.parametrize("raw", [b"\x00\xffget 1 birch logs", "get 1 birch logs\x00\x07",
                                 "get 99999999999999999999 birch logs", "get 1 birch logs" * 9000])
def test_raw_step_input(env, raw):
  env.reset(options={"task_id": 140})
  observation, reward, terminated, _, _ = env.step(raw)
  assert (reward, terminated) == (0.0, False) and observation
  assert env.step("inventory")[0].startswith("Inventory: ")


def test_episode_end_and_bad_task_ids(env):
  env.reset(options={"task_id": 0})
  env.step("get 1 acacia logs")
  assert env.step("craft 4 acacia planks using 1 acacia logs")[2]
  observation, reward, terminated, _, _ = env.step("inventory")
  assert "reset" in observation and (reward, terminated) == (0.0, True)
  with pytest.raises(ValueError, match="task ids are >= 0"):
    env.reset(options={"task_id": -1})


_PRINT_INSTANCES = (
    "import json; from environments.textcraft.env import TextCraftEnv; e = TextCraftEnv(); "
    "print(json.dumps([e.reset(options={'task_id': t})[0] for t in (0, 140, 420, 533, 1000)]))")


def test_same_instance_across_processes_and_hash_seeds():
  outputs = []
  for hash_seed in ("0", "12345"):
    env_vars = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run([sys.executable, "-c", _PRINT_INSTANCES], cwd=ROOT, env=env_vars,
                         capture_output=True, text=True, check=True, timeout=120)
    outputs.append(json.loads(out.stdout))
  here = TextCraftEnv()
  assert outputs[0] == outputs[1] == [here.reset(options={"task_id": t})[0]
                                      for t in (0, 140, 420, 533, 1000)]
  assert outputs[0][1] == BIRCH_BOAT


def test_splits():
  splits = environments.task_splits("textcraft")
  train, test = splits["train"], splits["test"]
  assert len(train) == 374 and len(test) == 100 and not set(train) & set(test)
  assert test == [*range(0, 31), *range(140, 181), *range(420, 445), *range(533, 536)]
  env = TextCraftEnv()
  categories = [env.reset(options={"task_id": t})[1]["category"] for t in test]
  assert [categories.count(f"depth{d}") for d in (1, 2, 3, 4)] == [31, 41, 25, 3]


def test_data_files_are_package_data():
  # The patterns setup.py really ships for the `environments` package.
  with open(os.path.join(ROOT, "setup.py")) as f:
    match = re.search(r'package_data=\{"environments": (\[[^\]]*\])', f.read())
  patterns = json.loads(match.group(1))
  for name in ("recipes.json", "splits.json", "README.md"):
    path = os.path.join(ROOT, "environments", "textcraft", "data", name)
    assert os.path.isfile(path)
    relative = os.path.join("textcraft", "data", name)
    assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns), patterns
