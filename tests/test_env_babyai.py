"""BabyAI: level mapping, text formats, rewards in both modes, the expert, bad input.

The description and action-list rules were checked against a transcription of AgentGym's
agentenv-babyai server (not kept here) on 400 task ids x 25 random actions and 81 expert-led
episodes: identical observations, rewards and `done` in every step. The strings pinned below
come from that implementation; the first one is the example in AgentGym's notes.
"""

import dataclasses

import gymnasium
import pytest

import environments
from environments.babyai import env as babyai_env
from environments.babyai.env import BabyAIEnv
from environments.base import MULTIPLE_ACTIONS_OBSERVATION

RED_BALL_ACTIONS = (
    'Available actions: ["turn left", "turn right", "move forward", "pickup yellow key 1", '
    '"pickup grey ball 1", "pickup purple key 1", "pickup blue key 1", "pickup red box 1", '
    '"pickup grey ball 2", "pickup green key 1", "pickup red ball 1", "go to yellow key 1", '
    '"go to grey ball 1", "go to purple key 1", "go to blue key 1", "go to red box 1", '
    '"go to grey ball 2", "go to green key 1", "go to red ball 1", "check available actions"]')
RED_BALL_DESCRIPTION = (
    "In front of you in this room, you can see several objects: "
    "There is a yellow key 1 1 steps in front of you and 1 steps to your left.  "
    "There is a grey ball 1 1 steps in front of you and 1 steps to your right.  "
    "There is a purple key 1 2 steps in front of you and 1 steps to your left.  "
    "There is a blue key 1 2 steps in front of you and 1 steps to your right.  "
    "There is a red box 1 2 steps in front of you and 2 steps to your right.  "
    "There is a grey ball 2 5 steps in front of you and 1 steps to your right.  "
    "There is a green key 1 4 steps in front of you and 2 steps to your right.  "
    "There is a red ball 1 4 steps in front of you and 3 steps to your right.  "
    "The room has walls around you. You are facing a wall 6 steps away. "
    "You are not carrying anything.")
# Task 1 after "turn left".
TURNED_ACTIONS = (
    'Available actions: ["turn left", "turn right", "move forward", "pickup yellow key 1", '
    '"pickup purple key 1", "go to yellow key 1", "go to purple key 1", '
    '"check available actions"]')


def test_level_mapping():
  assert len(babyai_env.LEVELS) == 40
  assert babyai_env.level_of(1) == ("GoToRedBall", "BabyAI-GoToRedBall-v0", 0)
  assert babyai_env.level_of(1804) == ("GoToLocalS8N7", "BabyAI-GoToLocalS8N7-v0", 45)
  assert babyai_env.level_of(79) == ("BossLevelNoUnlock", "BabyAI-BossLevelNoUnlock-v0", 1)
  for name in babyai_env.LEVELS:
    assert babyai_env.level_of(babyai_env.LEVELS.index(name))[1] in gymnasium.envs.registry


def test_renamed_level_keeps_agentgym_room_size():
  # AgentGym's BabyAI-GoToObjS6-v0 (minigrid < 2.5) had room_size=4; minigrid 3 has only -v1
  # (room size 6). Task ids N % 40 == 3 use minigrid 3's GoToObjS4-v0, the same level.
  assert "BabyAI-GoToObjS6-v0" not in gymnasium.envs.registry
  assert babyai_env.level_of(3) == ("GoToObjS6", "BabyAI-GoToObjS4-v0", 0)
  env = BabyAIEnv()
  observation, info = env.reset(options={"task_id": 3})
  assert info["level"] == "GoToObjS6" and info["category"] == "GoToObjS6"
  assert (env.env.width, env.env.height, env.env.max_steps) == (4, 4, 16)
  assert observation == (
      "Your goal: go to the blue key\nIn front of you in this room, you can see several "
      "objects: There is a blue key 1 1 steps in front of you and 1 steps to your right.  The "
      "room has walls around you. You are facing a wall 2 steps away. You are not carrying "
      "anything.\nAvailable actions: [\"turn left\", \"turn right\", \"move forward\", "
      "\"pickup blue key 1\", \"go to blue key 1\", \"check available actions\"]")


