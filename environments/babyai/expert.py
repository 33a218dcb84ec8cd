"""The BabyAI expert: minigrid's BabyAIBot, followed through our macro actions.

The bot (`minigrid.utils.baby_ai_bot.BabyAIBot`) plans in primitives with privileged access
to the grid. It keeps its own copy of the level (a "bundle": bot + private env), which stays
in step with the real level. Each turn the expert

  1. rolls the bot out on a copy of its bundle for up to `LOOKAHEAD` primitives, recording
     the state after each (agent pose, grid contents, carried object, instruction progress);
  2. runs each available macro aimed at a cell the bot will stand on or act on, on a copy of
     the real level (with the macro's early-stop rule), and scores it by how far along the
     bot's rollout it lands: a macro that completes the mission wins; otherwise the furthest
     rollout state it reproduces, where
     the agent's direction (or, right after a pickup/drop/toggle, its position) may differ
     only if the bot's next primitive there is a move, because the bot's navigation replans
     from wherever the agent stands;
  3. advances its bundle to that rollout state, with the agent placed where the macro left it.

If the real level is not in the expected state at the next call (another action was taken),
the bot is rebuilt from the current state. The bot cannot open boxes and assumes it starts
empty-handed, so KeyInBox and PutNextS7N4Carrying are beyond it; upstream's action set has no
"toggle" for boxes or open doors either.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
from minigrid.envs.babyai.core.verifier import SeqInstr
from minigrid.utils.baby_ai_bot import BabyAIBot

from environments.babyai import text

LOOKAHEAD = 32  # primitives; longer than any macro path within the 8x7 path window
_MOVES = (text.LEFT, text.RIGHT, text.FORWARD)
_DONE = 6  # minigrid's "done" action: the bot thinks the mission is complete


@dataclasses.dataclass(frozen=True)
class _State:
  pos: tuple[int, int]
  direction: int
  contents: tuple  # objects in the grid, carried object, instruction progress


def _progress(instr) -> tuple:
  """Which parts of a (possibly sequenced) instruction are done."""
  if isinstance(instr, SeqInstr):
    return (instr.a_done == "success", instr.b_done == "success",
            _progress(instr.instr_a), _progress(instr.instr_b))
  return ()


def _contents(env) -> tuple:
  """Everything but the agent's pose that a macro or the bot can change."""
  cells = tuple((i, o.type, o.color, getattr(o, "is_open", None), getattr(o, "is_locked", None))
                for i, o in enumerate(env.grid.grid) if o is not None and o.type != "wall")
  carrying = env.carrying
  return (cells, None if carrying is None else (carrying.type, carrying.color),
          _progress(env.instrs))


def _state(env) -> _State:
  return _State(tuple(int(c) for c in env.agent_pos), int(env.agent_dir), _contents(env))


def _clone(obj, env):
  """A deep copy of `obj` (a level or a bot holding one) that shares `env`'s walls and spaces,
  which nothing changes; copying them is most of a deep copy's cost."""
  memo = {id(o): o for o in env.grid.grid if o is not None and o.type == "wall"}
  for shared in (env.observation_space, env.action_space):
    memo[id(shared)] = shared
  return copy.deepcopy(obj, memo)


def _front(pos: tuple[int, int], direction: int) -> tuple[int, int]:
  dx, dy = text.DIRS[direction]
  return pos[0] + dx, pos[1] + dy


def _dead_reckon(pos: tuple[int, int], direction: int, macro: list[int]):
  """Where a macro would leave the agent if no primitive failed."""
  for primitive in macro:
    if primitive == text.LEFT:
      direction = (direction - 1) % 4
    elif primitive == text.RIGHT:
      direction = (direction + 1) % 4
    elif primitive == text.FORWARD:
      pos = _front(pos, direction)
  return pos, direction


def _run(env, primitives: list[int], image: np.ndarray) -> tuple[int, bool, float]:
  """Runs a macro as the environment does; (last primitive run, terminated, reward)."""
  primitive, terminated, reward = primitives[0], False, 0.0
  for primitive in primitives:
    obs, reward, terminated, _, _ = env.step(primitive)
    if np.array_equal(obs["image"], image):
      break
    image = obs["image"]
  return primitive, bool(terminated), float(reward)


