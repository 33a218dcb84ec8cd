"""AgentGym's environment-server protocol, per environment: request keys and response shapes.

Every AgentGym env server holds many instances keyed by an integer and answers `/create`,
`/reset`, `/step`, `/observation` and `/close`, but each names its fields its own way:

| env       | id key  | /reset body | /create answers   | /reset answers         | /step fields    |
|-----------|---------|-------------|-------------------|------------------------|-----------------|
| babyai    | id      | data_idx    | {id}              | observation, score...  | + reward, score |
| textcraft | id      | data_idx    | {id, observation} | {id, observation...}   | + reward        |
| sciworld  | id      | data_idx    | {id}              | task_description, obs. | + reward, score |
| searchqa  | env_idx | id          | a bare int        | the observation text   | + reward, info  |
| webarena  | env_idx | idx, seed=0 | {env_idx}         | {observation, ...}     | see below       |

Every /step answer has `observation` and `done`, except WebArena's, which has observation,
reward, terminated, truncated and info.

Where a `score` field exists it is the cumulative raw score and `reward` is its change since
the last step; AgentGym's clients report `score` as the step reward (BabyAI, SciWorld), else
`reward`. WebArena's reward counts only when `terminated`.

One `Protocol` object per environment, given where the environment is registered
(`environments.register`), builds the server's answers (`environments.server`) and reads them
back (`environments.client`), so the two directions cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

# The values of `Protocol.create_resets_to`.
CREATE_RESETS = (None, "own_id", "body")


@dataclasses.dataclass(frozen=True)
class StepReply:
  """A /step answer as the client reads it. `raw_reward` is the value AgentGym reports."""

  observation: str
  raw_reward: float
  terminated: bool
  truncated: bool


@dataclasses.dataclass(frozen=True)
class Protocol:
  """The field names and answer shapes of one environment's AgentGym server.

  Attributes:
    name: the environment's name in `environments.REGISTRY`, set by `environments.register`.
    id_key: the key that carries the instance id in requests ("id" or "env_idx").
    reset_key: the key that carries the task id in the /reset body.
    score_field: "score" when /step reports a cumulative score beside a per-step reward.
    reward_scale: the raw reward of a fully solved task (SciWorld scores run to 100).
    create_resets_to: the task upstream's server resets a new instance to on /create: None
      (none; the client resets it), "own_id" (the task whose id is the instance's: TextCraft,
      whose client reads the observation from the /create answer) or "body" (the task that
      the /create body names under `reset_key`, when it names one: SearchQA preloads it).
  """

  name: str = ""
  id_key: str = "id"
  reset_key: str = "data_idx"
  score_field: str | None = None
  reward_scale: float = 1.0
  create_resets_to: str | None = None

  def __post_init__(self):
    if self.create_resets_to not in CREATE_RESETS:
      raise ValueError(f"create_resets_to must be one of {CREATE_RESETS}, got "
                       f"{self.create_resets_to!r}.")

  # ----- requests (client side) --------------------------------------------------------------

  def create_body(self) -> dict[str, Any] | None:
    return None

  def reset_body(self, instance_id: int, task_id: int) -> dict[str, Any]:
    return {self.id_key: instance_id, self.reset_key: task_id}

  def step_body(self, instance_id: int, action: str) -> dict[str, Any]:
    return {self.id_key: instance_id, "action": action}

  def close_body(self, instance_id: int) -> dict[str, Any]:
    return {self.id_key: instance_id}

  # ----- answers: built by the server, read by the client ------------------------------------

  def create_response(self, instance_id: int, observation: str | None) -> Any:
    return {self.id_key: instance_id}

  def read_create(self, response: Any) -> int:
    return int(_field(response, self.id_key, "/create"))

  def reset_response(self, instance_id: int, observation: str, info: dict[str, Any]) -> Any:
    response = {"observation": observation, "reward": 0.0, "done": False}
    if self.score_field:
      response[self.score_field] = 0.0
    return response

  def read_reset(self, response: Any) -> str:
    return str(_field(response, "observation", "/reset"))

  def step_response(self, observation: str, raw: float, previous_raw: float,
                    terminated: bool, truncated: bool) -> dict[str, Any]:
    response: dict[str, Any] = {"observation": observation}
    if self.score_field:
      response["reward"] = raw - previous_raw
      response[self.score_field] = raw
    else:
      response["reward"] = raw
    response["done"] = terminated or truncated
    return response

  def read_step(self, response: Any) -> StepReply:
    raw = _field(response, self.score_field or "reward", "/step")
    # AgentGym's "done" folds truncation (e.g. ScienceWorld's move limit) into termination.
    return StepReply(str(_field(response, "observation", "/step")), float(raw),
                     bool(_field(response, "done", "/step")), False)

  def observation_response(self, observation: str, last_step: dict[str, Any]) -> Any:
    """GET /observation: the current observation text."""
    return observation

  def close_response(self) -> Any:
    return True

  def answer_locally(self, action: str) -> str | None:
    """The observation AgentGym's client answers `action` with itself, without a request to
    the server; None sends the action."""
    return None

  # ----- rewards -----------------------------------------------------------------------------

  def normalize(self, raw: float) -> float:
    """The raw AgentGym reward mapped to [0, 1] (failures below 0 count as 0)."""
    return min(max(raw / self.reward_scale, 0.0), 1.0)

  def is_success(self, raw: float, terminated: bool) -> bool:
    return terminated and raw >= self.reward_scale


class BabyAI(Protocol):

  def reset_response(self, instance_id, observation, info):
    return {"observation": observation, "reward": 0.0, "score": 0.0, "deleted": False,
            "done": False}

  def observation_response(self, observation, last_step):
    # BabyAI's GET /observation answers the whole state record, not just the text.
    return {"observation": observation, "reward": last_step.get("reward", 0.0),
            "score": last_step.get("score", 0.0), "done": last_step.get("done", False),
            "deleted": False}

  def is_success(self, raw, terminated):
    # MiniGrid's success reward decays with the step count, so any positive score at the end
    # is a success (BabyAI ends episodes only on success).
    return terminated and raw > 0


class TextCraft(Protocol):

  def create_body(self):
    # TextCraft's server declares a (nullable) body for custom recipes; without one it
    # answers 422.
    return {"commands": None, "goal": None}

  def create_response(self, instance_id, observation):
    # TextCraft's server resets a new instance right away and its client reads the text.
    return {"id": instance_id, "observation": observation, "done": False, "reward": 0}

  def reset_response(self, instance_id, observation, info):
    return {"id": instance_id, "observation": observation, "done": False, "reward": 0}


class SciWorld(Protocol):

  def reset_response(self, instance_id, observation, info):
    # The client rebuilds the first observation as task_description + "\n" + observation.
    task_description, _, look = observation.partition("\n")
    return {"task_name": info.get("task_name", ""), "var_num": info.get("variation", 0),
            "task_description": task_description, "observation": look, "reward": 0.0,
            "score": 0.0, "deleted": False, "done": False}

  def read_reset(self, response):
    return (str(_field(response, "task_description", "/reset")) + "\n"
            + str(_field(response, "observation", "/reset")))


class SearchQA(Protocol):

  def create_body(self):
    # SearchQA's server requires an item to preload; the client resets right after anyway.
    return {"id": 0}

  def create_response(self, instance_id, observation):
    return instance_id

  def read_create(self, response):
    if isinstance(response, bool) or not isinstance(response, int):
      raise ProtocolError(f"/create should answer a bare instance id, got {response!r}.")
    return response

  def reset_response(self, instance_id, observation, info):
    return observation

  def read_reset(self, response):
    if not isinstance(response, str):
      raise ProtocolError(f"/reset should answer the observation text, got {response!r}.")
    return response

  def step_response(self, observation, raw, previous_raw, terminated, truncated):
    response = super().step_response(observation, raw, previous_raw, terminated, truncated)
    response["info"] = None
    return response


class WebArena(Protocol):

  def reset_body(self, instance_id, task_id):
    return {"env_idx": instance_id, "seed": 0, "idx": task_id}

  def reset_response(self, instance_id, observation, info):
    return {"observation": observation}

  def read_reset(self, response):
    observation = str(_field(response, "observation", "/reset"))
    if observation == "TimeoutError":
      # WebArena's server reports a browser that did not come up this way.
      raise TimeoutError("WebArena's /reset timed out; the web server may need a restart.")
    return observation

  def step_response(self, observation, raw, previous_raw, terminated, truncated):
    return {"observation": observation, "reward": raw, "terminated": terminated,
            "truncated": truncated, "info": {}}

  def read_step(self, response):
    terminated = bool(_field(response, "terminated", "/step"))
    # The evaluator's score is meaningful only once the episode has ended.
    raw = float(_field(response, "reward", "/step")) if terminated else 0.0
    return StepReply(str(_field(response, "observation", "/step")), raw, terminated,
                     bool(response.get("truncated", False)))

  def close_response(self):
    return {"closed": "closed"}

  def answer_locally(self, action):
    # WebArena's server parses the ``` action out of the full response; AgentGym's client
    # answers a response without one itself.
    if re.search(r"```(.*?)```", action, re.DOTALL):
      return None
    return ("Cannot parse action from response. Your action should be inside triple backticks "
            "(```). Please adjust accordingly.")


class ProtocolError(ValueError):
  """An answer that does not have the shape the environment's protocol prescribes."""


def _field(response: Any, key: str, endpoint: str) -> Any:
  if not isinstance(response, dict) or key not in response:
    raise ProtocolError(f"{endpoint} answer lacks field {key!r}: {str(response)[:300]}")
  return response[key]
