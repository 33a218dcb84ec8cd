"""The text-environment interface every environment implements.

An environment is a `gymnasium.Env` whose observations and actions are strings. The episode
runner (in `agentgym_jax.rollout`) only ever talks to this interface, through the worker pool
or over HTTP, so a new environment is one subclass (in its own package) plus one
`environments.register(...)` line.

Contract (see docs/design.md):
  reset(seed=None, options={"task_id": N}) -> (observation, info)   info["instruction"], ["task_id"]
  step(action) -> (observation, reward, terminated, truncated, info)  info["success"], ["score"]

`reward` is normalised to [0, 1] unless the environment was made with `reward_mode="paper"`, in
which case it is the upstream AgentGym server's raw value; `info["score"]` always carries the
raw value. An environment never raises on a bad action: it answers with an observation that
says what was wrong, reward 0, and stays alive.
"""

from __future__ import annotations

import abc
import random
import re
import string
from typing import Any

import gymnasium
from gymnasium import spaces

REWARD_MODES = ("normalized", "paper")
# The agent's canned first reply to the instruction, as in AgentGym's conversation opening.
DEFAULT_ACKNOWLEDGEMENT = "OK. I'll follow your instructions and try my best to solve the task."

# Observations and actions are free text; the declared charset only documents that.
_TEXT_SPACE = spaces.Text(max_length=1 << 20, charset=string.printable)


class TextEnv(gymnasium.Env, abc.ABC):
  """Base class: text in, text out, one task instance per `task_id`.

  Subclasses implement `_reset(task_id)`, `_step(action)`, `parse_action`, `format_action`,
  `expert_action`, `random_action`, and set `name` and `instruction`.
  """

  name: str = ""
  # The task instructions shown to the agent as the first user message (action grammar,
  # Thought/Action format). Written per environment.
  instruction: str = ""
  # The agent's canned first reply to the instruction (some environments have their own).
  acknowledgement: str = DEFAULT_ACKNOWLEDGEMENT
  metadata = {"render_modes": []}
  observation_space = _TEXT_SPACE
  action_space = _TEXT_SPACE

  def __init__(self, reward_mode: str = "normalized"):
    if reward_mode not in REWARD_MODES:
      raise ValueError(f"reward_mode must be one of {REWARD_MODES}, got {reward_mode!r}.")
    self.reward_mode = reward_mode
    self.task_id: int | None = None
    self.done = False
    self.action_chars = 0  # characters of the last action given to `step`, before sanitising

  # ----- gymnasium API ---------------------------------------------------------------------

  def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
    super().reset(seed=seed)
    options = options or {}
    if "task_id" in options:
      task_id = int(options["task_id"])
    elif seed is not None:
      task_id = int(seed)
    else:
      raise ValueError(f"{self.name}: reset needs options={{'task_id': N}} (or a seed).")
    self.task_id = task_id
    self.done = False
    observation, info = self._reset(task_id)
    info.setdefault("instruction", self.instruction)
    info["task_id"] = task_id
    return observation, info

  def step(self, action: str):
    if self.task_id is None:
      raise RuntimeError(f"{self.name}: call reset(options={{'task_id': N}}) before step().")
    if self.done:
      return ("The episode has ended; reset the environment to start a new task.", 0.0, True,
              False, {"success": False, "score": 0.0, "task_id": self.task_id})
    # The length the agent sent: `sanitize_text` caps it, and an environment that refuses long
    # actions must report the real one.
    self.action_chars = len(action)
    action = sanitize_text(action)
    observation, reward, terminated, truncated, info = self._step(action)
    self.done = bool(terminated or truncated)
    info.setdefault("success", False)
    info.setdefault("score", reward)
    info["task_id"] = self.task_id
    return observation, float(reward), bool(terminated), bool(truncated), info

  def play_expert(self, task_id: int, max_steps: int = 300
                  ) -> tuple[float, dict[str, Any], list[str]]:
    """Plays `expert_action()` on task `task_id` until the episode ends or `max_steps`.

    Returns the last step's reward and info and the actions taken (expert checks,
    demonstrations). An episode still running after `max_steps` has info["success"] False.
    """
    self.reset(options={"task_id": task_id})
    reward, info, actions = 0.0, {"success": False}, []
    for _ in range(max_steps):
      actions.append(self.expert_action())
      _, reward, terminated, truncated, info = self.step(actions[-1])
      if terminated or truncated:
        break
    return reward, info, actions

  # ----- per environment -------------------------------------------------------------------

  @abc.abstractmethod
  def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
    """Loads task `task_id`; returns the first observation and info."""

  @abc.abstractmethod
  def _step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
    """Applies a sanitised action string."""

  @staticmethod
  @abc.abstractmethod
  def parse_action(response: str) -> str:
    """The action string inside the agent's full response (never raises)."""

  @staticmethod
  @abc.abstractmethod
  def format_action(action: str, thought: bool = True) -> str:
    """An agent response carrying `action`; `parse_action(format_action(a)) == a`.

    With `thought=False` the response carries the action alone, without the reasoning text
    the format asks for (a weaker demonstration).
    """

  @abc.abstractmethod
  def expert_action(self) -> str:
    """The expert's next action in the current state."""

  def random_action(self, rng: random.Random) -> str:
    """An action drawn uniformly from those valid in the current state (noisy teachers)."""
    raise NotImplementedError(f"{self.name or type(self).__name__} has no random_action(); "
                              "expert noise (bc.noise > 0) needs one.")

  @classmethod
  def task_categories(cls, shipped: dict[int, str], **kwargs) -> dict[int, str]:
    """Task id -> the category `reset` reports in an environment built with `kwargs`.

    `shipped` is the split file's mapping, written for the default arguments; an environment
    whose arguments change which task an id is (BabyAI's `levels`) maps them again."""
    del kwargs
    return shipped