def test_first_observation():
  env = BabyAIEnv()
  observation, info = env.reset(options={"task_id": 1})
  assert observation == (
      f"Your goal: go to the red ball\n{RED_BALL_DESCRIPTION}\n{RED_BALL_ACTIONS}")
  assert info["mission"] == "go to the red ball" and info["seed"] == 0
  assert babyai_env.goal_text("open the red door, then open the blue door") == (
      "open the red door, and open the blue door")
  assert babyai_env.goal_text("open a door after you pick up a key") == (
      "open a door and pick up a key")


def test_replies_and_refusals():
  env = BabyAIEnv()
  env.reset(options={"task_id": 1})
  observation, reward, terminated, _, _ = env.step("turn left")
  assert observation == (
      "In front of you in this room, you can see several objects: There is a yellow key 1 1 "
      "steps in front of you and 1 steps to your right.  There is a purple key 1 1 steps in "
      "front of you and 2 steps to your right.  The room has walls around you. You are facing "
      f"a wall 2 steps away. You are not carrying anything.\n{TURNED_ACTIONS}")
  assert (reward, terminated, env.env.step_count) == (0.0, False, 1)
  replies = {
      "check available actions": (
          "You can take the following actions: turn left, turn right, move forward, pickup "
          "yellow key 1, pickup purple key 1, go to yellow key 1, go to purple key 1, check "
          "available actions"),
      "Please CHECK": "You can take the following actions: turn left",  # "check" anywhere
      "pick up yellow key 1": "The action is not recognized. Please check valid actions.",
      "go to red ball 1": "The action is not recognized. Please check valid actions.",
      "": "No change in state.",
      "drop": "You cannot drop the object, as you are not carrying anything.",
  }
  for action, expected in replies.items():
    observation, reward, terminated, _, info = env.step(action)
    assert observation.startswith(expected) and observation.endswith("\n" + TURNED_ACTIONS)
    assert (reward, terminated) == (0.0, False)
    assert info["invalid_action"] is ("check" not in action.lower()), action
  assert env.env.step_count == 1  # refusals cost no minigrid step
  observation, _, _, _, info = env.step("  Pickup Yellow Key 1 ")  # lower-cased and stripped
  assert info["invalid_action"] is False
  assert observation.startswith("In front of you") and "You are carrying a yellow key." in (
      observation)
  assert '"drop"' in observation and "pickup" not in observation.split("\n")[-1]
  observation, *_ = env.step("pickup purple key 1")
  assert observation.startswith("The action is not recognized.")


def test_state_key_names_the_state_not_the_words():
  env = BabyAIEnv()
  _, info = env.reset(options={"task_id": 1})
  start = info["state_key"]
  refused = env.step("go to red ball 9")[4]["state_key"]
  turned = env.step("turn left")[4]["state_key"]
  assert refused == start != turned  # a refusal leaves the state as it was
  for _ in range(3):
    back = env.step("turn left")[4]["state_key"]
  assert back == start  # four left turns: the same pose, the same key
  assert env.reset(options={"task_id": 1})[1]["state_key"] == start
  assert env.reset(options={"task_id": 41})[1]["state_key"] != start  # another seed


def test_success_reward_and_end():
  env = BabyAIEnv()
  env.reset(options={"task_id": 1})
  observation, reward, terminated, truncated, info = env.step("go to red ball 1")
  assert observation.endswith("\n The task is completed.\n" + observation.split("\n")[-1])
  assert env.env.step_count == 8 and reward == pytest.approx(1 - 0.9 * 8 / 64)
  assert (terminated, truncated, info["success"]) == (True, False, True)
  assert info["score"] == pytest.approx(0.8875)
  assert env.step("turn left")[2] is True  # the episode is over


