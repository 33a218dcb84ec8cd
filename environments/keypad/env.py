"""`keypad`: a lock whose code the observation shows; the RL learning checks.

Task N has a code (its digits drawn from N) and every observation shows it:

  Code: 7.

The agent's action is the first digit anywhere in its reply. With a one-digit code (the
default) the right digit opens the lock (success, episode over) with reward 1 / (turn number),
a wrong one is answered `Wrong. Code: 7.`, a reply without a digit `No digit. Code: 7.`. After
`max_steps` turns the episode is truncated. The reward falls with the turn so that reading the
code beats guessing and retrying: with success alone as the reward, a policy that guesses among
few codes and retries after "Wrong." is nearly as good as one that reads.

A code of `length` > 1 digits is entered one digit per turn: the right next digit is answered
`Right. Code: 372. Entered: 3.`, anything else leaves what was entered as it was
(`Wrong. Code: 372. Entered: 3.`), and the last digit opens the lock. Each right digit adds
1 / (length * (1 + replies that were not the right digit so far)) to the reward (which is, as
for every environment, the episode's reward so far), so a perfect entry earns 1 and a one-digit
code keeps the 1 / turn reward. Every turn is a decision of its own whose worth the
episode's outcome mixes with the others': the test bed of turn-level credit
(experiments/keypad/credit.py). `info["state_key"]` is the code and how much of it is entered,
so the turns that acted from one entry state share an anchor however they got there.

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
INSTRUCTION_LONG = "Open the lock: reply with the next digit of the code, one digit per turn."
_DIGIT = re.compile(r"[0-9]")


class KeypadEnv(TextEnv):
  """One code digit per task; see the module docstring.

  Args:
    reward_mode: "normalized" or "paper" (the same here: 1 / turn on success, else 0).
    max_steps: turns before the episode is truncated.
    codes: the digits codes are drawn from (fewer digits make the task easier).
    length: digits per code, entered one per turn.
    code: one code for every task (digits), instead of drawing one per task.
  """

  name = "keypad"
  instruction = INSTRUCTION
  acknowledgement = "OK."

  def __init__(self, reward_mode: str = "normalized", max_steps: int = 3,
               codes: str = "0123456789", length: int = 1, code: str = ""):
    super().__init__(reward_mode)
    if max_steps < 1:
      raise ValueError(f"max_steps must be >= 1, got {max_steps}.")
    if not codes or not all(c.isdigit() for c in codes) or len(set(codes)) != len(codes):
      raise ValueError(f"codes must be distinct digits, e.g. '0123456789'; got {codes!r}.")
    if length < 1:
      raise ValueError(f"length (digits per code) must be >= 1, got {length}.")
    if code and not code.isdigit():
      raise ValueError(f"code must be digits only, e.g. '372'; got {code!r}.")
    if code and length not in (1, len(code)):
      raise ValueError(f"length={length} contradicts code={code!r}: give one of the two.")
    self.max_steps = max_steps
    self.codes = codes
    self.length = len(code) or length
    if self.length > 1:
      self.instruction = INSTRUCTION_LONG
    self.fixed_code = code
    self.code = ""
    self.entered = 0  # digits of the code entered so far
    self.misses = 0  # replies that were not the right next digit
    self.score = 0.0  # reward so far
    self.steps = 0

  def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
    if task_id < 0:
      raise ValueError(f"keypad: task ids are >= 0, got {task_id}.")
    rng = random.Random(task_id)
    self.code = self.fixed_code or "".join(rng.choice(self.codes) for _ in range(self.length))
    self.entered = self.misses = self.steps = 0
    self.score = 0.0
    # The code is the task's category: evaluation reports success per code.
    return f"Code: {self.code}.", {"code": self.code, "category": f"code {self.code}",
                                   "state_key": self._state_key()}

  def _step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
    self.steps += 1
    if action and action == self.code[self.entered]:
      self.entered += 1
      self.score += 1.0 / (self.length * (1 + self.misses))
      head = "Right."
    else:
      self.misses += 1
      head = "Wrong." if action else "No digit."
    info = {"success": self.entered == self.length, "score": self.score,
            "state_key": self._state_key()}
    # The reward is the episode's so far (the environment contract).
    if info["success"]:
      return "Unlocked.", self.score, True, False, info
    entered = f" Entered: {self.code[:self.entered]}." if self.entered else ""
    truncated = self.steps >= self.max_steps
    return f"{head} Code: {self.code}.{entered}", self.score, False, truncated, info

  def _state_key(self) -> str:
    return f"{self.code}:{self.entered}"

  @staticmethod
  def parse_action(response: str) -> str:
    """The first digit in the response, or "" when it has none."""
    match = _DIGIT.search(response)
    return match.group(0) if match else ""

  @staticmethod
  def format_action(action: str, thought: bool = True) -> str:
    return action

  def expert_action(self) -> str:
    return self.code[self.entered]

  def random_action(self, rng: random.Random) -> str:
    return rng.choice(self.codes)
