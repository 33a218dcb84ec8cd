"""`scripted`: find the key in one of three boxes, a task a tiny model can learn in minutes.

Task N draws (deterministically from N) three boxes out of `BOXES`, one of which holds the key,
and one decoy the note rules out. The first observation lists the boxes and the note:

  Boxes: bread, river, stone. A note says: the key is not in the river.

The agent answers `Action: open <box>`. Opening the right box ends the episode with success and
reward 1 / (turn number), so a first-turn find earns 1.0, the second 0.5, the third 1/3; a wrong
box is answered `The stone is empty. Boxes left: bread, river.`; anything else is an invalid
action (it counts as a turn). After `max_steps` turns the episode is truncated. A random policy
that learns only the action format succeeds within three turns; one that also reads the note
earns more. Rewards are the same in both reward modes.

`filler_words` appends that many filler words to every observation (benchmarks need long
observations), and `vary_filler` varies the count per step, so observation lengths differ.
`step_latency_s` makes every step wait that long (sleeping, as a call to a remote server
waits), to measure how a rollout copes with slow environments.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any

from environments.base import TextEnv

BOXES = ("apple", "bread", "chair", "cloud", "field", "lamp", "river", "stone", "table",
         "tower", "wheel", "window")
INSTRUCTION = (
    "One of the boxes in this room holds a key. Every round I give you an observation and you "
    "answer with one action to open a box, in the format \"Action: open <box>\". Find the key "
    "in as few rounds as you can.")
_FILLER = ("the room is quiet and the light is dim while dust drifts over the old floor "
           "boards near the door").split()
_ACTION = re.compile(r"Action:\s*(.*?)(?=\n|$)", re.DOTALL)


class ScriptedEnv(TextEnv):
  """Three boxes, one key; see the module docstring."""

  name = "scripted"
  instruction = INSTRUCTION

  def __init__(self, reward_mode: str = "normalized", max_steps: int = 3,
               filler_words: int = 0, vary_filler: bool = False, step_latency_s: float = 0.0):
    super().__init__(reward_mode)
    if max_steps < 1:
      raise ValueError(f"max_steps must be >= 1, got {max_steps}.")
    if filler_words < 0:
      raise ValueError(f"filler_words must be >= 0, got {filler_words}.")
    if step_latency_s < 0:
      raise ValueError(f"step_latency_s must be >= 0 seconds, got {step_latency_s}.")
    self.step_latency_s = step_latency_s
    self.max_steps = max_steps
    self.filler_words = filler_words
    self.vary_filler = vary_filler
    self.boxes: list[str] = []
    self.key_box = ""
    self.decoy = ""
    self.steps = 0

  def _filler(self) -> str:
    count = self.filler_words
    if self.vary_filler and count:
      # Deterministic per (task, step), between half and all of filler_words.
      count = count // 2 + (self.task_id * 7 + self.steps * 13) % (count // 2 + 1)
    if not count:
      return ""
    words = [_FILLER[i % len(_FILLER)] for i in range(count)]
    return " " + " ".join(words).capitalize() + "."

  def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
    if task_id < 0:
      raise ValueError(f"scripted: task ids are >= 0, got {task_id}.")
    rng = random.Random(task_id)
    self.boxes = rng.sample(BOXES, 3)
    self.key_box, self.decoy = rng.sample(self.boxes, 2)
    self.steps = 0
    observation = (f"Boxes: {', '.join(self.boxes)}. A note says: the key is not in the "
                   f"{self.decoy}.")
    return observation + self._filler(), {"boxes": list(self.boxes)}

  def _step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
    if self.step_latency_s:
      time.sleep(self.step_latency_s)
    self.steps += 1
    words = action.lower().split()
    box = words[1] if len(words) == 2 and words[0] == "open" else None
    if box == self.key_box:
      reward = 1.0 / self.steps
      return (f"You open the {box} and find the key.", reward, True, False,
              {"success": True, "score": reward})
    if box in self.boxes:
      self.boxes.remove(box)
      observation = f"The {box} is empty. Boxes left: {', '.join(self.boxes)}."
    elif box is not None:
      observation = f"There is no {box} here. Boxes: {', '.join(self.boxes)}."
    else:
      observation = f"Invalid action {action!r}. Answer \"Action: open <box>\"."
    truncated = self.steps >= self.max_steps
    return observation + self._filler(), 0.0, False, truncated, {"success": False, "score": 0.0}

  @staticmethod
  def parse_action(response: str) -> str:
    """The last line after "Action:" (AgentGym's TextCraft/BabyAI client rule), letters only."""
    matches = _ACTION.findall(response)
    action = matches[-1] if matches else ""
    action = re.sub(r"[^A-Za-z0-9, ]+", "", action)
    return " ".join(action.split())

  @staticmethod
  def format_action(action: str, thought: bool = True) -> str:
    return f"Action: {action}"

  def expert_action(self) -> str:
    return f"open {self.key_box}"

  def random_action(self, rng: random.Random) -> str:
    return f"open {rng.choice(self.boxes)}"
