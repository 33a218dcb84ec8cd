"""ScienceWorld (AgentGym's SciWorld) as a `TextEnv`.

Wraps the `scienceworld` package (a Scala simulator behind py4j; needs Java >= 1.8) the way
AgentGym's agentenv-sciworld server does:

  * task id N -> (task name, variation) through AgentGym's 4,639-game index (`games.py`);
  * reset loads the game without simplifications and answers
    `task description + "\n" + <output of "look around">`;
  * each step's observation is ScienceWorld's raw output;
  * the reward is ScienceWorld's cumulative score at that step (0..100, -100 when the task
    failed, e.g. by focusing on the wrong object), not the per-step delta, because AgentGym's
    client reports `score` as the reward and the rollout keeps only the last step's value. The
    default `reward_mode="normalized"` divides by 100 and clips failures to 0;
    `reward_mode="paper"` gives the raw score. `info["score"]` is always raw;
  * an episode ends when the task is completed or failed (terminated), or after ScienceWorld's
    100-move limit (truncated).

Actions follow AgentGym's ReAct client: everything after the last "Action:" in the response,
stripped ("" when there is none). Unrecognised commands, the empty one included, cost no move
and get ScienceWorld's own answer, "No known action matches that input." Actions longer than
`MAX_ACTION_CHARS` are answered by the wrapper and never reach the simulator. Neither changes
the score, so the reward of such a step is the unchanged current score (0 before any progress).

One JVM is started per instance (~0.8 s) and reused across resets; call `close()` (or use the
env as a context manager) to stop it. The expert replays ScienceWorld's gold action sequence,
which is generated lazily the first time `expert_action()` is called in an episode.
"""

from __future__ import annotations

import random
from typing import Any

from environments.base import ReActEnv
from environments.sciworld import games

INSTRUCTION = (
    "You are an agent for science world. Every round I will give you an observation, you have "
    "to respond an action based on the observation to finish the given task. Here are the "
    "actions you may take: "
    "[{\"action\": \"open/close OBJ\", \"description\": \"open/close a container\"}, "
    "{\"action\": \"de/activate OBJ\", \"description\": \"activate/deactivate a device\"}, "
    "{\"action\": \"connect OBJ to OBJ\", \"description\": \"connect electrical components\"}, "
    "{\"action\": \"disconnect OBJ\", \"description\": \"disconnect electrical components\"}, "
    "{\"action\": \"use OBJ [on OBJ]\", \"description\": \"use a device/item\"}, "
    "{\"action\": \"look around\", \"description\": \"describe the current room\"}, "
    "{\"action\": \"look at OBJ\", \"description\": \"describe an object in detail\"}, "
    "{\"action\": \"look in OBJ\", \"description\": \"describe a container's contents\"}, "
    "{\"action\": \"read OBJ\", \"description\": \"read a note or book\"}, "
    "{\"action\": \"move OBJ to OBJ\", \"description\": \"move an object to a container\"}, "
    "{\"action\": \"pick up OBJ\", \"description\": \"move an object to the inventory\"}, "
    "{\"action\": \"put down OBJ\", \"description\": \"drop an inventory item\"}, "
    "{\"action\": \"pour OBJ into OBJ\", \"description\": \"pour a liquid into a container\"}, "
    "{\"action\": \"dunk OBJ into OBJ\", \"description\": \"dunk a container into a liquid\"}, "
    "{\"action\": \"mix OBJ\", \"description\": \"chemically mix a container\"}, "
    "{\"action\": \"go to LOC\", \"description\": \"move to a new location\"}, "
    "{\"action\": \"eat OBJ\", \"description\": \"eat a food\"}, "
    "{\"action\": \"flush OBJ\", \"description\": \"flush a toilet\"}, "
    "{\"action\": \"focus on OBJ\", \"description\": \"signal intent on a task object\"}, "
    "{\"action\": \"wait\", \"description\": \"take no action for 10 iterations\"}, "
    "{\"action\": \"wait1\", \"description\": \"take no action for 1 iteration\"}, "
    "{\"action\":\"examine OBJ\",\"description\":\"provides a description of the objects "
    "present on or in a receptacle.\"}, "
    "{\"action\": \"task\", \"description\": \"describe current task\"}, "
    "{\"action\": \"inventory\", \"description\": \"list your inventory\"}]\n"
    "Your response should use the following format:\nThought:\nyour thoughts.\n\nAction:\n"
    "your next action")

# ScienceWorld commands are a handful of words (the longest gold action on the test split has
# 81 characters). Longer input is refused before it reaches the JVM's parser.
MAX_ACTION_CHARS = 300
STEP_LIMIT = 100  # AgentGym's server uses ScienceWorldEnv's default envStepLimit.


