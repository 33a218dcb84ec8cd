"""The rules of the house that reading the imports can check (docs/design.md): the library meets
the environments in one module, and its packages and modules stand on floors, each importing
only the floors below its own (so evaluation, below the trainer, never imports it, and no two
of them import each other)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "agentgym_jax"

# The floors of agentgym_jax/: a package or module (by its name under agentgym_jax/;
# "__init__" is agentgym_jax/__init__.py) -> its floor. A module imports only modules of lower
# floors, besides those of its own package. Every package and module stands on one, so a new
# module fails `test_every_import_goes_down_a_floor` until it is placed here.
FLOORS = {
    # 1: no other part of the library.
    "__init__": 1, "caches": 1, "freed_memory": 1, "rl": 1, "sharding": 1, "sweeps": 1, "tokenization": 1,
    "tpus": 1,
    "models": 2, "targets": 2,
    "rollout": 3,
    # 4: what the commands share: flags, processes of a multi-host job, the policy to load.
    "cli": 4, "multihost": 4, "policies": 4,
    # 5: the one door from the config to the typed settings everything below takes.
    "settings": 5,
    "evaluate": 6,
    "train": 7,
    # 8: the tools around a training run.
    "plan": 8, "replay": 8, "report": 8, "archive": 8, "viewer": 8,
}


def _module_name(path: pathlib.Path) -> str:
  """The dotted name a file is imported by, e.g. "agentgym_jax.train.loop"."""
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, dotted name) of every import in the file, those inside functions included.

  `from a import b` gives "a.b" (b may be a module or a name in a), a relative import its
  absolute name, and `importlib.import_module("a.b")` or `__import__("a.b")` with a literal
  name "a.b".
  """
  package = _module_name(path).split(".")
  if path.name != "__init__.py":
    package = package[:-1]
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found += [(node.lineno, alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
      found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
          and isinstance(node.args[0].value, str)
          and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
              "import_module", "__import__")):
      found.append((node.lineno, node.args[0].value))
  return found


def _unit(dotted: str) -> str:
  """The FLOORS key of a module of the library: "agentgym_jax.train.loop" -> "train"."""
  parts = dotted.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def test_every_library_module_stands_on_a_floor():
  units = {_unit(_module_name(p)) for p in LIBRARY.rglob("*.py")}
  unplaced = sorted(units - set(FLOORS))
  assert not unplaced, f"agentgym_jax/ parts on no floor (add them to FLOORS): {unplaced}"
  gone = sorted(set(FLOORS) - units)
  assert not gone, f"FLOORS names what agentgym_jax/ no longer has: {gone}"


def test_every_import_goes_down_a_floor():
  wrong = []
  for path in sorted(LIBRARY.rglob("*.py")):
    unit = _unit(_module_name(path))
    for line, dotted in _imports(path):
      if dotted != "agentgym_jax" and not dotted.startswith("agentgym_jax."):
        continue
      target = _unit(dotted)
      if target != unit and FLOORS.get(target, 0) >= FLOORS.get(unit, 0):
        wrong.append(f"{path.relative_to(ROOT)}:{line} imports {dotted}: {target} is on floor "
                     f"{FLOORS.get(target)}, {unit} on floor {FLOORS.get(unit)}")
  assert not wrong, "Imports must go down a floor (FLOORS):\n" + "\n".join(wrong)


# Below the trainer (FLOORS under "train") every module takes typed settings, never the config
# (docs/design.md, "Typed settings"). Exempt: `agentgym_jax/settings.py`, the one door from the
# ConfigDict to those settings, which stands below the evaluation command line that calls it;
# and the command lines themselves (`__main__.py` modules), which read the --config flag.
CONFIG_DOORS = ("agentgym_jax/settings.py",)


def _is_config_dict(annotation: ast.AST | None) -> bool:
  """Whether an annotation names ml_collections' ConfigDict (also inside `X | None`, or as a
  string)."""
  for node in ast.walk(annotation) if annotation is not None else ():
    if (isinstance(node, ast.Name) and node.id == "ConfigDict"
        or isinstance(node, ast.Attribute) and node.attr == "ConfigDict"
        or isinstance(node, ast.Constant) and "ConfigDict" in str(node.value)):
      return True
  return False


