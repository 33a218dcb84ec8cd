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


def task_splits(name: str) -> dict[str, list[int]]:
  """The train/test task ids shipped with environment `name`: {"train": [...], "test": [...]}."""
  package = REGISTRY[name].split(":")[0].rsplit(".", 1)[0]
  with resources.files(package).joinpath("data/splits.json").open() as f:
    return json.load(f)
