"""Text environments for multi-turn agent RL, and the plumbing that runs them.

Every environment is registered here, once: `register(name, "module:Class", protocol=...)`
names the class that runs it and, where AgentGym has a server for it, the field names and
habits of that server (`environments.protocol`), which our server and client read instead of
keeping their own lists of environments. A new environment is its package plus one
registration. Classes are imported lazily, so listing or making one environment never
imports another's simulator. This package never imports JAX.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from importlib import resources

from environments import protocol as protocol_lib
from environments.base import TextEnv


@dataclasses.dataclass(frozen=True)
class Registration:
  """What the package knows of one environment.

  Attributes:
    name: the name configs and servers use ("babyai").
    cls: "module:Class" of its `TextEnv`; for one that runs only behind an AgentGym server,
      of the class holding its prompt and action format (instruction, acknowledgement,
      parse_action, format_action), which the remote client takes.
    protocol: how AgentGym's server for it names its fields; None where AgentGym has none.
    local: False for an environment that runs only behind an AgentGym server (WebArena).
  """

  name: str
  cls: str
  protocol: protocol_lib.Protocol | None = None
  local: bool = True

  def load(self) -> type:
    """The class `cls` names, imported now."""
    module_name, class_name = self.cls.split(":")
    return getattr(importlib.import_module(module_name), class_name)


REGISTRY: dict[str, Registration] = {}


def register(name: str, cls: str, protocol: protocol_lib.Protocol | None = None,
             local: bool = True) -> None:
  """Registers environment `name` (see `Registration`); its protocol takes the same name.

  Raises:
    ValueError: `name` is registered already.
  """
  if name in REGISTRY:
    raise ValueError(f"Environment {name!r} is already registered to {REGISTRY[name].cls}; "
                     "pick another name.")
  if protocol is not None:
    protocol = dataclasses.replace(protocol, name=name)
  REGISTRY[name] = Registration(name, cls, protocol, local)


register("babyai", "environments.babyai.env:BabyAIEnv",
         protocol=protocol_lib.BabyAI(score_field="score"))
register("textcraft", "environments.textcraft.env:TextCraftEnv",
         protocol=protocol_lib.TextCraft(create_resets_to="own_id"))
register("sciworld", "environments.sciworld.env:SciWorldEnv",
         protocol=protocol_lib.SciWorld(score_field="score", reward_scale=100.0))
register("searchqa", "environments.searchqa.env:SearchQAEnv",
         protocol=protocol_lib.SearchQA(id_key="env_idx", reset_key="id",
                                        create_resets_to="body"))
register("scripted", "environments.scripted.env:ScriptedEnv")
register("keypad", "environments.keypad.env:KeypadEnv")
# WebArena needs live web sites: only AgentGym's server runs it (env_name= of "remote").
register("webarena", "environments.webarena.prompt:WebArenaPrompt",
         protocol=protocol_lib.WebArena(id_key="env_idx", reset_key="idx"), local=False)
# Any environment with a protocol behind an AgentGym env server; kwargs url=, env_name=.
register("remote", "environments.client:RemoteEnv")


def local_names() -> list[str]:
  """The environments `make` builds in this process ("remote" included), sorted."""
  return sorted(name for name, registration in REGISTRY.items() if registration.local)


def protocol_of(name: str) -> protocol_lib.Protocol:
  """The AgentGym server protocol of environment `name`."""
  registration = REGISTRY.get(name)
  if registration is None or registration.protocol is None:
    known = sorted(n for n, r in REGISTRY.items() if r.protocol is not None)
    raise ValueError(f"No AgentGym protocol known for {name!r}; known: {known}.")
  return registration.protocol


def env_class(name: str, env_name: str | None = None) -> type[TextEnv]:
  """The class of environment `name`.

  For "remote", `env_name` selects the served environment, whose parser and instruction the
  returned class carries; without it the class parses generic ReAct responses.
  """
  if name not in REGISTRY or not REGISTRY[name].local:
    hint = (f" {name!r} runs only behind its AgentGym server: use 'remote' with "
            f"env_name={name!r} and the server's url." if name in REGISTRY else "")
    raise ValueError(f"Unknown environment {name!r}; known: {local_names()}.{hint}")
  if env_name is not None and name != "remote":
    raise ValueError(f"env_name={env_name!r} applies to 'remote' only, not {name!r}.")
  cls = REGISTRY[name].load()
  return cls if env_name is None else cls.serving(env_name)


def make(name: str, **kwargs) -> TextEnv:
  """Builds environment `name` (a key of `REGISTRY`) with its keyword arguments."""
  return env_class(name)(**kwargs)


def task_splits(name: str, env_name: str | None = None) -> dict[str, list[int]]:
  """The train/test task ids shipped for environment `name`: {"train": [...], "test": [...]}.

  For `name="remote"`, `env_name` names the served environment (a key of `REGISTRY`), whose
  split is used.
  """
  splits = _split_file(name, env_name)
  return {split: ids for split, ids in splits.items() if split != "categories"}


def task_categories(name: str, env_name: str | None = None,
                    env_kwargs: dict | None = None) -> dict[int, str]:
  """Task id -> the category that `reset` reports in info["category"], from the split file,
  for a local environment built with `env_kwargs` (`TextEnv.task_categories`: BabyAI's
  `levels` change which level an id is).

  A remote environment's server does not send it (AgentGym's protocol has no field for it),
  so `environments.client` fills it in from here; evaluation groups its columns by it. Empty
  for environments whose split file lists no categories.
  """
  categories = _split_file(name, env_name).get("categories", {})
  shipped = {int(task_id): category for task_id, category in categories.items()}
  if not env_kwargs or name == "remote":
    return shipped
  return env_class(name).task_categories(shipped, **env_kwargs)


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
                     f"{sorted(set(REGISTRY) - {'remote'})}.") from None
  with split_file.open() as f:
    return json.load(f)
