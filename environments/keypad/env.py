"""`keypad`: a one-digit lock whose code the observation shows; the RL learning check.

Task N has a code digit (drawn from N) and every observation shows it:

  Code: 7.

The agent's action is the first digit anywhere in its reply; the right digit opens the lock
(success, episode over) with reward 1 / (turn number), a wrong one is answered
`Wrong. Code: 7.`, a reply without a digit `No digit. Code: 7.`. After `max_steps` turns the
episode is truncated. The reward falls with the turn so that reading the code beats guessing
and retrying: with success alone as the reward, a policy that guesses among few codes and
retries after "Wrong." is nearly as good as one that reads.

Why it is shaped like this: a randomly initialised model samples nearly uniform tokens, so the
reward must be reachable by chance but rarely. With a small byte-level vocabulary (~300 ids, of
which 10 are digits) and 8-token replies, a random reply holds a digit about a quarter of the
time and the right one a tenth of those, so a random policy succeeds in a few percent of
episodes (under 20% within 3 turns), while a policy that copies the shown digit succeeds
always. The short texts keep episodes near 100 tokens, so a CPU trains in minutes. It checks
the RL math end to end: signs (success must rise), masks (only the sampled digit is credited),
multi-turn credit (a later-turn success is rewarded too).
"""

from __future__ import annotations

import random
import re
from typing import Any

from environments.base import TextEnv

INSTRUCTION = "Open the lock: reply with the code digit."
_DIGIT = re.compile(r"[0-9]")


class KeypadEnv(TextEnv):
  """One code digit per task; see the module docstring.

  Args:
    reward_mode: "normalized" or "paper" (the same here: 1 / turn on success, else 0).
    max_steps: turns before the episode is truncated.
    codes: the digits codes are drawn from (fewer digits make the task easier).
  """

  name = "keypad"
  instruction = INSTRUCTION
  acknowledgement = "OK."

  def __init__(self, reward_mode: str = "normalized", max_steps: int = 3,
               codes: str = "0123456789"):
    super().__init__(reward_mode)
    if max_steps < 1:
      raise ValueError(f"max_steps must be >= 1, got {max_steps}.")
    if not codes or not all(c.isdigit() for c in codes) or len(set(codes)) != len(codes):
      raise ValueError(f"codes must be distinct digits, e.g. '0123456789'; got {codes!r}.")
    self.max_steps = max_steps
    self.codes = codes
    self.code = ""
    self.steps = 0

  def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
    if task_id < 0:
      raise ValueError(f"keypad: task ids are >= 0, got {task_id}.")
    self.code = random.Random(task_id).choice(self.codes)
    self.steps = 0
    # The code is the task's category: evaluation reports success per code digit.
    return f"Code: {self.code}.", {"code": self.code, "category": f"code {self.code}"}

  def _step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
    self.steps += 1
    if action == self.code:
      reward = 1.0 / self.steps
      return "Unlocked.", reward, True, False, {"success": True, "score": reward}
    head = "Wrong." if action else "No digit."
    truncated = self.steps >= self.max_steps
    return f"{head} Code: {self.code}.", 0.0, False, truncated, {"success": False, "score": 0.0}

  @staticmethod
  def parse_action(response: str) -> str:
    """The first digit in the response, or "" when it has none."""
    match = _DIGIT.search(response)
    return match.group(0) if match else ""

  @staticmethod
  def format_action(action: str, thought: bool = True) -> str:
    return action

  def expert_action(self) -> str:
    return self.code

  def random_action(self, rng: random.Random) -> str:
    return rng.choice(self.codes)