@pytest.mark.parametrize("reward_mode", ["normalized", "paper"])
def test_late_success(reward_mode):
  # 36 turns + an 8-step walk: 1 - 0.9 * 44 / 64 = 0.38125 <= 0.5, a "late" success.
  env = BabyAIEnv(reward_mode=reward_mode)
  env.reset(options={"task_id": 1})
  for _ in range(36):
    assert env.step("turn left")[1:3] == (0.0, False)
  observation, reward, terminated, _, info = env.step("go to red ball 1")
  late = 1 - 0.9 * 44 / 64
  assert "\n The task is completed.\n" in observation and info["success"]
  assert reward == pytest.approx(late) and info["score"] == pytest.approx(late)
  if reward_mode == "normalized":
    assert terminated
    return
  # AgentGym: not done, and each refusal or check adds the last macro's reward again.
  assert not terminated
  for k, action in enumerate(["check available actions", "xyzzy", "drop"], start=2):
    _, reward, terminated, _, info = env.step(action)
    assert reward == pytest.approx(k * late) and not terminated and info["success"]
  _, reward, _, _, info = env.step("turn left")  # a macro without success adds 0
  assert reward == pytest.approx(4 * late) == info["score"]


def test_reset_prints_nothing(capsys):
  env = BabyAIEnv()
  env.reset(options={"task_id": 6})  # GoToImpUnlock seed 0 rejects layouts while sampling
  assert capsys.readouterr().out == ""


def test_same_instance_for_same_task_id():
  first, second = BabyAIEnv(), BabyAIEnv()
  observation = first.reset(options={"task_id": 1845})[0]
  second.reset(options={"task_id": 5})
  assert second.reset(options={"task_id": 1845})[0] == observation
  assert first.reset(options={"task_id": 1845})[0] == observation
  assert first.reset(options={"task_id": 1845 + 40})[0] != observation


BAD_RESPONSES = {
    "empty": "",
    "huge": "Action: " + "x" * 100_000,
    "not_utf8": b"Action: \xff\xfe\xfa\xc3\x28 jump \x80",
    "unicode": "Thought: 🤖\nAction: gø tö réd bäll 1 ✓",
    "two_actions": "Action: turn left\nAction: turn right",
    "textcraft": "Action: craft 4 oak planks using 1 oak logs",
    "searchqa": "<search>red ball</search>",
    "sciworld": "Action: open door to kitchen",
}


@pytest.mark.parametrize("kind", sorted(BAD_RESPONSES))
def test_bad_input_is_answered_and_env_lives(kind):
  env = BabyAIEnv()
  env.reset(options={"task_id": 1})
  action = BabyAIEnv.parse_action(BAD_RESPONSES[kind])
  observation, reward, terminated, truncated, info = env.step(action)
  assert (reward, terminated, truncated, info["success"]) == (0.0, False, False, False)
  if kind == "two_actions":
    assert observation == MULTIPLE_ACTIONS_OBSERVATION
  elif kind in ("empty", "searchqa"):
    assert observation == "No change in state.\n" + RED_BALL_ACTIONS
  else:
    assert observation == (
        "The action is not recognized. Please check valid actions.\n" + RED_BALL_ACTIONS)
  assert env.env.step_count == 0
  assert env.step("turn left")[0].endswith(TURNED_ACTIONS)


@pytest.mark.parametrize("raw", [b"\x00\xffturn left", "turn left\x00\x07" * 3,
                                 "move forward " * 10_000])
def test_raw_step_input(raw):
  env = BabyAIEnv()
  env.reset(options={"task_id": 1})
  observation, reward, terminated, _, _ = env.step(raw)
  assert observation.startswith("The action is not recognized.")
  assert (reward, terminated) == (0.0, False)


