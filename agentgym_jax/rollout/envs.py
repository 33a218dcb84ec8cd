"""The one door from the library to the environments: everything built from `EnvSettings`.

The rule of docs/design.md: `agentgym_jax` never imports a concrete environment and
`environments` never imports JAX; they meet here. The trainer, behaviour cloning and
evaluation get from this module the worker pool (local simulators or a remote AgentGym server,
per `EnvSettings`), the task splits, the name of the environment whose paper table applies, the
expert's play (episodes for behaviour cloning, texts for a BPE tokenizer) and the constants
the episode runner shares with the environments (`FAILURES`, the kinds of fault a pool
reports; `DEFAULT_ACKNOWLEDGEMENT`, the agent's canned first reply); nothing else in the
library imports `environments`.
Nothing here imports the rest of `rollout/`: the runner, its records and the expert's
demonstrations all import this module. Nothing here reads the run's config either:
`EnvSettings` is `config.env` (and the training split of `config.data`) typed, built once by
the command lines (agentgym_jax/settings.py:env).

A run over several environments (`env.name = "mix"`, its environments in `env.mix`) is a set
of single-environment settings (`EnvSettings.mix`: each `Member`'s `env` holds one
environment's fields), so every function here answers for a mixture from its members'
answers. A mixed run's task ids carry their environment (`Member.encode`: member i's task t is
i * TASK_STRIDE + t), so the task stream, the episodes, the trajectories and their group ids
keep one integer per task, and a group never mixes environments; `MixedPool` routes each
episode to its environment's pool and hands the runner that environment's opening and turn cap.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import environments
import ml_collections
from environments.base import DEFAULT_ACKNOWLEDGEMENT
from environments.workers import FAILURES, EnvPool

__all__ = ["DEFAULT_ACKNOWLEDGEMENT", "EnvSettings", "FAILURES", "MIX", "TASK_STRIDE", "Member",
           "MixedPool", "check", "environment_of", "evaluation_tasks", "expert_texts",
           "interleave_categories", "make_env", "make_pool", "member", "served_name",
           "task_splits", "training_tasks"]

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
  """One environment of `config.env.mix`, every field stated, for an experiment file to write
  (config.py's base_config says what each means)."""
  return ml_collections.ConfigDict({
      "name": name, "ratio": float(ratio), "kwargs": ml_collections.ConfigDict(kwargs or {}),
      "categories": tuple(categories), "max_turns": int(max_turns),
      "system_prompt": system_prompt})


@dataclasses.dataclass(frozen=True)
class EnvSettings:
  """The environments of a run: `config.env` and the training split of `config.data`, typed
  (train/config.py's base_config says what each field means).

  Attributes:
    name: a registered environment, "remote" (an AgentGym server at kwargs["url"]) or MIX.
    kwargs: the environment's constructor arguments (plain values).
    categories: the task categories every split keeps (empty: all).
    system_prompt: the episodes' system message ("" = none).
    num_workers, timeout_s: the worker pool's processes and a step's time limit.
    urls: env.urls, one env-service URL per host (multihost.process_env picks this process's).
    train_split: `data.split`, the split training draws from.
    train_categories: `data.categories`, the categories training keeps (empty: all).
    mix: a mixture's environments (name MIX), in label order; empty otherwise.
  """

  name: str
  kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  categories: tuple[str, ...] = ()
  system_prompt: str = ""
  num_workers: int = 1
  timeout_s: float = 60.0
  urls: tuple[str, ...] = ()
  train_split: str = "train"
  train_categories: tuple[str, ...] = ()
  mix: tuple[Member, ...] = ()

  @property
  def is_mixture(self) -> bool:
    return self.name == MIX


@dataclasses.dataclass(frozen=True)
class Member:
  """One environment of a mixture: its label (its key in env.mix, the name of its metrics),
  its place in the mixture, its share of each batch's tasks, the turn cap of its episodes
  (0: the schedule's limit alone) and `env`, the run's environment settings with this
  environment alone in them."""

  label: str
  index: int
  ratio: float
  max_turns: int
  env: EnvSettings

  def encode(self, task_id: int) -> int:
    """The mixed run's id of this environment's task `task_id`."""
    return self.index * TASK_STRIDE + int(task_id)


def environment_of(env: EnvSettings, task_id: int) -> str:
  """The label of the environment a task id runs in (`env.name` outside a mixture)."""
  if not env.is_mixture:
    return env.name
  return env.mix[int(task_id) // TASK_STRIDE].label


def _check_mixture(env: EnvSettings) -> None:
  """Raises ValueError, in one line naming the field, for a mixture that cannot run."""
  if not env.mix:
    raise ValueError("config.env.name='mix' needs its environments in config.env.mix "
                     "(rollout.envs.member(name, ratio, ...) per label).")
  for field, value in (("env.kwargs", env.kwargs), ("env.categories", env.categories),
                       ("env.system_prompt", env.system_prompt),
                       ("data.categories", env.train_categories)):
    if value:
      raise ValueError(f"config.{field} is set, but a mixture sets it per environment: use "
                       f"config.env.mix.<label>.{field.split('.')[1]} instead.")
  for m in env.mix:
    where = f"config.env.mix.{m.label}"
    if m.env.name not in environments.local_names():
      raise ValueError(f"Unknown environment {where}.name={m.env.name!r}; set it to one of "
                       f"{environments.local_names()}.")
    if not m.ratio > 0:
      raise ValueError(f"{where}.ratio={m.ratio!r} must be > 0 (its share of each batch).")
    if m.max_turns < 0:
      raise ValueError(f"{where}.max_turns={m.max_turns!r} must be >= 0 (0: no cap).")
  ratios = {m.label: m.ratio for m in env.mix}
  if not math.isclose(sum(ratios.values()), 1.0, abs_tol=1e-6):
    raise ValueError(f"config.env.mix ratios sum to {sum(ratios.values()):g} ({ratios}); "
                     "they must sum to 1.")
  for m in env.mix:
    try:
      check(m.env)
    except ValueError as error:  # say which environment of the mixture
      raise ValueError(f"config.env.mix.{m.label}: {error}") from None
    largest = max((max(ids, default=0) for ids in task_splits(m.env).values()), default=0)
    if largest >= TASK_STRIDE:
      raise ValueError(f"config.env.mix.{m.label}: task id {largest} does not fit below "
                       f"{TASK_STRIDE}, the ids a mixture gives each environment.")


def served_name(env: EnvSettings) -> str:
  """The environment the episodes run in: `env.name`, or for "remote" the one its server
  serves (`env.kwargs["env_name"]`), which picks the task split and the paper's table ("mix"
  for a mixture: no paper table applies)."""
  if env.name == "remote":
    return str(env.kwargs.get("env_name", "remote"))
  return env.name


def check(env: EnvSettings) -> None:
  """Raises ValueError, in one line, when `env` names no environment we can run (or a
  mixture whose environments or ratios cannot run)."""
  if env.is_mixture:
    _check_mixture(env)
    return
  if env.mix:
    raise ValueError(f"config.env.mix lists environments but config.env.name is "
                     f"{env.name!r}; set config.env.name='mix' to mix them.")
  if env.name not in environments.local_names():
    raise ValueError(f"Unknown environment config.env.name={env.name!r}; set "
                     f"--config.env.name to one of {environments.local_names()}.")
  task_splits(env)  # a remote env that names no served environment, or an unknown one


def task_splits(env: EnvSettings) -> dict[str, list[int]]:
  """The task-id splits of `env` (a remote env's: those of the environment it serves), each
  kept to the tasks of `env.categories` when it names any. A mixture's: the splits its
  environments share, their (mixed) ids taken from each environment in turn, so a split's
  first ids hold every environment."""
  if env.is_mixture:
    parts = [(m, task_splits(m.env)) for m in env.mix]
    shared = set.intersection(*(set(splits) for _, splits in parts))
    return {split: _in_turn([[m.encode(t) for t in splits[split]] for m, splits in parts])
            for split in sorted(shared)}
  splits = environments.task_splits(env.name, env.kwargs.get("env_name"))
  return {split: _of_categories(env, ids, env.categories, "env.categories")
          for split, ids in splits.items()}


def _of_categories(env: EnvSettings, task_ids: Sequence[int], wanted: Sequence[str],
                   field: str) -> list[int]:
  """The tasks of `task_ids` whose category (`environments.task_categories`) is in `wanted`;
  all of them when `wanted` is empty. Raises ValueError naming `field` for a category that no
  task has."""
  if not wanted:
    return list(task_ids)
  categories = environments.task_categories(env.name, env.kwargs.get("env_name"),
                                            env_kwargs=dict(env.kwargs))
  unknown = set(wanted) - set(categories.values())
  if unknown:
    raise ValueError(f"config.{field} names {sorted(unknown)}, which {served_name(env)}'s "
                     f"split file does not list; known: {sorted(set(categories.values()))}.")
  wanted = set(wanted)
  return [t for t in task_ids if categories.get(t) in wanted]


def training_tasks(env: EnvSettings) -> list[int]:
  """The task ids training draws from: `env.train_split` of `task_splits`, kept to the tasks
  of `env.train_categories` when it names any (evaluation keeps every category of
  env.categories). A mixture's: each environment's, taken in turn (its batches mix them by
  ratio: the trainer's `data.MixtureStream` over each member's `training_tasks`)."""
  if env.is_mixture:
    return _in_turn([[m.encode(t) for t in training_tasks(m.env)] for m in env.mix])
  wanted = set(env.train_categories)
  if not wanted <= set(env.categories or wanted):
    raise ValueError(f"config.data.categories {sorted(wanted)} must be among "
                     f"config.env.categories {sorted(env.categories)}.")
  return _of_categories(env, task_splits(env)[env.train_split], env.train_categories,
                        "data.categories")


def evaluation_tasks(env: EnvSettings, split: str, num_tasks: int) -> list[int]:
  """The first `num_tasks` tasks (0: all) of `split`; in a mixture, of each environment's.

  Raises:
    ValueError: a split the environment (every one of a mixture's) does not have.
  """
  if env.is_mixture:
    return [m.encode(t) for m in env.mix for t in evaluation_tasks(m.env, split, num_tasks)]
  splits = task_splits(env)
  if split not in splits:
    raise ValueError(f"Split {split!r} not in {env.name}'s splits {sorted(splits)}.")
  task_ids = splits[split]
  return [int(t) for t in (task_ids[:num_tasks] if num_tasks else task_ids)]


def _in_turn(lists: Sequence[Sequence[int]]) -> list[int]:
  """One item of each list in turn: [[a1, a2, a3], [b1]] -> [a1, b1, a2, a3]."""
  return [x for row in itertools.zip_longest(*lists) for x in row if x is not None]


def interleave_categories(env: EnvSettings, task_ids: Sequence[int]) -> list[int]:
  """`task_ids` reordered to take one task of each category in turn, categories in the order
  they first appear and tasks in their given order within each; uncategorised tasks form one
  category of their own. [a1, a2, a3, b1, b2] -> [a1, b1, a2, b2, a3]."""
  categories = environments.task_categories(env.name, env.kwargs.get("env_name"),
                                            env_kwargs=dict(env.kwargs))
  by_category: dict[str | None, list[int]] = {}
  for task_id in task_ids:
    by_category.setdefault(categories.get(task_id), []).append(task_id)
  return _in_turn(list(by_category.values()))


def make_pool(env: EnvSettings) -> EnvPool | MixedPool:
  """The worker pool the episode runner steps: `env.num_workers` processes, each with its own
  environment (or remote client), a step that takes over `env.timeout_s` failing its episode;
  a mixture's is a `MixedPool` over one such pool per environment."""
  if env.is_mixture:
    pools = []
    try:
      for m in env.mix:
        pools.append(make_pool(m.env))
    except BaseException:
      for pool in pools:
        pool.close()
      raise
    return MixedPool(env.mix, pools)
  return EnvPool(env.name, num_workers=env.num_workers, env_kwargs=dict(env.kwargs),
                 timeout_s=env.timeout_s)


def expert_texts(env: EnvSettings, task_ids: Sequence[int]) -> Iterator[str]:
  """The messages of expert-played episodes of `task_ids`, with their ChatML role headers.

  The expert plays a few steps of each task, so the corpus holds what the agent reads and
  writes in rollouts: instruction, acknowledgement, observations and actions. Each message
  comes with its role line ("user\\n...", "assistant\\n..."), because a "bpe:" tokenizer
  renders conversations with ChatML, whose role names are ordinary text worth a merge; the
  special tokens themselves are left out (the trainer would split them into byte pieces).
  """
  if env.is_mixture:
    for m in env.mix:
      mine = [t % TASK_STRIDE for t in task_ids if t // TASK_STRIDE == m.index]
      yield from expert_texts(m.env, mine)
    return
  played = make_env(env)
  try:
    yield f"user\n{played.instruction}"
    yield f"assistant\n{played.acknowledgement}"
    for task_id in task_ids:
      observation, info = played.reset(options={"task_id": task_id})
      yield f"user\n{info.get('instruction', played.instruction)}"
      yield f"user\n{observation}"
      for _ in range(_BPE_EXPERT_STEPS):
        action = played.format_action(played.expert_action())
        yield f"assistant\n{action}"
        observation, _, terminated, truncated, _ = played.step(played.parse_action(action))
        yield f"user\n{observation}"
        if terminated or truncated:
          break
  finally:
    played.close()


def make_env(env: EnvSettings) -> environments.TextEnv:
  """One environment of `env` in this process, for the expert's play: experts read the
  environment's internals, which a worker pool or a remote server does not expose. A
  mixture's experts play in its members' settings (`EnvSettings.mix`)."""
  if env.is_mixture:
    raise ValueError("make_env builds one environment; for config.env.name='mix' call it with "
                     "a member's settings (EnvSettings.mix[i].env).")
  return environments.make(env.name, **env.kwargs)


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
        out.info.setdefault("acknowledgement", getattr(pool.env_cls, "acknowledgement",
                                                       DEFAULT_ACKNOWLEDGEMENT))
        out.info.update(task_id=task_id, system_prompt=m.env.system_prompt or None,
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
