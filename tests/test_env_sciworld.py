"""SciWorld: AgentGym's game index, observations, rewards, the expert, and bad input.

One JVM serves the module (ScienceWorld starts in ~1 s); the full expert sweep over the 200
test ids is `slow` (~100 s on two cores).
"""

import subprocess
import sys
import time

import pytest

from environments import make, task_splits
from environments.sciworld import games
from environments.sciworld.env import MAX_ACTION_CHARS, STEP_LIMIT, SciWorldEnv

pytest.importorskip("scienceworld")

# environments.md §4.1: (ScienceWorld id, task name, #variations, first AgentGym index).
AGENTGYM_TABLE = [
    ("1-1", "boil", 30, 0), ("1-2", "melt", 30, 30), ("1-3", "freeze", 30, 60),
    ("1-4", "change-the-state-of-matter-of", 30, 90), ("2-1", "use-thermometer", 540, 120),
    ("2-2", "measure-melting-point-known-substance", 436, 660),
    ("2-3", "measure-melting-point-unknown-substance", 300, 1096),
    ("3-1", "power-component", 20, 1396),
    ("3-2", "power-component-renewable-vs-nonrenewable-energy", 20, 1416),
    ("3-3", "test-conductivity", 900, 1436),
    ("3-4", "test-conductivity-of-unknown-substances", 600, 2336),
    ("4-1", "find-living-thing", 300, 2936), ("4-2", "find-non-living-thing", 300, 3236),
    ("4-3", "find-plant", 300, 3536), ("4-4", "find-animal", 300, 3836),
    ("6-1", "chemistry-mix", 32, 4136), ("6-2", "chemistry-mix-paint-secondary-color", 36, 4168),
    ("6-3", "chemistry-mix-paint-tertiary-color", 36, 4204),
    ("7-1", "lifespan-longest-lived", 125, 4240), ("7-2", "lifespan-shortest-lived", 125, 4365),
    ("7-3", "lifespan-longest-lived-then-shortest-lived", 125, 4490),
    ("8-1", "identify-life-stages-1", 14, 4615), ("8-2", "identify-life-stages-2", 10, 4629),
]

BOIL_0_OBSERVATION = (
    "Your task is to boil water. For compounds without a boiling point, combusting the substance "
    "is also acceptable. First, focus on the substance. Then, take actions that will cause it to "
    "change its state of matter.\n"
    "This room is called the hallway. In it, you see: \n\tthe agent\n\ta substance called air\n"
    "\ta picture\nYou also see:\n\tA door to the art studio (that is closed)\n"
    "\tA door to the bedroom (that is closed)\n\tA door to the greenhouse (that is closed)\n"
    "\tA door to the kitchen (that is closed)\n\tA door to the living room (that is closed)\n"
    "\tA door to the workshop (that is closed)")
NO_MATCH = "No known action matches that input."
# lifespan-longest-lived, variation 0 (task id 4240): the animals are outside.
TO_OUTSIDE = ["open door to kitchen", "go to kitchen", "open door to outside", "go to outside"]


@pytest.fixture(scope="module")
def env():
  with make("sciworld") as environment:
    yield environment


# ----- index and splits ------------------------------------------------------------------------


def test_index_is_agentgyms_table():
  assert [(r["task_id"], r["task_name"], r["num_variations"], r["first_index"])
          for r in games.task_table()] == AGENTGYM_TABLE
  assert games.game(0) == ("boil", 0)
  assert games.game(659) == ("use-thermometer", 539)
  assert games.game(660) == ("measure-melting-point-known-substance", 0)
  assert games.game(4638) == ("identify-life-stages-2", 9)
  for bad in (-1, games.NUM_GAMES):
    with pytest.raises(ValueError, match=r"\[0, 4639\)"):
      games.game(bad)