def config_takers(source: str, filename: str = "<source>") -> list[str]:
  """"file:line function(parameter)" for each parameter of a function in `source` that takes
  the config: annotated as a ConfigDict, or, unannotated or not, named `config`."""
  found = []
  for node in ast.walk(ast.parse(source, filename)):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      continue
    a = node.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs] + [p for p in (a.vararg, a.kwarg) if p]
    name = getattr(node, "name", "<lambda>")
    found += [f"{filename}:{node.lineno} {name}({p.arg})" for p in params
              if p.arg == "config" or _is_config_dict(p.annotation)]
  return found


def test_no_module_below_the_trainer_takes_the_config():
  takers = []
  for path in sorted(LIBRARY.rglob("*.py")):
    relative = str(path.relative_to(ROOT))
    if (FLOORS[_unit(_module_name(path))] >= FLOORS["train"] or path.name == "__main__.py"
        or relative in CONFIG_DOORS):
      continue
    takers += config_takers(path.read_text(), relative)
  assert not takers, ("Modules below train/ take typed settings, not the ConfigDict (make them "
                      "in agentgym_jax/settings.py):\n" + "\n".join(takers))


def test_the_config_check_finds_each_way_of_taking_it():
  source = """
def annotated(c: ml_collections.ConfigDict): ...
def optional(*, c: "ConfigDict | None" = None): ...
class Spec:
  @classmethod
  def from_config(cls, config): ...
def typed(env: EnvSettings, configure: bool, cfg: ModelConfig): ...
"""
  assert config_takers(source) == ["<source>:2 annotated(c)", "<source>:3 optional(c)",
                                   "<source>:6 from_config(config)"]


def test_replay_regenerates_without_the_trainer_loop():
  """Replay reruns a step's rollouts through the rollout engine itself, not the trainer's."""
  found = [(line, dotted) for line, dotted in _imports(LIBRARY / "replay.py")
           if dotted == "agentgym_jax.train.loop" or dotted.startswith("agentgym_jax.train.loop.")]
  assert not found, f"agentgym_jax/replay.py imports the trainer loop: {found}"


def test_one_library_module_imports_environments():
  importers = sorted(str(p.relative_to(ROOT)) for p in LIBRARY.rglob("*.py")
                     if any(m == "environments" or m.startswith("environments.")
                            for _, m in _imports(p)))
  assert importers == ["agentgym_jax/rollout/envs.py"]


def test_environments_never_import_jax():
  for path in (ROOT / "environments").rglob("*.py"):
    assert not any(m.split(".")[0] in ("jax", "flax", "agentgym_jax")
                   for _, m in _imports(path)), path


def test_the_door_checks_config_env_and_names_the_served_env():
  import pytest
  from agentgym_jax import settings
  from agentgym_jax.rollout import envs
  from agentgym_jax.train import config as base
  c = base.base_config()
  c.env.name = "babyai"
  envs.check(settings.env(c))
  assert (envs.served_name(settings.env(c)) == "babyai"
          and len(envs.task_splits(settings.env(c))["test"]) == 90)
  c.env.name = "remote"
  with pytest.raises(ValueError, match="needs env_name"):
    envs.check(settings.env(c))
  c.env.kwargs = {"env_name": "webarena"}
  envs.check(settings.env(c))
  assert (envs.served_name(settings.env(c)) == "webarena"
          and "categories" not in envs.task_splits(settings.env(c)))
  c.env.name = "minecraft"
  with pytest.raises(ValueError, match="Unknown environment config.env.name='minecraft'"):
    envs.check(settings.env(c))


def test_env_categories_keep_each_split_to_the_named_categories():
  import pytest
  from agentgym_jax import settings
  from agentgym_jax.rollout import envs
  from agentgym_jax.train import config as base
  c = base.base_config()
  c.env.name = "textcraft"
  c.env.categories = ("depth1",)
  splits = envs.task_splits(settings.env(c))
  # TextCraft's split file: 94 of the 374 train goals and 31 of the 100 test goals are depth 1.
  assert (len(splits["train"]), len(splits["test"])) == (94, 31)
  import environments
  env = environments.make("textcraft")
  assert {env.reset(options={"task_id": t})[1]["category"] for t in splits["test"]} == {"depth1"}
  c.env.categories = ("depth9",)
  with pytest.raises(ValueError, match=r"names \['depth9'\].*known: \['depth1', 'depth2'"):
    envs.task_splits(settings.env(c))
