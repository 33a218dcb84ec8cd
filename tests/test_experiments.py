"""Every experiment config loads for every documented argument, is locked, and its sweeps expand."""

import importlib.util
import itertools
import pathlib
import sys

import ml_collections
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # experiment files import `experiments.agentgym_rl.common`.
  sys.path.insert(0, str(ROOT))

from agentgym_jax import settings as settings_lib  # pylint: disable=wrong-import-position
from agentgym_jax import sweeps  # pylint: disable=wrong-import-position
from agentgym_jax.train import config as base  # pylint: disable=wrong-import-position

PAPER_ENVS = ("babyai", "textcraft", "sciworld", "searchqa", "webarena")
# Every structural argument documented in experiments/agentgym_rl/common.py.
PAPER_ARGS = [
    ",".join(f"{k}={v}" for k, v in zip(("schedule", "algo", "model"), combo)) + extra
    for combo in itertools.product(("fixed", "scaling_inter"),
                                   ("grpo", "ppo", "reinforce_pp", "rloo"),
                                   ("3b", "7b", "smollm2"))
    for extra in ("", ",runlocal")
]
# Documented sweeps per file.
PAPER_SWEEPS = {"babyai": ("horizon", "algo"), "textcraft": ("horizon", "algo"),
                "sciworld": ("horizon", "algo"), "searchqa": ("horizon", "schedule", "algo"),
                "webarena": ("horizon", "algo")}


def load(path):
  spec = importlib.util.spec_from_file_location(f"exp_{pathlib.Path(path).stem}", ROOT / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def all_experiment_files():
  return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "experiments").rglob("*.py")
                if p.name != "common.py" and "get_config" in p.read_text())


def test_every_experiment_file_is_covered():
  files = all_experiment_files()
  assert {f"experiments/agentgym_rl/{e}.py" for e in PAPER_ENVS} <= set(files)


@pytest.mark.parametrize("path", all_experiment_files())
def test_default_config_is_locked_and_complete(path):
  config = load(path).get_config(None)
  assert isinstance(config, ml_collections.ConfigDict) and config.is_locked
  # Same fields as the trainer's base schema: experiments change fields, never add any.
  assert set(_leaves(config)) == set(_leaves(base.base_config())), path
  with pytest.raises(AttributeError, match="does not exist"):
    config.optim.lrr = 1.0
  with pytest.raises(AttributeError, match="does not exist"):
    config.nonexistent_section = 1


@pytest.mark.parametrize("env", PAPER_ENVS)
def test_paper_configs_load_for_every_documented_arg(env):
  module = load(f"experiments/agentgym_rl/{env}.py")
  for arg in PAPER_ARGS:
    config = module.get_config(arg)
    assert config.is_locked, arg
    assert config.env.name in (env, "remote"), arg
    kind = "scaling_inter" if "scaling_inter" in arg else "fixed"
    assert config.schedule.kind == kind
    settings_lib.schedule(config)  # the trainer's own check of the horizon schedule
    rows = config.data.batch_tasks * config.data.group_size
    assert rows % (config.algo.minibatches * config.algo.microbatches) == 0, arg
    if "smollm2" in arg:
      _check_smollm2(config, runlocal="runlocal" in arg)
    elif "runlocal" in arg:
      assert config.model.source == "random" and config.total_steps == 2
      assert config.tokenizer.spec.startswith("bpe:")
    else:
      assert config.model.source == "hf" and config.model.path.endswith(
          "Qwen2.5-7B-Instruct" if "7b" in arg else "Qwen2.5-3B-Instruct")
      assert config.optim.lr == 1e-6 and config.algo.kl_coef == 1e-3
      assert config.algo.kl_estimator == "low_var_kl" and not config.algo.kl_in_reward
    expected = {"grpo": "grpo", "ppo": "gae", "reinforce_pp": "reinforce_plus_plus",
                "rloo": "rloo"}[arg.split("algo=")[1].split(",")[0]]
    assert config.algo.estimator == expected


def _check_smollm2(config, runlocal):
  """model=smollm2: SmolLM2 and its own tokenizer on one CPU device, with or without runlocal."""
  assert config.model.source == "smollm2" and config.tokenizer.spec == "model"
  assert config.model.remat and config.model.dtype == "float32"
  assert config.mesh == (("data", -1), ("fsdp", 1), ("tensor", 1))
  rows = config.data.batch_tasks * config.data.group_size
  assert rows // (config.algo.minibatches * config.algo.microbatches) == 1  # one row per micro
  assert config.optim.lr == 1e-5 and config.algo.kl_coef == 1e-3
  if runlocal:
    assert config.total_steps == 2 and config.rollout.max_context == 1024
  else:
    assert rows == 16 and config.rollout.max_context == 2048 and config.eval.temperature == 0.0


@pytest.mark.parametrize("env", PAPER_ENVS)
def test_bad_arguments_are_errors(env):
  module = load(f"experiments/agentgym_rl/{env}.py")
  with pytest.raises(ValueError, match="Unknown config argument"):
    module.get_config("schedul=fixed")
  with pytest.raises(ValueError, match="is not one of"):
    module.get_config("algo=dpo")
  with pytest.raises(ValueError, match="is not one of"):
    module.get_config("model=70b")