def _test_ids(seeds_per_level):
  """The test split, restricted to its first `seeds_per_level` seeds of every level."""
  test = environments.task_splits("babyai")["test"]
  first_seed = min(test) // 40
  return [t for t in test if t // 40 < first_seed + seeds_per_level]


def _check_expert(task_ids):
  env = BabyAIEnv()
  for task_id in task_ids:
    reward, info, actions = env.play_expert(task_id, max_steps=150)
    assert info["success"] and reward > 0.5, (task_id, actions[-5:])
    for action in actions:
      assert BabyAIEnv.parse_action(BabyAIEnv.format_action(action)) == action


def test_expert_solves_test_tasks_subset():
  task_ids = _test_ids(seeds_per_level=2)
  assert len(task_ids) == 36
  _check_expert(task_ids)


@pytest.mark.slow
def test_expert_solves_every_test_task():
  _check_expert(environments.task_splits("babyai")["test"])  # ~17 s of CPU time


def test_expert_keeps_up_after_other_actions():
  env = BabyAIEnv()
  env.reset(options={"task_id": 11})  # Open: go to the door, then toggle
  for action in ("turn right", "move forward", "xyzzy"):
    env.step(action)
  for _ in range(60):
    *_, terminated, _, info = env.step(env.expert_action())
    if terminated:
      break
  assert info["success"]


def test_splits():
  splits = environments.task_splits("babyai")
  train, test = splits["train"], splits["test"]
  assert len(train) == 810 and len(test) == 90
  levels = {babyai_env.level_of(t)[0] for t in test}
  assert levels == {babyai_env.level_of(t)[0] for t in train}
  assert len(levels) == 18 and "KeyInBox" not in levels and "BossLevel" not in levels
  assert max(train) // 40 == 44 and min(test) // 40 == 45  # unseen seeds at test time


def test_minigrid_pin_and_mission_differences_are_documented_beside_the_env():
  """data/README.md names the minigrid we pin and the missions that differ from AgentGym's
  minigrid 2.3.1 (tasks 155, 156), and what it says of them is what the env does."""
  import importlib.metadata
  import pathlib
  import re
  readme = (pathlib.Path(babyai_env.__file__).parent / "data" / "README.md").read_text()
  assert f"minigrid=={importlib.metadata.version('minigrid')}" in readme
  assert "2.3.1" in readme
  documented = dict(re.findall(r"^  - (\d+): `([^`]+)`$", readme, re.MULTILINE))
  assert set(documented) == {"155", "156"}
  env = BabyAIEnv()
  for task_id, mission in documented.items():
    assert env.reset(options={"task_id": int(task_id)})[1]["mission"] == mission


def test_categories_follow_the_levels_argument():
  """With `levels`, id N is levels[N % k]: the categories that filter and balance tasks
  (`environments.task_categories`) are the levels `reset` reports, not the split file's."""
  from agentgym_jax.rollout import envs  # pylint: disable=import-outside-toplevel
  levels = ("PickupLoc", "GoToRedBall")
  categories = environments.task_categories("babyai", env_kwargs={"levels": levels})
  assert environments.task_categories("babyai")[2] == "GoToRedBallNoDists"  # over all 40
  assert set(categories) == set(environments.task_categories("babyai"))  # every split id
  assert (categories[0], categories[1], categories[2]) == ("PickupLoc", "GoToRedBall",
                                                           "PickupLoc")
  env = BabyAIEnv(levels=levels)
  for task_id in sorted(categories)[:3] + sorted(categories)[-3:]:
    assert env.reset(options={"task_id": task_id})[1]["category"] == categories[task_id]
  settings = envs.EnvSettings(name="babyai", kwargs={"levels": levels},
                              categories=("PickupLoc",))
  test = envs.task_splits(settings)["test"]
  assert test and all(t % 2 == 0 for t in test)
  with pytest.raises(ValueError, match="GoToObjS6"):  # a level the run does not have
    envs.task_splits(dataclasses.replace(settings, categories=("GoToObjS6",)))
