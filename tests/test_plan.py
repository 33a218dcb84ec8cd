"""The plan: slice names, one host's mesh, a whole step compiled for a TPU slice (libtpu,
ahead of time, on this CPU host) and for this machine's CPU, and the one line of a program
that does not fit."""

import importlib.util
import os
import re
import subprocess
import sys
import time

import json

import jax
import pytest
import tpu_slices

from agentgym_jax import plan, sharding, targets, tpus
from agentgym_jax.models import resolve_attention
from agentgym_jax.models.decoder import resolve_layer_loop


@pytest.fixture
def libtpu():
  tpu_slices.require_libtpu()  # the plan compiles for TPU slices with libtpu


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A tiny random model on the paper's SearchQA layout, shrunk: 16 rows, one per v5e-16 chip.
TINY = ["experiments/agentgym_rl/searchqa.py:runlocal,algo=ppo",
        "--config.model.arch.vocab_size=512", "--config.data.batch_tasks=8",
        "--config.data.group_size=2"]
# Keypad's 2-layer random model with a critic (algo=ppo), for the CPU: every program of a step
# but score_logprobs (on-policy without a reference, the step scores no log-probs).
KEYPAD = ["--config=experiments/keypad/learn.py:runlocal,algo=ppo",
          "--config.model.arch.vocab_size=300"]


@pytest.mark.usefixtures("libtpu")
@pytest.mark.parametrize("name, chips, grid, hosts", [
    ("v5e-16", 16, (4, 4), 4), ("v4-32", 16, (2, 2, 4), 4), ("v5e-64", 64, (8, 8), 16),
    ("v5p-128", 64, (4, 4, 4), 16), ("v6e-8", 8, (2, 4), 1), ("v5e-4", 4, (2, 2), 1),
    ("v4-8", 4, (2, 2, 1), 1)])
def test_slice_names_as_users_write_them(name, chips, grid, hosts):
  slice_ = tpus.Slice.parse(name)
  assert (slice_.chips, slice_.grid, slice_.hosts) == (chips, grid, hosts)
  assert len(slice_.devices()) == chips
  assert len(slice_.devices(one_host=True)) == chips // hosts


@pytest.mark.parametrize("name", ["v5e16", "v7x-8", "v4-6", "v5e-12", "tpu"])
def test_a_slice_name_it_cannot_read_is_one_line(name):
  with pytest.raises(ValueError, match="v5e-16") as info:
    tpus.Slice.parse(name)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["CPU", "tpu", "v5e16", "host"])
def test_a_topology_neither_local_nor_a_slice_is_one_line_naming_both(name):
  with pytest.raises(ValueError, match="neither cpu, gpu .* nor a TPU slice") as info:
    targets.parse(name)
  assert "\n" not in str(info.value)


def test_cpu_devices_share_the_hosts_ram():
  # conftest.py gives this process 8 CPU devices: one program on each, all in one RAM.
  target = targets.parse("cpu", memory_gib=8)
  assert (target.platform, target.hosts, target.usable_bytes) == ("cpu", 1, 1 << 30)
  assert target.describe() == "cpu: 8 devices, 8 GiB RAM (--memory_gib, 1 GiB a device)"
  assert targets.parse("cpu").memory_bytes > 0  # the host's MemTotal


@pytest.mark.usefixtures("libtpu")
def test_one_hosts_mesh_keeps_tensor_and_cuts_the_data_parallel_axes():
  slice_ = tpus.Slice.parse("v5e-16")
  whole = sharding.make_mesh((("data", 1), ("fsdp", -1), ("tensor", 1)), slice_.devices())
  host = plan.host_mesh(whole, slice_.devices(one_host=True))
  assert dict(host.shape) == {"data": 1, "fsdp": 4, "tensor": 1}
  whole = sharding.make_mesh((("data", 2), ("fsdp", 4), ("tensor", 2)), slice_.devices())
  host = plan.host_mesh(whole, slice_.devices(one_host=True))
  assert dict(host.shape) == {"data": 1, "fsdp": 2, "tensor": 2}