class Expert:
  """Chooses macro actions for one episode of one BabyAI level."""

  def __init__(self, env):
    self._bot = self._new_bot(env)
    self._next_bot: BabyAIBot | None = None

  @staticmethod
  def _new_bot(env) -> BabyAIBot:
    return BabyAIBot(_clone(env, env))

  def next_action(self, env, actions: dict[str, list[int]], image: np.ndarray) -> str:
    """The action to take in `env` (the real level), among `actions` (name -> primitives)."""
    now = _state(env)
    if self._next_bot is not None and _state(self._next_bot.mission) == now:
      self._bot = self._next_bot
    elif _state(self._bot.mission) != now:
      self._bot = self._new_bot(env)
    self._next_bot = None

    primitives, states = self._rollout(_clone(self._bot, env))
    if not primitives:
      return text.CHECK
    # Only macros aimed at a cell the bot will stand on, or at a cell it will act on (pick
    # up, drop, toggle, or face where the rollout ends), can match; the rest are skipped
    # without running them (each run costs a copy of the level).
    poses = [(now.pos, now.direction)] + [(st.pos, st.direction) for st in states]
    positions = {pos for pos, _ in poses[1:]}
    targets = {_front(*poses[k]) for k, p in enumerate(primitives) if p not in _MOVES}
    targets.add(_front(*poses[-1]))
    best = None  # (rank, name, progress, end state)
    for order, (name, macro) in enumerate(actions.items()):
      if not macro:
        continue
      pos, direction = _dead_reckon(now.pos, now.direction, macro)
      if pos not in positions and _front(pos, direction) not in targets:
        continue
      trial = _clone(env, env)
      last, terminated, reward = _run(trial, macro, image)
      end = _state(trial)
      if terminated and reward > 0:
        rank, progress = (1, 0, -len(macro), -order), None
      else:
        progress = self._match(end, last, primitives, states)
        if progress == 0:
          continue
        rank = (0, progress, -len(macro), -order)
      if best is None or rank > best[0]:
        best = (rank, name, progress, end)
    if best is None:
      return text.CHECK
    _, name, progress, end = best
    if progress is not None:
      self._next_bot = self._advance(progress, end, env)
    return name

  def _rollout(self, bot: BabyAIBot) -> tuple[list[int], list[_State]]:
    """The bot's next primitives on its own copy of the level, and the state after each."""
    primitives, states = [], []
    for _ in range(LOOKAHEAD):
      try:
        primitive = bot.replan()
      # The bot signals plans it cannot carry out (an opened box, an unreachable target)
      # with assertions and its own exception types; the rollout then ends where it is.
      except Exception:  # pylint: disable=broad-except
        break
      if primitive == _DONE:
        break
      _, _, terminated, _, _ = bot.mission.step(primitive)
      primitives.append(int(primitive))
      states.append(_state(bot.mission))
      if terminated:
        break
    return primitives, states

  @staticmethod
  def _match(end: _State, last: int, primitives: list[int], states: list[_State]) -> int:
    """How many rollout primitives the macro that ended in `end` stands for (0: none)."""

    def free_pose(k: int) -> bool:  # the bot only navigates after rollout state k
      return k + 1 >= len(primitives) or primitives[k + 1] in _MOVES

    for k in reversed(range(len(states))):
      if (states[k].contents == end.contents and states[k].pos == end.pos and
          (states[k].direction == end.direction or free_pose(k))):
        return k + 1
    if last not in _MOVES:
      for k, state in enumerate(states):
        if state.contents == end.contents and primitives[k] == last and free_pose(k):
          return k + 1
    return 0

  def _advance(self, progress: int, end: _State, env) -> BabyAIBot:
    """The bot after `progress` rollout primitives, with the agent at `end`'s pose."""
    bot = _clone(self._bot, env)
    for _ in range(progress):
      bot.mission.step(bot.replan())
    bot.mission.agent_pos = end.pos
    bot.mission.agent_dir = end.direction
    return bot