class SciWorldEnv(ReActEnv):
  """ScienceWorld task `task_id` of AgentGym's 4,639-game index (see `games.py`)."""

  name = "sciworld"
  instruction = INSTRUCTION
  expert_thought = "I follow the plan."

  def __init__(self, reward_mode: str = "normalized", step_limit: int = STEP_LIMIT):
    super().__init__(reward_mode)
    # Imported here: the game index and the action parser work without scienceworld installed.
    import scienceworld

    self.step_limit = step_limit
    self._sw = scienceworld.ScienceWorldEnv("", envStepLimit=step_limit)
    self._game: tuple[str, int] | None = None
    self._history: list[str] = []  # actions sent to ScienceWorld this episode
    self._gold: list[str] | None = None
    self._score = 0

  # ----- TextEnv ---------------------------------------------------------------------------

  def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
    self._game = games.game(task_id)
    self._load(generate_gold=False)
    task_description = self._sw.get_task_description()
    observation = self._sw_step("look around")[0]
    # AgentGym's "look around" is part of reset, not an agent action.
    self._history = []
    task_name, variation = self._game
    return task_description + "\n" + observation, {
        "task_name": task_name, "variation": variation, "category": task_name}

  def _step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
    if len(action) > MAX_ACTION_CHARS:
      return self._unchanged(
          f"Your action is {self.action_chars} characters long; ScienceWorld commands are short "
          f"(at most {MAX_ACTION_CHARS} characters), e.g. 'open door to kitchen'.")
    observation, completed, moves = self._sw_step(action)
    self._history.append(action)
    terminated = completed or self._score < 0
    truncated = moves > self.step_limit and not terminated
    return observation, self._reward(), terminated, truncated, self._info(moves)

  @staticmethod
  def parse_action(response: str) -> str:
    """Everything after the last "Action:", stripped (AgentGym's `parse_react`); "" if none."""
    response = response.strip()
    if response.endswith("</s>"):
      response = response[:-len("</s>")]
    if "Action:" not in response:
      return ""
    return response.rsplit("Action:", 1)[1].strip()

  def expert_action(self) -> str:
    """The next action of ScienceWorld's gold sequence for this game.

    Open-loop: it is the gold action at position len(actions taken so far), so it solves the
    task when every earlier action also came from the expert. The gold path is generated the
    first time this is called in an episode, by reloading the game with gold-path generation
    on and replaying the episode's actions (ScienceWorld is deterministic per variation).
    """
    if self._game is None:
      raise RuntimeError("sciworld: call reset() before expert_action().")
    if self._gold is None:
      history, score = self._history, self._score
      self._load(generate_gold=True)
      self._sw_step("look around")
      for action in history:
        self._sw_step(action)
      if self._score != score:
        raise RuntimeError(f"sciworld: replaying {len(history)} actions of game {self._game} "
                           f"gave score {self._score}, the episode had {score}.")
      self._history = history
      self._gold = list(self._sw.get_gold_action_sequence())
    index = len(self._history)
    return self._gold[index] if index < len(self._gold) else "look around"

  def random_action(self, rng: random.Random) -> str:
    return rng.choice(sorted(self._sw.get_valid_action_object_combinations()))

  def close(self) -> None:
    """Stops the JVM. Idempotent."""
    sw, self._sw = getattr(self, "_sw", None), None
    if sw is not None:
      sw.close()

  # ----- helpers ---------------------------------------------------------------------------

  def _load(self, generate_gold: bool) -> None:
    if self._sw is None:
      raise RuntimeError("sciworld: the environment was closed; make a new one.")
    task_name, variation = self._game
    self._sw.load(task_name, variation, "", generateGoldPath=generate_gold)
    self._gold = None
    self._score = 0

  def _sw_step(self, action: str) -> tuple[str, bool, int]:
    """One ScienceWorld step: (observation, completed, moves); updates the score.

    Computes score and completion as `ScienceWorldEnv.step` does (score = round(100 *
    progress)) without its per-step extras (look, inventory, the hundreds of valid actions),
    which cost ~10x the step itself (benchmarks/sciworld_step.py).
    """
    server = self._sw.server
    observation = server.step(action)
    self._score = int(round(100 * server.getScore()))
    return observation, bool(server.getCompleted()), int(server.getNumMoves())

  def _reward(self) -> float:
    if self.reward_mode == "paper":
      return float(self._score)
    return max(self._score, 0) / 100.0

  def _info(self, moves: int) -> dict[str, Any]:
    task_name, variation = self._game
    return {"score": float(self._score), "success": self._score >= 100, "moves": moves,
            "task_name": task_name, "variation": variation, "category": task_name}

  def _unchanged(self, observation: str):
    """A refused action: the simulator never sees it and the episode goes on."""
    info = self._info(int(self._sw.server.getNumMoves()))
    info["invalid_action"] = True
    return observation, self._reward(), False, False, info
