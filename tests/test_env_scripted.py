"""The `scripted` environment: rules, rewards, parser, expert, splits, filler."""

import time

import pytest

import environments
from environments.scripted.env import ScriptedEnv


def test_expert_succeeds_on_every_test_task():
  env = environments.make("scripted")
  for task_id in environments.task_splits("scripted")["test"]:
    observation, info = env.reset(options={"task_id": task_id})
    assert info["instruction"] == env.instruction and len(info["boxes"]) == 3
    _, reward, terminated, truncated, info = env.step(env.expert_action())
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)


def test_play_expert_stops_at_the_end_or_at_max_steps():
  reward, info, actions = ScriptedEnv().play_expert(5)
  assert (reward, info["success"], len(actions)) == (1.0, True, 1)

  class Lost(ScriptedEnv):
    def expert_action(self) -> str:
      return "dance"

  reward, info, actions = Lost(max_steps=10).play_expert(5, max_steps=3)
  assert (reward, info["success"], actions) == (0.0, False, ["dance"] * 3)
  # The environment's own step limit ends the episode first (truncated).
  _, info, actions = Lost(max_steps=2).play_expert(5, max_steps=3)
  assert len(actions) == 2 and not info["success"]


def test_rewards_decay_with_turns_and_note_is_true():
  env = ScriptedEnv()
  observation, info = env.reset(options={"task_id": 5})
  decoy = observation.rsplit("not in the ", 1)[1].rstrip(".")
  assert decoy in info["boxes"] and decoy != env.key_box
  observation, reward, terminated, truncated, _ = env.step(f"open {decoy}")
  assert (reward, terminated, truncated) == (0.0, False, False)
  assert observation.startswith(f"The {decoy} is empty. Boxes left:") and decoy not in (
      observation.split("left:")[1])
  _, reward, terminated, _, info = env.step(env.expert_action())
  assert reward == 0.5 and terminated and info["score"] == 0.5


def test_invalid_actions_count_and_truncate():
  env = ScriptedEnv(max_steps=2)
  env.reset(options={"task_id": 0})
  observation, reward, terminated, truncated, _ = env.step("dance")
  assert observation.startswith("Invalid action 'dance'") and not (terminated or truncated)
  observation, reward, terminated, truncated, info = env.step("open spaceship")
  assert observation.startswith("There is no spaceship here.")
  assert (reward, terminated, truncated, info["success"]) == (0.0, False, True, False)


def test_parse_and_format_action():
  assert ScriptedEnv.parse_action("Thought: hmm\nAction: open the_lamp!\nmore") == "open thelamp"
  assert ScriptedEnv.parse_action("no action here") == ""
  assert ScriptedEnv.parse_action("Action:\nopen  river ") == "open river"
  for action in ("open lamp", "open tower"):
    assert ScriptedEnv.parse_action(ScriptedEnv.format_action(action)) == action


def test_filler_lengths():
  plain = ScriptedEnv()
  padded = ScriptedEnv(filler_words=10)
  varied = ScriptedEnv(filler_words=10, vary_filler=True)
  base = plain.reset(options={"task_id": 3})[0]
  assert len(padded.reset(options={"task_id": 3})[0].split()) == len(base.split()) + 10
  lengths = set()
  for task_id in range(6):
    varied.reset(options={"task_id": task_id})
    lengths.add(len(varied.step("dance")[0].split()))
  assert len(lengths) > 2


def test_step_latency():
  env = ScriptedEnv(step_latency_s=0.05)
  env.reset(options={"task_id": 0})
  start = time.perf_counter()
  env.step("open nothing")
  assert time.perf_counter() - start >= 0.05


def test_bad_arguments():
  with pytest.raises(ValueError, match="step_latency_s"):
    ScriptedEnv(step_latency_s=-0.1)
  with pytest.raises(ValueError, match="max_steps"):
    ScriptedEnv(max_steps=0)
  with pytest.raises(ValueError, match="filler_words"):
    ScriptedEnv(filler_words=-1)
  with pytest.raises(ValueError, match="task ids"):
    ScriptedEnv().reset(options={"task_id": -1})