@pytest.mark.parametrize("env", ("babyai", "textcraft"))
def test_tiny_study_evaluates_greedy_or_sampled(env):
  module = load(f"experiments/tiny/{env}.py")
  greedy = module.get_config("stage=rl,algo=ppo,init=/tmp/bc")
  assert (greedy.eval.temperature, greedy.eval.group_size) == (0.0, 1)
  sampled = module.get_config("stage=rl,algo=ppo,init=/tmp/bc,eval=sampled")
  assert (sampled.eval.temperature, sampled.eval.group_size) == (1.0, 4)
  assert sampled.eval.every_steps == sampled.total_steps // 2
  # Nothing but the evaluation differs.
  greedy.unlock()
  greedy.eval.update(sampled.eval)
  assert greedy.to_json_best_effort() == sampled.to_json_best_effort()
  with pytest.raises(ValueError, match="is not one of"):
    module.get_config("stage=rl,init=/tmp/bc,eval=beam")
  with pytest.raises(ValueError, match="add init="):
    module.get_config("stage=rl")


# The shipped scripts' rows (agentgym-rl.md §3.2 / environments.md §1.4):
# env, schedule -> (n, tasks per step, minibatches, ppo epochs, horizons, steps per phase,
# tokens per turn, prompt + response tokens).
PAPER_ROWS = {
    ("babyai", "fixed"): (8, 16, 2, 1, (20,), 200, 1024 + 4096),
    ("babyai", "scaling_inter"): (4, 32, 4, 2, (6, 13, 20), 512, 512 + 8192),
    ("sciworld", "fixed"): (8, 16, 2, 1, (20,), 200, 1024 + 4096),
    ("sciworld", "scaling_inter"): (8, 16, 2, 1, (10, 20, 30), 200, 1024 + 8192),
    ("searchqa", "fixed"): (4, 32, 4, 2, (5,), 512, 1024 + 8192),
    ("searchqa", "scaling_inter"): (4, 32, 4, 2, (5, 8, 10), 512, 1024 + 8192),
    ("textcraft", "fixed"): (8, 32, 4, 2, (30,), 512, 512 + 10240),
    ("textcraft", "scaling_inter"): (8, 32, 4, 2, (10, 20, 30), 512, 512 + 10240),
    ("webarena", "fixed"): (4, 32, 8, 2, (15,), 512, 750 + 14098),
    ("webarena", "scaling_inter"): (4, 32, 8, 2, (8, 12, 15), 512, 750 + 14098),
}


@pytest.mark.parametrize("env,kind", sorted(PAPER_ROWS))
def test_paper_rows(env, kind):
  c = load(f"experiments/agentgym_rl/{env}.py").get_config(f"schedule={kind}")
  got = (c.data.group_size, c.data.batch_tasks, c.algo.minibatches, c.algo.epochs,
         tuple(c.schedule.horizons), c.rollout.max_reply_tokens, c.rollout.max_context)
  assert got == PAPER_ROWS[(env, kind)]
  if kind == "scaling_inter":
    assert c.schedule.steps_per_phase == (80 if env == "webarena" else 100)
    # The run reaches the last phase.
    assert c.total_steps > c.schedule.steps_per_phase * (len(c.schedule.horizons) - 1)


@pytest.mark.parametrize("env", PAPER_ENVS)
def test_sweeps_expand_and_apply(env):
  path = f"experiments/agentgym_rl/{env}.py"
  module = load(path)
  for name in PAPER_SWEEPS[env]:
    points = module.get_sweep(name)
    assert points and len({sweeps.point_name(p) for p in points}) == len(points), name
    for point in points:
      args, fields = sweeps.split_point(point)
      arg = sweeps.merge_config_arg("schedule=scaling_inter,runlocal", args)
      config = module.get_config(arg)
      for key, value in fields.items():  # every field a sweep sets exists and takes the value
        section, _, leaf = key.rpartition(".")
        holder = config
        for part in filter(None, section.split(".")):
          holder = holder[part]
        holder[leaf] = value
      settings_lib.schedule(config)
  with pytest.raises(ValueError, match="Unknown sweep"):
    module.get_sweep("nope")


def test_algo_sweep_covers_table6():
  points = load("experiments/agentgym_rl/textcraft.py").get_sweep("algo")
  assert {(p["arg.algo"], p["arg.model"]) for p in points} == set(
      itertools.product(("grpo", "ppo", "reinforce_pp", "rloo"), ("3b", "7b")))


def _leaves(config, prefix=""):
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict) and key not in ("kwargs", "arch",
                                                                    "estimator_kwargs", "mix"):
      yield from _leaves(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}"


@pytest.mark.parametrize("env, slice_, microbatches, tensor", [
    ("searchqa", "v5e-16", 2, 1),  # 32 rows per minibatch: 2 micro-batches of one row a chip
    ("searchqa", "v4-32", 2, 1),  # 16 chips too
    ("searchqa", "v5e-64", 1, 2),  # 32 rows on 64 chips: each row's heads over 2
    ("textcraft", "v5e-64", 1, 1),  # 64 rows per minibatch
    ("webarena", "v5p-128", 1, 4)])  # 16 rows on 64 chips
def test_paper_configs_size_micro_batches_and_mesh_for_their_slice(env, slice_, microbatches,
                                                                    tensor):
  config = load(f"experiments/agentgym_rl/{env}.py").get_config(f"model=7b,slice={slice_}")
  assert config.algo.microbatches == microbatches
  assert dict(config.mesh) == {"data": 1, "fsdp": -1, "tensor": tensor}
  with pytest.raises(ValueError, match="v5e-16"):
    load(f"experiments/agentgym_rl/{env}.py").get_config("slice=v5e16")
