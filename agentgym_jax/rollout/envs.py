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
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import environments
import ml_collections
from environments.base import DEFAULT_ACKNOWLEDGEMENT
from environments.workers import FAILURES, EnvPool

__all__ = ["DEFAULT_ACKNOWLEDGEMENT", "FAILURES", "check", "expert_texts",
           "interleave_categories", "make_env", "make_pool", "served_name", "task_splits",
           "training_tasks"]

# Environment steps played by the expert per task when collecting BPE training text.
_BPE_EXPERT_STEPS = 4


def served_name(config: ml_collections.ConfigDict) -> str:
  """The environment the episodes run in: `config.env.name`, or for "remote" the one its
  server serves (`env.kwargs.env_name`), which picks the task split and the paper's table."""
  if config.env.name == "remote":
    return str(config.env.kwargs.get("env_name", "remote"))
  return config.env.name


def check(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError, in one line, when `config.env` names no environment we can run."""
  if config.env.name not in environments.local_names():
    raise ValueError(f"Unknown environment config.env.name={config.env.name!r}; set "
                     f"--config.env.name to one of {environments.local_names()}.")
  task_splits(config)  # a remote env that names no served environment, or an unknown one


def task_splits(config: ml_collections.ConfigDict) -> dict[str, list[int]]:
  """The task-id splits of `config.env` (a remote env's: those of the environment it serves),
  each kept to the tasks of `config.env.categories` when it names any."""
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
  `data.categories` when it names any (evaluation keeps every category of env.categories)."""
  wanted = set(config.data.categories)
  if not wanted <= set(config.env.categories or wanted):
    raise ValueError(f"config.data.categories {sorted(wanted)} must be among "
                     f"config.env.categories {sorted(config.env.categories)}.")
  return _of_categories(config, task_splits(config)[config.data.split], config.data.categories,
                        "data.categories")


def interleave_categories(config: ml_collections.ConfigDict,
                          task_ids: Sequence[int]) -> list[int]:
  """`task_ids` reordered to take one task of each category in turn, categories in the order
  they first appear and tasks in their given order within each; uncategorised tasks form one
  category of their own. [a1, a2, a3, b1, b2] -> [a1, b1, a2, b2, a3]."""
  categories = environments.task_categories(config.env.name, config.env.kwargs.get("env_name"))
  by_category: dict[str | None, list[int]] = {}
  for task_id in task_ids:
    by_category.setdefault(categories.get(task_id), []).append(task_id)
  rounds = itertools.zip_longest(*by_category.values())
  return [task_id for row in rounds for task_id in row if task_id is not None]


def make_pool(config: ml_collections.ConfigDict) -> EnvPool:
  """The worker pool the episode runner steps: `env.num_workers` processes, each with its own
  environment (or remote client), a step that takes over `env.timeout_s` failing its episode."""
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
  environment's internals, which a worker pool or a remote server does not expose."""
  return environments.make(config.env.name, **config.env.kwargs)