def test_shipped_data_matches_installed_scienceworld(env):
  sw = env._sw  # the module's simulator; resets reload their game afterwards
  assert games.build_index(sw) == list(games.task_table())
  splits = task_splits("sciworld")
  expected_train = []
  for row in games.task_table():
    sw.load(row["task_name"], 0, "")
    expected_train += [row["first_index"] + v for v in sw.get_variations_train()]
    test_variations = set(sw.get_variations_test())
    chosen = [games.game(i)[1] for i in splits["test"] if games.game(i)[0] == row["task_name"]]
    assert chosen and set(chosen) <= test_variations, row["task_name"]
  assert splits["train"] == sorted(expected_train)
  assert len(splits["test"]) == len(set(splits["test"])) == 200
  assert not set(splits["train"]) & set(splits["test"])


# ----- observations, rewards, episode end --------------------------------------------------------


def test_reset_observation_and_info(env):
  observation, info = env.reset(options={"task_id": 0})
  assert observation == BOIL_0_OBSERVATION
  assert info["instruction"].startswith("You are an agent for science world.")
  assert info["instruction"].endswith("Thought:\nyour thoughts.\n\nAction:\nyour next action")
  assert (info["task_id"], info["task_name"], info["variation"]) == (0, "boil", 0)
  assert env.step("open door to kitchen")[0] == "The door is now open."


def test_rewards_are_the_cumulative_score(env):
  env.reset(options={"task_id": 4240})
  rewards = [env.step(action)[1] for action in TO_OUTSIDE]
  assert rewards == [0.0, 0.25, 0.25, 0.5]
  # A free action neither moves nor changes the score; the reward stays the current score.
  _, reward, terminated, _, info = env.step("look around")
  assert (reward, terminated, info["moves"]) == (0.5, False, 4)
  observation, reward, terminated, truncated, info = env.step("focus on baby brown bear")
  assert observation == "You focus on the baby brown bear."
  assert (reward, terminated, truncated) == (1.0, True, False)
  assert info["score"] == 100.0 and info["success"] is True


def test_paper_mode_and_failure(env):
  for mode, rewards, failure in [("paper", [0.0, 25.0, 25.0, 50.0], -100.0),
                                 ("normalized", [0.0, 0.25, 0.25, 0.5], 0.0)]:
    env.reward_mode = mode
    try:
      env.reset(options={"task_id": 4240})
      assert [env.step(action)[1] for action in TO_OUTSIDE] == rewards
      _, reward, terminated, _, info = env.step("focus on baby mouse")  # the wrong animal
    finally:
      env.reward_mode = "normalized"
    assert (reward, terminated, info["score"], info["success"]) == (failure, True, -100.0, False)


def test_step_limit_truncates(env):
  # ScienceWorld counts moves, not steps: "open door" is 1 move, "wait1" 2, a free action 0.
  env.step_limit = 5
  try:
    env.reset(options={"task_id": 0})
    ends = [env.step(a)[2:] for a in ["wait1", "wait1", "open door to kitchen", "look around",
                                      "wait1"]]
  finally:
    env.step_limit = STEP_LIMIT
  assert [(terminated, truncated, info["moves"]) for terminated, truncated, info in ends] == [
      (False, False, 2), (False, False, 4), (False, False, 5), (False, False, 5), (False, True, 7)]


# ----- expert -------------------------------------------------------------------------------------


def test_expert_solves_one_test_variation_per_task_type(env):
  first_of_type = {}
  for task_id in task_splits("sciworld")["test"]:
    first_of_type.setdefault(games.game(task_id)[0], task_id)
  assert len(first_of_type) == 23
  for task_id in first_of_type.values():
    reward, info, _ = env.play_expert(task_id)
    assert (reward, info["success"]) == (1.0, True), (task_id, info)


@pytest.mark.slow
def test_expert_solves_every_test_task(env):
  for task_id in task_splits("sciworld")["test"]:
    reward, info, _ = env.play_expert(task_id)
    assert (reward, info["success"]) == (1.0, True), (task_id, info)


