"""Text environments for multi-turn agent RL, and the plumbing that runs them.

`make(name, **kwargs)` builds an environment by name. Concrete environments are imported
lazily, so listing or making one never imports another's simulator. This package never
imports JAX.
"""

from __future__ import annotations

import importlib
import json
from importlib import resources

from environments.base import TextEnv

# name -> "module:ClassName"; each module lives in its own package with its data.
REGISTRY = {
    "babyai": "environments.babyai.env:BabyAIEnv",
    "textcraft": "environments.textcraft.env:TextCraftEnv",
    "sciworld": "environments.sciworld.env:SciWorldEnv",
    "searchqa": "environments.searchqa.env:SearchQAEnv",
    "scripted": "environments.scripted.env:ScriptedEnv",
    "keypad": "environments.keypad.env:KeypadEnv",
    # Any of the above (or WebArena) behind an AgentGym env server; kwargs url=, env_name=.
    "remote": "environments.client:RemoteEnv",
}


def env_class(name: str, env_name: str | None = None) -> type[TextEnv]:
  """The class of environment `name`.

  For "remote", `env_name` selects the served environment, whose parser and instruction the
  returned class carries; without it the class parses generic ReAct responses.
  """
  if name not in REGISTRY:
    raise ValueError(f"Unknown environment {name!r}; known: {sorted(REGISTRY)}.")
  module_name, class_name = REGISTRY[name].split(":")
  module = importlib.import_module(module_name)
  if env_name is not None:
    if name != "remote":
      raise ValueError(f"env_name={env_name!r} applies to 'remote' only, not {name!r}.")
    return module.remote_class(env_name)
  return getattr(module, class_name)


def make(name: str, **kwargs) -> TextEnv:
  """Builds environment `name` (a key of `REGISTRY`) with its keyword arguments."""
  return env_class(name)(**kwargs)


def task_splits(name: str, env_name: str | None = None) -> dict[str, list[int]]:
  """The train/test task ids shipped for environment `name`: {"train": [...], "test": [...]}.

  For `name="remote"`, `env_name` names the served environment (a key of `REGISTRY`, or
  "webarena"), whose split is used.
  """
  splits = _split_file(name, env_name)
  return {split: ids for split, ids in splits.items() if split != "categories"}


def task_categories(name: str, env_name: str | None = None) -> dict[int, str]:
  """Task id -> the category that `reset` reports in info["category"], from the split file.

  A remote environment's server does not send it (AgentGym's protocol has no field for it),
  so `environments.client` fills it in from here; evaluation groups its columns by it. Empty
  for environments whose split file lists no categories.
  """
  categories = _split_file(name, env_name).get("categories", {})
  return {int(task_id): category for task_id, category in categories.items()}


def _split_file(name: str, env_name: str | None) -> dict:
  """The parsed data/splits.json of `name` (a remote env's: of the environment it serves)."""
  if name == "remote":
    if not env_name:
      raise ValueError("task_splits('remote') needs env_name= (the served environment, e.g. "
                       "'webarena'); set it in the env kwargs of the config.")
    name = env_name
  package = f"environments.{name}"
  try:
    split_file = resources.files(package).joinpath("data/splits.json")
  except ModuleNotFoundError:
    raise ValueError(f"No task splits ship for environment {name!r}; known: "
                     f"{sorted(set(REGISTRY) - {'remote'} | {'webarena'})}.") from None
  with split_file.open() as f:
    return json.load(f)
