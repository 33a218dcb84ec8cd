"""keypad: codes per task, first-digit parsing, 1 / turn rewards, truncation, splits."""

import pytest

import environments
from environments.keypad.env import KeypadEnv


def test_expert_opens_every_test_lock_on_the_first_turn():
  env = environments.make("keypad")
  for task_id in environments.task_splits("keypad")["test"]:
    observation, info = env.reset(options={"task_id": task_id})
    assert observation == f"Code: {info['code']}." and info["category"] == f"code {info['code']}"
    action = env.parse_action(env.format_action(env.expert_action()))
    _, reward, terminated, truncated, info = env.step(action)
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)


def test_reward_falls_with_the_turn_and_episodes_truncate():
  env = KeypadEnv(codes="7", max_steps=3)
  env.reset(options={"task_id": 0})
  observation, reward, terminated, truncated, _ = env.step(env.parse_action("hello"))
  assert (observation, reward, terminated, truncated) == ("No digit. Code: 7.", 0.0, False, False)
  observation, *_ = env.step(env.parse_action("maybe 3 or 7"))
  assert observation == "Wrong. Code: 7."  # the first digit counts
  _, reward, terminated, _, info = env.step(env.parse_action("x7"))
  assert reward == pytest.approx(1 / 3) and terminated and info["score"] == pytest.approx(1 / 3)
  env.reset(options={"task_id": 1})
  for _ in range(3):
    _, reward, terminated, truncated, _ = env.step("1")
  assert (reward, terminated, truncated) == (0.0, False, True)


def test_codes_are_deterministic_per_task_and_drawn_from_the_given_digits():
  codes = [KeypadEnv(codes="01").reset(options={"task_id": t})[1]["code"] for t in range(40)]
  assert set(codes) == {"0", "1"}
  assert codes == [KeypadEnv(codes="01").reset(options={"task_id": t})[1]["code"]
                   for t in range(40)]
  splits = environments.task_splits("keypad")
  assert not set(splits["train"]) & set(splits["test"])
  for bad in ({"codes": ""}, {"codes": "7a"}, {"codes": "77"}, {"max_steps": 0}):
    with pytest.raises(ValueError):
      KeypadEnv(**bad)
  assert KeypadEnv.parse_action("no digits here") == ""


def test_a_longer_code_is_entered_digit_by_digit_with_its_state_as_the_anchor():
  env = KeypadEnv(code="372", max_steps=6)
  observation, info = env.reset(options={"task_id": 5})
  assert (observation, info["state_key"]) == ("Code: 372.", "372:0")
  # reply, observation, reward so far (a right digit adds 1 / (3 * (1 + misses))), state key
  expected = [("3", "Right. Code: 372. Entered: 3.", 1 / 3, "372:1"),
              ("3", "Wrong. Code: 372. Entered: 3.", 1 / 3, "372:1"),
              ("no", "No digit. Code: 372. Entered: 3.", 1 / 3, "372:1"),
              ("7", "Right. Code: 372. Entered: 37.", 4 / 9, "372:2"),
              ("2", "Unlocked.", 5 / 9, "372:3")]
  for reply, want_observation, want_reward, want_key in expected:
    observation, reward, terminated, truncated, info = env.step(env.parse_action(reply))
    assert (observation, info["state_key"]) == (want_observation, want_key)
    assert reward == pytest.approx(want_reward) and not truncated
  assert terminated and info["success"] and info["score"] == pytest.approx(5 / 9)
  # The expert enters the code in `length` turns and earns 1; digits per task are drawn.
  env = KeypadEnv(length=3, max_steps=3)
  codes = set()
  for task_id in range(20):
    _, info = env.reset(options={"task_id": task_id})
    codes.add(info["code"])
    rewards = [env.step(env.expert_action())[1] for _ in range(3)]
    assert rewards == pytest.approx([1 / 3, 2 / 3, 1.0]) and len(info["code"]) == 3
  assert len(codes) > 10
  for bad in ({"length": 0}, {"code": "3a"}, {"code": "37", "length": 3}):
    with pytest.raises(ValueError):
      KeypadEnv(**bad)