class ReActEnv(TextEnv):
  """A TextEnv whose agent replies in AgentGym's ReAct format, "Thought: ... Action: ...".

  BabyAI, TextCraft and SciWorld: their expert's replies differ only in the thought they carry
  (`expert_thought`); each parses replies as its own AgentGym client does (`parse_action`).
  """

  # The "Thought:" text of the expert's demonstrations.
  expert_thought: str = ""

  @classmethod
  def format_action(cls, action: str, thought: bool = True) -> str:
    return react_response(action, cls.expert_thought if thought else None)


def sanitize_text(text: str | bytes, max_chars: int = 8192) -> str:
  """Decodes bytes leniently, drops NUL/control characters and caps the length.

  Keeps simulators (a JVM, a regex engine) safe from binary or huge inputs. The caller's
  parser still decides whether the result is a valid action.
  """
  if isinstance(text, bytes):
    text = text.decode("utf-8", errors="replace")
  text = str(text)[:max_chars]
  return "".join(ch for ch in text if ch in "\n\t" or ch.isprintable())


# ----- AgentGym's TextCraft/BabyAI client-side action extraction ----------------------------

# What AgentGym's TextCraft and BabyAI clients answer, without stepping the server, when a
# response holds more than one "Action:".
MULTIPLE_ACTIONS_OBSERVATION = (
    "Error: Only one 'Action' is allowed per response. Please adjust your response.")
# `parse_single_action`'s result for such a response. It contains characters the sanitiser
# removes from real actions, so no agent action can equal it.
MULTIPLE_ACTIONS = "<more than one Action>"

_ACTION_LINE = re.compile(r"Action:\s*(.*?)(?=\n|$)", re.DOTALL)
_NOT_ACTION_CHAR = re.compile(r"[^A-Za-z0-9, ]+")


def react_response(action: str, thought: str | None) -> str:
  """A reply in AgentGym's ReAct format, "Thought:\n...\n\nAction:\n<action>" (the BabyAI,
  TextCraft and SciWorld clients parse it); without a thought, the "Action:" part alone."""
  if thought is None:
    return f"Action:\n{action}"
  return f"Thought:\n{thought}\n\nAction:\n{action}"


def parse_single_action(response: str | bytes) -> str:
  """The action in a ReAct response, as AgentGym's TextCraft and BabyAI clients extract it.

  The text on the line of (or, after blank space, the line following) the only "Action:";
  `MULTIPLE_ACTIONS` when there are several; "" when there is none. Everything but letters,
  digits, commas and spaces is removed and runs of white space become one space.
  """
  if isinstance(response, bytes):
    response = response.decode("utf-8", errors="replace")
  matches = _ACTION_LINE.findall(str(response))
  if len(matches) > 1:
    return MULTIPLE_ACTIONS
  action = _NOT_ACTION_CHAR.sub("", matches[-1]) if matches else ""
  return " ".join(action.split())