def _plan(*args, timeout=600, cpu_devices=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  if cpu_devices == 1:  # the machine as a user runs it, not conftest.py's 8 devices
    env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-m", "agentgym_jax.plan", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.usefixtures("libtpu")
def test_a_tiny_models_whole_step_compiles_for_v5e_16_within_two_minutes(tmp_path):
  start = time.perf_counter()
  result = _plan("--topology=v5e-16", "--config=" + TINY[0], *TINY[1:],
                 f"--config.compile.cache_dir={tmp_path}")
  seconds = time.perf_counter() - start
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  for program in ("rollout_extend", "rollout_decode", "score_logprobs", "score_values",
                  "update"):
    [line] = [l for l in lines if l.startswith(program + " ")]
    assert line.split()[-1] == "yes", line
  assert any(l.startswith("Model FLOPs per step") for l in lines), result.stdout
  # Every program went into the cache a run on a v5e-16 would read (the scorers and the
  # update are traced under the mesh).
  saved = sorted(name.split("-")[0] for name in os.listdir(tmp_path))
  assert [n for n in saved if n in ("jit_extend", "jit_decode", "jit_under_mesh")] == [
      "jit_decode", "jit_extend"] + ["jit_under_mesh"] * 3, saved
  assert lines[-1].startswith(f"Compiled programs saved in {tmp_path}: a run of this config "
                              "on a v5e-16 slice"), lines[-1]
  # The bound catches a compile that takes minutes (a program unrolled per layer or per row),
  # not the machine's load (it took 65 s beside a training run).
  assert seconds < 120, seconds


@pytest.mark.usefixtures("libtpu")
def test_a_step_too_big_for_the_slice_exits_1_naming_the_program_and_bytes():
  # A 4-GiB embedding table replicated on every chip (pure data parallelism) over a v5e's
  # 15.75 GiB: the train state alone (params, reference, two Adam moments) cannot fit.
  # The scorer alone (a forward): the resident state already does not fit.
  result = _plan("--topology=v5e-16", "--config=" + TINY[0], *TINY[1:],
                 "--config.model.arch.hidden_size=4096", "--config.model.arch.vocab_size=262144",
                 "--config.model.arch.num_heads=32", "--config.model.arch.head_dim=128",
                 "--only=score_logprobs")
  assert result.returncode == 1, result.stdout + result.stderr[-2000:]
  [fatal] = [l for l in result.stderr.splitlines() if l.startswith("FATAL")]
  assert fatal.startswith("FATAL: score_logprobs needs "), fatal
  assert "GiB per chip on v5e-16" in fatal and "15.75 GiB usable HBM" in fatal, fatal


def test_a_whole_step_compiles_for_this_cpu_against_its_ram(tmp_path):
  result = _plan("--topology=cpu", *KEYPAD, f"--json={tmp_path}/plan.json", cpu_devices=1)
  assert result.returncode == 0, result.stdout + result.stderr[-2000:]
  first = result.stdout.splitlines()[0]
  assert first.startswith(f"{KEYPAD[0].split('=', 1)[1]} on cpu: 1 device, "), first
  assert " GiB RAM (" in first, first
  with open(tmp_path / "plan.json") as f:
    saved = json.load(f)
  assert saved["platform"] == "cpu" and saved["peak_flops"] is None
  programs = {p["name"]: p for p in saved["programs"]}
  assert list(programs) == [p for p in plan.PROGRAMS if p != "score_logprobs"]
  for p in programs.values():
    assert p["fits"] and p["needed"] is None and p["temporaries"] > 0, p
  # No peak for a CPU: FLOPs without a time.
  [flops] = [l for l in result.stdout.splitlines() if l.startswith("Model FLOPs per step")]
  assert " at peak" not in flops, flops


def test_a_step_too_big_for_the_ram_exits_1_naming_the_program_and_bytes():
  # --memory_gib stands for a host with 1 MiB of RAM: the update's temporaries alone exceed it.
  result = _plan("--topology=cpu", *KEYPAD, "--memory_gib=0.001", "--only=update",
                 cpu_devices=1)
  assert result.returncode == 1, result.stdout + result.stderr[-2000:]
  [fatal] = [l for l in result.stderr.splitlines() if l.startswith("FATAL")]
  assert fatal.startswith("FATAL: update needs "), fatal
  assert "GiB per device on cpu, which has 0.001 GiB usable RAM" in fatal, fatal
  assert "rollout.max_context" in fatal, fatal


# Keypad's PPO step (every program but score_logprobs, which an on-policy update without a
# reference does not run) with a 96-token context: its longest episode fills the rows of the
# 96-token bucket that the plan compiles the update and critic for.
WARM = ["--config=experiments/keypad/learn.py:runlocal,algo=ppo",
        "--config.rollout.max_context=96"]
_CACHE_HIT = re.compile(r"Persistent compilation cache hit for '\S+' with key '(\S+)'")


@pytest.mark.slow  # a plan and a training run in processes of their own (~30 s)
def test_a_run_started_from_the_plans_cache_compiles_none_of_the_planned_programs(tmp_path):
  cache, workdir = tmp_path / "cache", tmp_path / "run"
  planned = _plan("--topology=cpu", *WARM, f"--config.compile.cache_dir={cache}",
                  cpu_devices=1)
  assert planned.returncode == 0, planned.stdout + planned.stderr[-2000:]
  keys = {name.removesuffix("-cache") for name in os.listdir(cache)}
  # The trainer's first step, in a new process on the same cache; JAX's compiler logs the
  # key of every executable it loads from it.
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DEBUG_LOG_MODULES="jax._src.compiler")
  env.pop("XLA_FLAGS", None)  # the plan's one device (the flags are part of every key)
  result = subprocess.run(
      [sys.executable, "-m", "agentgym_jax.train", *WARM, f"--workdir={workdir}",
       f"--config.compile.cache_dir={cache}", "--config.total_steps=1",
       "--config.eval.every_steps=0", "--config.log.trajectories_every=0",
       "--config.checkpoint.export_hf=False", "--config.log.progress_bar=False"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  hits = set(_CACHE_HIT.findall((workdir / "train.log").read_text()))
  # The planned programs: rollout_decode, and score_values and update (both traced under the
  # mesh). rollout_extend appends a whole 96-token chunk to every row at once; keypad's
  # openings and observations are shorter chunks (prefilled 24 and 48 wide), so the run never
  # builds it.
  planned = {k for k in keys if k.startswith(("jit_decode-", "jit_under_mesh-"))}
  assert sorted(k.split("-")[0] for k in planned) == [
      "jit_decode", "jit_under_mesh", "jit_under_mesh"], keys
  assert planned <= hits, planned - hits
  with open(workdir / "metrics.jsonl") as f:
    [step] = [json.loads(line) for line in f]
  assert step["compile/cache_hits"] == len(hits), step


def _experiment(path):
  """The experiment file at `path` (under the repository) as a module."""
  sys.path.insert(0, ROOT)  # experiment files import `experiments.agentgym_rl.common`
  spec = importlib.util.spec_from_file_location(
      path.replace("/", "_")[:-3] + "_for_plan", os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_papers_models_are_known_without_their_checkpoints():
  searchqa = _experiment("experiments/agentgym_rl/searchqa.py")
  for model, layers in (("7b", 28), ("3b", 36)):
    config = searchqa.get_config(f"model={model}")
    cfg = plan.model_config(config, plan.run_tokenizer(config), "tpu")
    assert cfg.num_layers == layers
  # The rollout's replies end where the checkpoint's tokenizer ends them.
  assert plan.run_tokenizer(config).end_of_turn_ids == (151645, 151643)  # im_end, endoftext
  config = searchqa.get_config("model=7b")
  with config.unlocked():
    config.model.path = "/nowhere/Qwen9-1T"
  with pytest.raises(ValueError, match="Qwen2.5-7B-Instruct"):
    plan.run_tokenizer(config)
  with pytest.raises(ValueError, match="Qwen2.5-7B-Instruct"):
    plan.model_config(config, None, "tpu")


def test_auto_attention_and_layer_loop_resolve_for_the_targets_platform():
  config = _experiment("experiments/keypad/learn.py").get_config("runlocal")
  with config.unlocked():
    config.model.arch.vocab_size = 300
    config.model.attention = config.model.layer_loop = "auto"
  tok = plan.run_tokenizer(config)
  for platform in ("tpu", "cpu", "gpu"):
    cfg = plan.model_config(config, tok, platform)
    assert cfg.attention == resolve_attention("auto", platform), platform
    assert cfg.layer_loop == resolve_layer_loop("auto", platform), platform


@pytest.mark.parametrize("arg, overrides, programs", [
    ("algo=ppo", {}, ("rollout_extend", "rollout_decode", "score_values", "update")),
    # On-policy without a reference, the update's own forward gives the old log-probs.
    ("algo=grpo", {}, ("rollout_extend", "rollout_decode", "update")),
    ("algo=grpo", {"algo.kl_coef": 0.01},
     ("rollout_extend", "rollout_decode", "score_logprobs", "update")),
    ("algo=grpo", {"algo.epochs": 2},  # a second epoch is off-policy: old log-probs scored
     ("rollout_extend", "rollout_decode", "score_logprobs", "update")),
    ("algo=grpo", {"mode": "bc"}, ("update",)),  # demonstrations: no rollout, no scoring
])
def test_the_plan_compiles_the_programs_the_step_runs(arg, overrides, programs):
  config = _experiment("experiments/keypad/learn.py").get_config(f"{arg},runlocal")
  with config.unlocked():
    config.update_from_flattened_dict(overrides)
  run = plan.Run.build(config, jax.devices()[:1])
  assert run.programs == programs
  # The FLOPs line counts the stages the step runs, and only those.
  program_of = {"rollout": "rollout_decode"}
  flops = plan.step_flops(run)
  assert [stage for stage, value in flops.items() if value] == [
      stage for stage in flops if program_of.get(stage, stage) in programs]


@pytest.mark.slow
@pytest.mark.usefixtures("libtpu")
def test_the_7b_searchqa_scaling_inter_config_fits_a_v4_32():
  # 12,288-token rows of Qwen2.5-7B, one per chip per micro-batch: 2-6 minutes, up to 12 GB.
  result = _plan("--topology=v4-32",
                 "--config=experiments/agentgym_rl/searchqa.py:schedule=scaling_inter,model=7b",
                 timeout=1800)
  assert result.returncode == 0, result.stdout + result.stderr[-2000:]
  fits = [l.split()[-1] for l in result.stdout.splitlines() if l.split()[:1] and
          l.split()[0] in plan.PROGRAMS]
  assert fits == ["yes"] * 4, result.stdout


@pytest.mark.slow
@pytest.mark.usefixtures("libtpu")
@pytest.mark.parametrize("topology, arg", [
    # The rollout on each host's 4 chips as tensor=4 (sharding.rollout_mesh): on the train
    # mesh's FSDP it needed 18.15 GiB of a v5e chip's 15.75 in rollout_decode.
    ("v5e-64", "schedule=fixed,model=7b,slice=v5e-64"),
    # LoRA: a bf16 base and float32 adapters; full fine-tuning does not fit a v5e-16.
    ("v5e-16", "schedule=fixed,model=7b,lora=16"),
])
def test_the_7b_babyai_fixed_config_fits_a_v5e_slice(topology, arg):
  # Qwen2.5-7B, 5,120-token rows: 2-8 minutes, up to 12 GB.
  result = _plan(f"--topology={topology}",
                 f"--config=experiments/agentgym_rl/babyai.py:{arg}", timeout=1800)
  assert result.returncode == 0, result.stdout + result.stderr[-2000:]
  fits = [l.split()[-1] for l in result.stdout.splitlines() if l.split()[:1] and
          l.split()[0] in plan.PROGRAMS]
  assert fits == ["yes"] * 4, result.stdout
