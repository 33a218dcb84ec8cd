"""The rules of the house that a grep can check (DESIGN.md): the library meets the
environments in one module, evaluation and the trainer do not import each other, and no
library module is an import-time cycle."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "agentgym_jax"


def _imports(path: pathlib.Path) -> list[str]:
  return re.findall(r"^\s*(?:import|from)\s+([\w.]+)", path.read_text(), re.MULTILINE)


def test_one_library_module_imports_environments():
  importers = sorted(str(p.relative_to(ROOT)) for p in LIBRARY.rglob("*.py")
                     if any(m == "environments" or m.startswith("environments.")
                            for m in _imports(p)))
  assert importers == ["agentgym_jax/rollout/envs.py"]


def test_environments_never_import_jax():
  for path in (ROOT / "environments").rglob("*.py"):
    assert not any(m.split(".")[0] in ("jax", "flax", "agentgym_jax") for m in _imports(path)), path


def test_evaluation_does_not_import_the_trainer():
  """The trainer imports evaluation for its in-loop evaluation; the reverse would be a cycle
  (policy loading and HF export live in train/sources.py and train/checkpoints.py)."""
  text = (LIBRARY / "evaluate.py").read_text()
  assert "agentgym_jax.train.loop" not in _imports(LIBRARY / "evaluate.py")
  assert not re.search(r"from agentgym_jax\.train import [^\n]*\bloop\b", text)


def test_the_door_checks_config_env_and_names_the_served_env():
  import pytest
  from agentgym_jax.rollout import envs
  from agentgym_jax.train import config as base
  c = base.base_config()
  c.env.name = "babyai"
  envs.check(c)
  assert envs.served_name(c) == "babyai" and len(envs.task_splits(c)["test"]) == 90
  c.env.name = "remote"
  with pytest.raises(ValueError, match="needs env_name"):
    envs.check(c)
  c.env.kwargs = {"env_name": "webarena"}
  envs.check(c)
  assert envs.served_name(c) == "webarena" and "categories" not in envs.task_splits(c)
  c.env.name = "minecraft"
  with pytest.raises(ValueError, match="Unknown environment config.env.name='minecraft'"):
    envs.check(c)


def test_env_categories_keep_each_split_to_the_named_categories():
  import pytest
  from agentgym_jax.rollout import envs
  from agentgym_jax.train import config as base
  c = base.base_config()
  c.env.name = "textcraft"
  c.env.categories = ("depth1",)
  splits = envs.task_splits(c)
  # TextCraft's split file: 94 of the 374 train goals and 31 of the 100 test goals are depth 1.
  assert (len(splits["train"]), len(splits["test"])) == (94, 31)
  import environments
  env = environments.make("textcraft")
  assert {env.reset(options={"task_id": t})[1]["category"] for t in splits["test"]} == {"depth1"}
  c.env.categories = ("depth9",)
  with pytest.raises(ValueError, match=r"names \['depth9'\].*known: \['depth1', 'depth2'"):
    envs.task_splits(c)
