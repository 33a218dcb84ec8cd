"""BabyAI (AgentGym's agentenv-babyai) as a `TextEnv`: minigrid's BabyAI levels in text.

Task id N -> level `LEVELS[N % 40]` (AgentGym's 1-based `all_levels[N % 40 + 1]`) reset with
seed N // 40. The first observation is

  Your goal: go to the red ball
  In front of you in this room, you can see several objects: There is a ... The room has
  walls around you. You are facing a wall 6 steps away. You are not carrying anything.
  Available actions: ["turn left", "turn right", "move forward", ..., "check available actions"]

and every later one is the new description (or a refusal, or the action list asked for by
"check available actions") followed by the "Available actions" line. Descriptions and macro
actions are built by `text.render`; a macro runs primitive by primitive and stops early when a
primitive leaves the agent's view unchanged. Refusals cost no minigrid step.

Renamed level: AgentGym pins minigrid < 2.5, whose `BabyAI-GoToObjS6-v0` was registered with
`room_size=4`. minigrid 3 registers only `BabyAI-GoToObjS6-v1` (room size 6, a different
task). We keep AgentGym's behaviour by making `BabyAI-GoToObjS4-v0` (the same `GoToObj` class
with `room_size=4`) for the level still called "GoToObjS6" here (task ids N % 40 == 3).
We run minigrid 3.2.0, AgentGym 2.3.1; `data/README.md` lists the tasks whose missions differ
between the two (155 and 156).

Rewards. minigrid pays `1 - 0.9 * primitives / max_steps` on success. As upstream, a step
counts as successful when the macro's last primitive is; then
  * reward_mode="paper" is AgentGym exactly: the step's reward is the cumulative score (the
    sum over steps of the last macro's minigrid reward, which refusals and "check" steps add
    again), and only a success worth more than 0.5 ends the episode;
  * reward_mode="normalized" (default): every success ends the episode and its reward is the
    minigrid reward; all other steps give 0. The two modes differ only after a late success
    (worth 0.5 or less), which AgentGym neither ends nor stops rewarding.
info["score"] is the cumulative score in both modes; info["success"] turns True at the first
success. Failures (minigrid's `terminated` with reward 0, e.g. a wrong PutNext drop) never end
an episode, and minigrid's own step limit is ignored, as upstream.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import random
from typing import Any

import gymnasium
import minigrid  # noqa: F401  (registers the BabyAI-* environments with gymnasium)
import numpy as np

from environments.babyai import expert as expert_lib
from environments.babyai import text
from environments.base import (MULTIPLE_ACTIONS, MULTIPLE_ACTIONS_OBSERVATION, ReActEnv,
                               parse_single_action)

# AgentGym's `all_levels`, in order (upstream keys 1..40 -> indices 0..39).
LEVELS = (
    "GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists", "GoToObjS6", "GoToLocalS8N7",
    "GoToObjMazeS7", "GoToImpUnlock", "GoToSeqS5R2", "GoToRedBlueBall", "GoToDoor",
    "GoToObjDoor", "Open", "OpenRedDoor", "OpenDoorLoc", "OpenRedBlueDoorsDebug",
    "OpenDoorsOrderN4Debug", "Pickup", "UnblockPickup", "PickupLoc", "PickupDistDebug",
    "PickupAbove", "PutNextLocalS6N4", "PutNextS7N4Carrying", "Unlock", "UnlockLocalDist",
    "KeyInBox", "UnlockPickupDist", "BlockedUnlockPickup", "UnlockToUnlock", "ActionObjDoor",
    "FindObjS7", "KeyCorridorS6R3", "OneRoomS20", "MoveTwoAcrossS8N9", "SynthS5R2", "SynthLoc",
    "SynthSeq", "MiniBossLevel", "BossLevel", "BossLevelNoUnlock")
# minigrid 3's id for AgentGym's `BabyAI-GoToObjS6-v0` (see the module docstring).
RENAMED = {"GoToObjS6": "BabyAI-GoToObjS4-v0"}

INSTRUCTION = (
    "You are an explorer who completes every goal you are given. You are in a grid world of "
    "rooms and must reach the given goal by acting. Every round I give you an observation; "
    "answer with your thought and one action based on it.\n\n"
    "The actions are:\n\n"
    "- turn right \n\n"
    "- turn left \n\n"
    "- move forward \n\n"
    "- go to <obj> <id>: walk up to an object you can see, e.g. go to red ball 1 \n\n"
    "- pickup <obj> <id>: walk up to an object and pick it up \n\n"
    "- drop: put down what you carry in the cell in front of you \n\n"
    "- go through <door> <id>: <door> must be an open door. \n\n"
    "- toggle and go through <door> <id>: <door> is a closed or locked door. A locked door "
    "opens only while you carry a key of its color. \n\n"
    "- toggle: open the closed or locked door right in front of you. \n\n"
    "- check available actions: list the actions you can take now.\n"
    "Every observation ends with the list of available actions; use their exact names.\n"
    "Your response should use the following format:\nThought:\n<Your Thought>\n\nAction:\n"
    "<Your Action>")

_NOT_RECOGNIZED = "The action is not recognized. Please check valid actions."
_COMPLETED = "\n The task is completed."


def level_of(task_id: int, levels: tuple[str, ...] = LEVELS) -> tuple[str, str, int]:
  """(level name, gymnasium id, reset seed) of task `task_id` over `levels`."""
  name = levels[task_id % len(levels)]
  return name, RENAMED.get(name, f"BabyAI-{name}-v0"), task_id // len(levels)


def goal_text(mission: str) -> str:
  """AgentGym's goal line: "then" and "after you" both become "and"."""
  return mission.replace("then", "and").replace("after you", "and")