def test_expert_picks_up_a_started_episode(env):
  # The gold path is generated lazily: the first expert call replays the action already taken.
  env.reset(options={"task_id": 0})
  env.step("open door to kitchen")  # boil/0's first gold action
  assert env.expert_action() == "go to kitchen"
  for _ in range(200):
    _, reward, terminated, truncated, info = env.step(env.expert_action())
    if terminated or truncated:
      break
  assert info["success"] and reward == 1.0


# ----- action parsing and bad input ---------------------------------------------------------------


def test_parse_action():
  parse = SciWorldEnv.parse_action
  assert parse("Thought:\nI should open it.\n\nAction:\nopen door to kitchen") == (
      "open door to kitchen")
  assert parse("Action: look around</s>") == "look around"
  assert parse("Action: go to kitchen\nAction: look around") == "look around"  # the last one
  assert parse("Action: pour cup\ninto pot") == "pour cup\ninto pot"  # may span lines
  assert parse("I would open the door.") == ""
  assert parse("") == ""
  longest_gold = "pour cup containing blue paint in art studio in cup containing red paint in table"
  for action in ["look around", "focus on substance in metal pot", "0", "wait1", longest_gold]:
    assert parse(SciWorldEnv.format_action(action)) == action


@pytest.mark.parametrize("response, expected", [
    ("", NO_MATCH),
    ("Thought: hmm, no action", NO_MATCH),
    ("Action: " + "open door to kitchen " * 5000, "characters long"),  # ~100 KB
    ("Action: x" * 12000, NO_MATCH),  # ~100 KB; the last Action wins
    ("Action: öffne die Tür ☃ 打开门", NO_MATCH),
    ("Thought: turn first.\nAction: turn left", NO_MATCH),  # a BabyAI action
    ("Action: craft 1 stick using 2 planks", NO_MATCH),  # a TextCraft action
    ("<search>boiling point of water</search>", NO_MATCH),  # a SearchQA action
])
def test_bad_responses_leave_a_live_env(env, response, expected):
  env.reset(options={"task_id": 0})
  start = time.monotonic()
  observation, reward, terminated, truncated, info = env.step(env.parse_action(response))
  assert time.monotonic() - start < 5.0
  assert expected in observation
  assert (reward, terminated, truncated, info["success"]) == (0.0, False, False, False)
  assert env.step("open door to kitchen")[0] == "The door is now open."


def test_bad_bytes_and_control_characters(env):
  env.reset(options={"task_id": 0})
  for action in [b"\xff\xfe\x00open\x80door", "look\x00 around\x1b[0m", "\ud800 open"]:
    observation, reward, terminated, _, _ = env.step(action)
    assert isinstance(observation, str) and observation
    assert (reward, terminated) == (0.0, False)
  assert env.step("open door to kitchen")[0] == "The door is now open."


def test_too_long_action_never_reaches_the_simulator(env):
  env.reset(options={"task_id": 0})
  observation, _, _, _, info = env.step("open door to kitchen " * 100)
  # Refused, not a fault: "error" would end the episode as failed.
  assert info["invalid_action"] and "error" not in info and str(MAX_ACTION_CHARS) in observation
  assert info["moves"] == 0
  # Measured before the sanitiser's 8192-character cap.
  observation = env.step("open door to kitchen " * 5000)[0]
  assert "Your action is 105000 characters long" in observation


# ----- process hygiene ---------------------------------------------------------------------------


def test_one_jvm_per_instance_and_close():
  sw_env = SciWorldEnv()
  simulator = sw_env._sw
  sw_env.reset(options={"task_id": 4240})
  sw_env.reset(options={"task_id": 0})
  assert sw_env._sw is simulator  # reset reuses the JVM
  java = simulator._gateway.java_process
  sw_env.close()
  sw_env.close()  # idempotent
  assert java.wait(timeout=10) is not None
  with pytest.raises(RuntimeError, match="closed"):
    sw_env.reset(options={"task_id": 0})


def test_no_jax_import():
  code = ("import sys; from environments import make\n"
          "with make('sciworld') as e:\n"
          "  e.reset(options={'task_id': 0}); e.step('look around')\n"
          "assert 'jax' not in sys.modules, 'sciworld imported jax'\n")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
