"""The one door from the library to the environments: everything built from `config.env`.

The rule of docs/design.md: `agentgym_jax` never imports a concrete environment and
`environments` never imports JAX; they meet here. The trainer, behaviour cloning and
evaluation get from this module the worker pool (local simulators or a remote AgentGym server,
per `config.env`), the task splits, the name of the environment whose paper table applies, the
expert's play (episodes for behaviour cloning, texts for a BPE tokenizer) and the constants
the episode runner shares with the environments (`FAILURES`, the kinds of fault a pool
reports; `DEFAULT_ACKNOWLEDGEMENT`, the agent's canned first reply); nothing else in the
library imports `environments`.
Nothing here imports the rest of `rollout/`: the runner, its records and the expert's
demonstrations all import this module.

A run over several environments (`env.name = "mix"`, its environments in `env.mix`) is a set
of single-environment configs (`members`: each the run's config with one environment's fields
in `config.env`), so every function here answers for a mixture from its members' answers. A
mixed run's task ids carry their environment (`Member.encode`: member i's task t is
i * TASK_STRIDE + t), so the task stream, the episodes, the trajectories and their group ids
keep one integer per task, and a group never mixes environments; `MixedPool` routes each
episode to its environment's pool and hands the runner that environment's opening and turn cap.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import environments
import ml_collections
from environments.base import DEFAULT_ACKNOWLEDGEMENT
from environments.workers import FAILURES, EnvPool

__all__ = ["DEFAULT_ACKNOWLEDGEMENT", "FAILURES", "MIX", "TASK_STRIDE", "Member", "MixedPool",
           "check", "environment_of", "evaluation_tasks", "expert_texts",
           "interleave_categories", "is_mixture", "make_env", "make_pool", "member", "members",
           "served_name", "task_splits", "training_tasks"]

# Environment steps played by the expert per task when collecting BPE training text.
_BPE_EXPERT_STEPS = 4


# env.name of a run over several environments (env.mix).
MIX = "mix"
# A mixed run's task id names its environment: member i's task t is i * TASK_STRIDE + t (every
# shipped split's ids are far below it).
TASK_STRIDE = 1_000_000
# The fields of an env.mix member, each standing for the env field of one environment's run.
MEMBER_FIELDS = ("name", "ratio", "kwargs", "categories", "max_turns", "system_prompt")


def member(name: str, ratio: float, *, kwargs: dict[str, Any] | None = None,
           categories: Sequence[str] = (), max_turns: int = 0,
           system_prompt: str = "") -> ml_collections.ConfigDict:
  """One environment of `config.env.mix`, every field stated (config.py's base_config says
  what each means)."""
  return ml_collections.ConfigDict({
      "name": name, "ratio": float(ratio), "kwargs": ml_collections.ConfigDict(kwargs or {}),
      "categories": tuple(categories), "max_turns": int(max_turns),
      "system_prompt": system_prompt})


@dataclasses.dataclass(frozen=True)
class Member:
  """One environment of a mixture: its label (its key in env.mix, the name of its metrics),
  its place in the mixture, its share of each batch's tasks, the turn cap of its episodes
  (0: the schedule's limit alone) and `config`, the run's config with this environment alone
  in `config.env` (its horizons capped at max_turns)."""

  label: str
  index: int
  ratio: float
  max_turns: int
  config: ml_collections.ConfigDict

  def encode(self, task_id: int) -> int:
    """The mixed run's id of this environment's task `task_id`."""
    return self.index * TASK_STRIDE + int(task_id)


def is_mixture(config: ml_collections.ConfigDict) -> bool:
  return config.env.name == MIX


def members(config: ml_collections.ConfigDict) -> list[Member]:
  """The environments of a mixture (`check` has validated them), in label order."""
  out = []
  for index, (label, entry) in enumerate(config.env.mix.items()):
    single = copy.deepcopy(config)
    env = single.env
    env.name, env.kwargs = entry.name, copy.deepcopy(entry.kwargs)
    env.categories, env.system_prompt = tuple(entry.categories), entry.system_prompt
    env.mix = ml_collections.ConfigDict()
    if entry.max_turns:
      single.schedule.horizons = tuple(min(h, entry.max_turns) for h in config.schedule.horizons)
    out.append(Member(label=label, index=index, ratio=float(entry.ratio),
                      max_turns=int(entry.max_turns), config=single))
  return out


def environment_of(config: ml_collections.ConfigDict, task_id: int) -> str:
  """The label of the environment a task id runs in (`env.name` outside a mixture)."""
  if not is_mixture(config):
    return config.env.name
  return list(config.env.mix)[int(task_id) // TASK_STRIDE]


def _check_mixture(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError, in one line naming the field, for a mixture that cannot run."""
  if not config.env.mix:
    raise ValueError("config.env.name='mix' needs its environments in config.env.mix "
                     "(rollout.envs.member(name, ratio, ...) per label).")
  for field, value in (("env.kwargs", config.env.kwargs), ("env.categories",
                       config.env.categories), ("env.system_prompt", config.env.system_prompt),
                       ("data.categories", config.data.categories)):
    if value:
      raise ValueError(f"config.{field} is set, but a mixture sets it per environment: use "
                       f"config.env.mix.<label>.{field.split('.')[1]} instead.")
  ratios = {}
  for label, entry in config.env.mix.items():
    where = f"config.env.mix.{label}"
    if not isinstance(entry, ml_collections.ConfigDict):
      raise ValueError(f"{where} must be a ConfigDict of {MEMBER_FIELDS} "
                       f"(rollout.envs.member builds one), got {entry!r}.")
    missing = [f for f in MEMBER_FIELDS if f not in entry]
    unknown = sorted(set(entry) - set(MEMBER_FIELDS))
    if missing or unknown:
      raise ValueError(f"{where} lacks {missing} and has unknown {unknown}; its fields are "
                       f"{MEMBER_FIELDS}.")
    if entry.name not in environments.local_names():
      raise ValueError(f"Unknown environment {where}.name={entry.name!r}; set it to one of "
                       f"{environments.local_names()}.")
    if not entry.ratio > 0:
      raise ValueError(f"{where}.ratio={entry.ratio!r} must be > 0 (its share of each batch).")
    if entry.max_turns < 0:
      raise ValueError(f"{where}.max_turns={entry.max_turns!r} must be >= 0 (0: no cap).")
    ratios[label] = float(entry.ratio)
  if not math.isclose(sum(ratios.values()), 1.0, abs_tol=1e-6):
    raise ValueError(f"config.env.mix ratios sum to {sum(ratios.values()):g} ({ratios}); "
                     "they must sum to 1.")
  for m in members(config):
    try:
      check(m.config)
    except ValueError as error:  # say which environment of the mixture
      raise ValueError(f"config.env.mix.{m.label}: {error}") from None
    largest = max((max(ids, default=0) for ids in task_splits(m.config).values()), default=0)
    if largest >= TASK_STRIDE:
      raise ValueError(f"config.env.mix.{m.label}: task id {largest} does not fit below "
                       f"{TASK_STRIDE}, the ids a mixture gives each environment.")


def served_name(config: ml_collections.ConfigDict) -> str:
  """The environment the episodes run in: `config.env.name`, or for "remote" the one its
  server serves (`env.kwargs.env_name`), which picks the task split and the paper's table
  ("mix" for a mixture: no paper table applies)."""
  if config.env.name == "remote":
    return str(config.env.kwargs.get("env_name", "remote"))
  return config.env.name


def check(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError, in one line, when `config.env` names no environment we can run (or a
  mixture whose environments or ratios cannot run)."""
  if is_mixture(config):
    _check_mixture(config)
    return
  if config.env.mix:
    raise ValueError(f"config.env.mix lists environments but config.env.name is "
                     f"{config.env.name!r}; set config.env.name='mix' to mix them.")
  if config.env.name not in environments.local_names():
    raise ValueError(f"Unknown environment config.env.name={config.env.name!r}; set "
                     f"--config.env.name to one of {environments.local_names()}.")
  task_splits(config)  # a remote env that names no served environment, or an unknown one


def task_splits(config: ml_collections.ConfigDict) -> dict[str, list[int]]:
  """The task-id splits of `config.env` (a remote env's: those of the environment it serves),
  each kept to the tasks of `config.env.categories` when it names any. A mixture's: the
  splits its environments share, their (mixed) ids taken from each environment in turn, so a
  split's first ids hold every environment."""
  if is_mixture(config):
    parts = [(m, task_splits(m.config)) for m in members(config)]
    shared = set.intersection(*(set(splits) for _, splits in parts))
    return {split: _in_turn([[m.encode(t) for t in splits[split]] for m, splits in parts])
            for split in sorted(shared)}
  splits = environments.task_splits(config.env.name, config.env.kwargs.get("env_name"))
  return {split: _of_categories(config, ids, config.env.categories, "env.categories")
          for split, ids in splits.items()}


def _of_categories(config: ml_collections.ConfigDict, task_ids: Sequence[int],
                   wanted: Sequence[str], field: str) -> list[int]:
  """The tasks of `task_ids` whose category (the split file's) is in `wanted`; all of them
  when `wanted` is empty. Raises ValueError naming `field` for a category the file lacks."""
  if not wanted:
    return list(task_ids)
  categories = environments.task_categories(config.env.name, config.env.kwargs.get("env_name"))
  unknown = set(wanted) - set(categories.values())
  if unknown:
    raise ValueError(f"config.{field} names {sorted(unknown)}, which {served_name(config)}'s "
                     f"split file does not list; known: {sorted(set(categories.values()))}.")
  wanted = set(wanted)
  return [t for t in task_ids if categories.get(t) in wanted]


def training_tasks(config: ml_collections.ConfigDict) -> list[int]:
  """The task ids training draws from: `data.split` of `task_splits`, kept to the tasks of
  `data.categories` when it names any (evaluation keeps every category of env.categories).
  A mixture's: each environment's, taken in turn (its batches mix them by ratio: the
  trainer's `data.MixtureStream` over each member's `training_tasks`)."""
  if is_mixture(config):
    return _in_turn([[m.encode(t) for t in training_tasks(m.config)] for m in members(config)])
  wanted = set(config.data.categories)
  if not wanted <= set(config.env.categories or wanted):
    raise ValueError(f"config.data.categories {sorted(wanted)} must be among "
                     f"config.env.categories {sorted(config.env.categories)}.")
  return _of_categories(config, task_splits(config)[config.data.split], config.data.categories,
                        "data.categories")


def evaluation_tasks(config: ml_collections.ConfigDict, split: str, num_tasks: int
                     ) -> list[int]:
  """The first `num_tasks` tasks (0: all) of `split`; in a mixture, of each environment's.

  Raises:
    ValueError: a split the environment (every one of a mixture's) does not have.
  """
  if is_mixture(config):
    return [m.encode(t) for m in members(config)
            for t in evaluation_tasks(m.config, split, num_tasks)]
  splits = task_splits(config)
  if split not in splits:
    raise ValueError(f"Split {split!r} not in {config.env.name}'s splits {sorted(splits)}.")
  task_ids = splits[split]
  return [int(t) for t in (task_ids[:num_tasks] if num_tasks else task_ids)]


def _in_turn(lists: Sequence[Sequence[int]]) -> list[int]:
  """One item of each list in turn: [[a1, a2, a3], [b1]] -> [a1, b1, a2, a3]."""
  return [x for row in itertools.zip_longest(*lists) for x in row if x is not None]


def interleave_categories(config: ml_collections.ConfigDict,
                          task_ids: Sequence[int]) -> list[int]:
  """`task_ids` reordered to take one task of each category in turn, categories in the order
  they first appear and tasks in their given order within each; uncategorised tasks form one
  category of their own. [a1, a2, a3, b1, b2] -> [a1, b1, a2, b2, a3]."""
  categories = environments.task_categories(config.env.name, config.env.kwargs.get("env_name"))
  by_category: dict[str | None, list[int]] = {}
  for task_id in task_ids:
    by_category.setdefault(categories.get(task_id), []).append(task_id)
  return _in_turn(list(by_category.values()))


def make_pool(config: ml_collections.ConfigDict) -> EnvPool | MixedPool:
  """The worker pool the episode runner steps: `env.num_workers` processes, each with its own
  environment (or remote client), a step that takes over `env.timeout_s` failing its episode;
  a mixture's is a `MixedPool` over one such pool per environment."""
  if is_mixture(config):
    parts = members(config)
    pools = []
    try:
      for m in parts:
        pools.append(make_pool(m.config))
    except BaseException:
      for pool in pools:
        pool.close()
      raise
    return MixedPool(parts, pools)
  return EnvPool(config.env.name, num_workers=config.env.num_workers,
                 env_kwargs=dict(config.env.kwargs), timeout_s=config.env.timeout_s)


def expert_texts(config: ml_collections.ConfigDict, task_ids: Sequence[int]) -> Iterator[str]:
  """The messages of expert-played episodes of `task_ids`, with their ChatML role headers.

  The expert plays a few steps of each task, so the corpus holds what the agent reads and
  writes in rollouts: instruction, acknowledgement, observations and actions. Each message
  comes with its role line ("user\\n...", "assistant\\n..."), because a "bpe:" tokenizer
  renders conversations with ChatML, whose role names are ordinary text worth a merge; the
  special tokens themselves are left out (the trainer would split them into byte pieces).
  """
  if is_mixture(config):
    for m in members(config):
      mine = [t % TASK_STRIDE for t in task_ids if t // TASK_STRIDE == m.index]
      yield from expert_texts(m.config, mine)
    return
  env = make_env(config)
  try:
    yield f"user\n{env.instruction}"
    yield f"assistant\n{env.acknowledgement}"
    for task_id in task_ids:
      observation, info = env.reset(options={"task_id": task_id})
      yield f"user\n{info.get('instruction', env.instruction)}"
      yield f"user\n{observation}"
      for _ in range(_BPE_EXPERT_STEPS):
        action = env.format_action(env.expert_action())
        yield f"assistant\n{action}"
        observation, _, terminated, truncated, _ = env.step(env.parse_action(action))
        yield f"user\n{observation}"
        if terminated or truncated:
          break
  finally:
    env.close()


def make_env(config: ml_collections.ConfigDict) -> environments.TextEnv:
  """One environment of `config.env` in this process, for the expert's play: experts read the
  environment's internals, which a worker pool or a remote server does not expose. A
  mixture's experts play in its members' configs (`members`)."""
  if is_mixture(config):
    raise ValueError("make_env builds one environment; for config.env.name='mix' call it with "
                     "a member's config (rollout.envs.members).")
  return environments.make(config.env.name, **config.env.kwargs)


class MixedPool:
  """The pools of a mixture's environments behind one pool's interface (`EnvPool`'s reset,
  step, submit, collect, close).

  A task id's environment is `task_id // TASK_STRIDE` (`Member.encode`); each slot stays in
  its environment's pool until reset again. Each reset outcome's info carries, for the
  episode runner, that environment's opening and turn cap: `acknowledgement` (the
  environment's own unless it sent one), `system_prompt` (None: no system message) and
  `turn_limit` (0: the schedule's alone); `task_id` is the mixed id.
  """

  def __init__(self, parts: Sequence[Member], pools: Sequence[Any]):
    self.members, self.pools = list(parts), list(pools)
    self._member_of: dict[int, int] = {}  # slot -> index of its environment

  def reset(self, task_ids: Sequence[int], slots: Sequence[int] | None = None) -> list[Any]:
    slots = list(range(len(task_ids))) if slots is None else list(slots)
    if len(slots) != len(task_ids):
      raise ValueError(f"reset got {len(task_ids)} task ids for {len(slots)} slots.")
    unknown = [t for t in task_ids if not 0 <= int(t) // TASK_STRIDE < len(self.pools)]
    if unknown:
      raise ValueError(f"Task ids {unknown[:4]} name no environment of this mixture (id // "
                       f"{TASK_STRIDE} must be below {len(self.pools)}).")
    outcomes: dict[int, Any] = {}
    for index, (m, pool) in enumerate(zip(self.members, self.pools)):
      mine = [(slot, int(t)) for slot, t in zip(slots, task_ids) if int(t) // TASK_STRIDE == index]
      if not mine:
        continue
      answers = pool.reset([t % TASK_STRIDE for _, t in mine], [slot for slot, _ in mine])
      for (slot, task_id), out in zip(mine, answers):
        self._member_of[slot] = index
        entry = m.config.env
        out.info.setdefault("acknowledgement", getattr(pool.env_cls, "acknowledgement",
                                                       DEFAULT_ACKNOWLEDGEMENT))
        out.info.update(task_id=task_id, system_prompt=entry.system_prompt or None,
                        turn_limit=m.max_turns)
        outcomes[slot] = out
    return [outcomes[slot] for slot in slots]

  def step(self, slots: Sequence[int], responses: Sequence[str]) -> list[Any]:
    """Steps every slot, each environment's pool at the same time; outcome per slot."""
    self.submit(slots, responses)
    answers: dict[int, Any] = {}
    while len(answers) < len(slots):
      answers.update(self.collect(None))
    return [answers[int(slot)] for slot in slots]

  def submit(self, slots: Sequence[int], responses: Sequence[str]) -> None:
    if len(slots) != len(responses):
      raise ValueError(f"step got {len(responses)} responses for {len(slots)} slots.")
    for index, pool in enumerate(self.pools):
      mine = [(s, r) for s, r in zip(slots, responses) if self._member_of.get(int(s)) == index]
      if mine:
        pool.submit([s for s, _ in mine], [r for _, r in mine])

  def collect(self, timeout_s: float | None = None) -> list[tuple[int, Any]]:
    """(slot, outcome) of submitted steps answered so far; waits up to `timeout_s` (None:
    until one arrives or nothing is in flight) as `EnvPool.collect` does."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
      busy = [pool for pool in self.pools if pool.in_flight]
      answered = []
      for i, pool in enumerate(busy):
        # Wait a little on the first busy pool, then poll the others.
        wait = 0.0 if i or timeout_s == 0.0 else 0.005
        answered += pool.collect(wait)
      if answered or not busy or (deadline is not None and time.monotonic() >= deadline):
        return answered

  @property
  def in_flight(self) -> int:
    return sum(pool.in_flight for pool in self.pools)

  def close(self) -> None:
    for pool in self.pools:
      pool.close()

  def __enter__(self) -> MixedPool:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