class BabyAIEnv(ReActEnv):
  """BabyAI level `task_id % 40` with seed `task_id // 40`, in AgentGym's text form."""

  name = "babyai"
  instruction = INSTRUCTION
  expert_thought = "I follow my plan towards the goal."

  def __init__(self, reward_mode: str = "normalized", levels: tuple[str, ...] | None = None):
    """`levels`: a subset of LEVELS that task ids cycle over instead of all 40 (task id N is
    then level levels[N % k] with seed N // k, so distinct ids stay distinct tasks)."""
    super().__init__(reward_mode)
    self.levels = tuple(levels) if levels else LEVELS
    unknown = sorted(set(self.levels) - set(LEVELS))
    if unknown:
      raise ValueError(f"babyai: unknown levels {unknown}; pick from environments.babyai.env."
                       "LEVELS.")
    self._levels: dict[str, Any] = {}  # gymnasium id -> unwrapped minigrid env, reused
    self.env = None  # the current level's unwrapped minigrid env
    self.view: text.View | None = None
    self._image: np.ndarray | None = None
    self._last_reward = 0.0  # minigrid reward of the last executed macro (upstream env.reward)
    self._score = 0.0
    self._success = False
    self._expert: expert_lib.Expert | None = None

  # ----- TextEnv ---------------------------------------------------------------------------

  @classmethod
  def task_categories(cls, shipped: dict[int, str], **kwargs) -> dict[int, str]:
    """The split file names each id's level over all 40; with `levels`, id N is levels[N % k]."""
    levels = kwargs.get("levels")
    if not levels:
      return shipped
    return {task_id: level_of(task_id, tuple(levels))[0] for task_id in shipped}

  def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
    if task_id < 0:
      raise ValueError(f"babyai: task ids are >= 0, got {task_id}.")
    level, gym_id, seed = level_of(task_id, self.levels)
    if gym_id not in self._levels:
      self._levels[gym_id] = gymnasium.make(gym_id).unwrapped
    self.env = self._levels[gym_id]
    # Level generation prints "Sampling rejected: ..." when it retries a layout.
    with contextlib.redirect_stdout(io.StringIO()):
      obs, _ = self.env.reset(seed=seed)
    self._image = obs["image"]
    self.view = text.render(self.env, self._image)
    self._last_reward, self._score, self._success = 0.0, 0.0, False
    self._expert = None
    observation = (f"Your goal: {goal_text(self.env.mission)}\n{self.view.description}\n"
                   f"{self.view.actions_text()}")
    return observation, {"level": level, "seed": seed, "category": level,
                         "mission": self.env.mission, "state_key": self._state_key()}

  def _step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
    if action == MULTIPLE_ACTIONS:
      # AgentGym's client answers this without calling the server: nothing is scored.
      return (MULTIPLE_ACTIONS_OBSERVATION, 0.0, False, False,
              self._info() | {"invalid_action": True})
    action = action.lower().strip()
    succeeded = terminated = invalid = False
    if "check" in action:
      state = "You can take the following actions: " + ", ".join(self.view.actions)
    elif not action:
      state, invalid = "No change in state.", True
    elif action not in self.view.actions:
      state, invalid = self.view.errors.get(action, _NOT_RECOGNIZED), True
    elif not self.view.actions[action]:
      state = "No change in state."
    else:
      finished = self._run_macro(self.view.actions[action])
      state = self.view.description + (_COMPLETED if finished else "")
      succeeded = finished and self._last_reward > 0
      terminated = succeeded and (self.reward_mode == "normalized" or self._last_reward > 0.5)
    self._score += self._last_reward
    self._success = self._success or succeeded
    if self.reward_mode == "paper":
      reward = self._score
    else:
      reward = min(max(self._last_reward, 0.0), 1.0) if succeeded else 0.0
    return (f"{state}\n{self.view.actions_text()}", reward, terminated, False,
            self._info() | {"invalid_action": invalid})

  # AgentGym's BabyAI client: the single "Action:" line, reduced to [A-Za-z0-9, ].
  parse_action = staticmethod(parse_single_action)

  def expert_action(self) -> str:
    """minigrid's BabyAIBot, followed through the longest macro that keeps to its plan."""
    if self.env is None:
      raise RuntimeError("babyai: call reset() before expert_action().")
    if self._expert is None:
      self._expert = expert_lib.Expert(self.env)
    return self._expert.next_action(self.env, self.view.actions, self._image)

  def random_action(self, rng: random.Random) -> str:
    return rng.choice(sorted(self.view.actions))

  # ----- helpers ---------------------------------------------------------------------------

  def _run_macro(self, primitives: list[int]) -> bool:
    """Runs primitives until one leaves the view unchanged; returns minigrid's `terminated`
    after the last one run, and renders the new view."""
    terminated = False
    for primitive in primitives:
      obs, reward, terminated, _, _ = self.env.step(primitive)
      unchanged = np.array_equal(obs["image"], self._image)
      self._image = obs["image"]
      if unchanged:
        break
    self._last_reward = float(reward)
    self.view = text.render(self.env, self._image)
    return bool(terminated)

  def _info(self) -> dict[str, Any]:
    return {"success": self._success, "score": self._score, "state_key": self._state_key()}

  def _state_key(self) -> str:
    """What the agent acts from, exactly: the grid (doors, objects), its pose and its load.

    Turn-level credit (`rl.advantages.gigpo`) groups turns by this key; the observation text
    would not do here, since a refused action answers the same words from any state.
    """
    carrying = self.env.carrying.encode() if self.env.carrying is not None else None
    pose = f"{self.env.mission}|{tuple(self.env.agent_pos)}|{self.env.agent_dir}|{carrying}|"
    return hashlib.blake2b(pose.encode() + self.env.grid.encode().tobytes(),
                           digest_size=8).hexdigest()
