"""The trainer end to end through its command line: smoke run, exact resume, bad overrides.

The runs use experiments/keypad/learn.py:runlocal (a 2-layer random model, 2 tasks x 4
samples per step) in subprocesses on one CPU device, sharing a persistent compilation cache,
so each later run reuses the executables of the first. The exact-resume comparison needs two
more training runs and is marked slow:

  .venv/bin/pytest tests/test_trainer.py -m slow -q
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from agentgym_jax import settings as settings_lib
from agentgym_jax import policies
from agentgym_jax import sharding
from agentgym_jax.models import save_hf
from agentgym_jax.rl.algorithm import ALGORITHMS
from agentgym_jax.train import config as base
from agentgym_jax.train import batches, data, loop, sources

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "experiments/keypad/learn.py:runlocal"
# Turn limit 1 for steps 0-2, 2 from step 3: a 4-step run crosses the phase boundary.
SCALING = ["--config.schedule.kind=scaling_inter", "--config.schedule.horizons=1,2",
           "--config.schedule.steps_per_phase=3"]
# Metrics that measure the machine, not the run (a resumed process compiles again).
_TIMING = ("time/", "rollout/tokens_per_s", "update/tokens_per_s", "rollout/env_seconds",
           "compile/")


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("jax_cache"))


def run_cli(module, args, cache_dir, timeout=600):
  """Runs `python -m module args` from the repo root on one CPU device."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # one device: conftest's eight would only slow these runs down
  env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache_dir,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def train(workdir, cache_dir, *overrides):
  result = run_cli("agentgym_jax.train", [f"--config={CONFIG}", f"--workdir={workdir}",
                                          "--config.log.progress_bar=False", *overrides],
                   cache_dir)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def training_metrics(line):
  return {k: v for k, v in line.items()
          if not k.startswith(_TIMING) and not k.startswith("eval/")}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, compile_cache):
  """The runlocal config through the CLI: 1 step, stop, resume for step 2 (then evaluated)."""
  workdir = str(tmp_path_factory.mktemp("smoke") / "run")
  train(workdir, compile_cache, *SCALING, "--config.total_steps=1")
  after_one = metrics(workdir)
  resumed = train(workdir, compile_cache, *SCALING, "--config.total_steps=2")
  return workdir, after_one, resumed.stderr + resumed.stdout


def test_runlocal_smoke_run_checkpoints_resumes_and_exports(smoke):
  workdir, after_one, log = smoke
  # Step 0 is the evaluation of the starting policy, before any update.
  assert [m["step"] for m in after_one] == [0, 1]
  assert all(k.startswith("eval/") for k in set(after_one[0]) - {"step"})
  with open(os.path.join(workdir, "train.log")) as f:
    assert "Restored checkpoint 1" in f.read()  # INFO goes to the log file, not the console
  # ... and the console says where the run resumes from.
  resume = os.path.join(workdir, "checkpoints", "1")
  assert f"Resuming from step 1 ({resume})" in log.splitlines(), log[-2000:]
  assert "Held-out success" in log  # the before/after summary line
  lines = metrics(workdir)
  assert [m["step"] for m in lines] == [0, 1, 2]
  assert lines[:2] == after_one  # the resumed run appended, it did not rewrite steps 0-1
  assert lines[2]["data/cursor"] == 4.0  # 2 tasks per step: the task order went on
  assert lines[2]["eval/num_tasks"] == 4.0  # evaluated after its last step
  for name in ("config.json", "run_info.json", "tokenizer/tokenizer.json", "hf/config.json",
               "hf/model.safetensors", "hf/tokenizer.json"):
    assert os.path.exists(os.path.join(workdir, name)), name
  with open(os.path.join(workdir, "run_info.json")) as f:
    assert "git_commit" in json.load(f)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]
  expected = {"episodes/success_rate", "episodes/reward_mean", "episodes/turns_mean",
              "episodes/reply_tokens_mean", "episodes/length_mean", "episodes/truncated_rate",
              "actor/entropy", "actor/clip_frac", "actor/grad_norm", "actor/pg_loss",
              "rollout/tokens_per_s", "update/tokens_per_s", "time/rollout", "time/update",
              "schedule/max_turns", "schedule/phase"}
  assert expected <= set(lines[1])


def test_evaluate_cli_reads_the_training_checkpoint(smoke, compile_cache, tmp_path):
  workdir, _, _ = smoke
  result = run_cli("agentgym_jax.evaluate", [f"--config={CONFIG}", f"--checkpoint={workdir}",
                                             f"--output={tmp_path}", "--num_tasks=2"],
                   compile_cache)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(tmp_path / "eval_test.json") as f:
    report = json.load(f)
  assert report["settings"]["num_tasks"] == 2 and "step 2" in report["label"]


def test_in_loop_and_cli_evaluation_of_a_checkpoint_give_the_same_table(smoke, compile_cache,
                                                                        tmp_path):
  """The trainer evaluated step 2 and wrote its report; the command line on the step-2
  checkpoint, with the run's config, runs the same evaluation and prints the same table."""
  workdir, _, _ = smoke
  result = run_cli("agentgym_jax.evaluate", [f"--config={CONFIG}", *SCALING,
                                             f"--checkpoint={workdir}", f"--output={tmp_path}"],
                   compile_cache)
  assert result.returncode == 0, result.stderr[-3000:]
  in_loop = os.path.join(workdir, loop.EVAL_DIR, "step_2")
  with open(os.path.join(in_loop, "eval_test.md")) as f:
    table = f.read()
  with open(tmp_path / "eval_test.md") as f:
    assert f.read() == table
  assert "| run step 2 (Pass@" in table
  with open(os.path.join(in_loop, "eval_test.json")) as f, open(tmp_path / "eval_test.json") as g:
    want, got = json.load(f), json.load(g)
  assert got["metrics"] == want["metrics"] and got["tasks"] == want["tasks"]
  assert metrics(workdir)[-1]["eval/pass"] == want["metrics"]["Overall"]["pass"]


@pytest.mark.slow
def test_resume_is_exact_across_a_scaling_inter_phase(smoke, compile_cache, tmp_path):
  """4 steps straight == the smoke run's 1 + 1 steps resumed for 2 more (phase change at 3)."""
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  shutil.copytree(smoke[0], resumed)
  train(straight, compile_cache, *SCALING, "--config.total_steps=4")
  train(resumed, compile_cache, *SCALING, "--config.total_steps=4")
  a, b = metrics(straight), metrics(resumed)
  assert [m["step"] for m in a] == [m["step"] for m in b] == [0, 1, 2, 3, 4]
  assert [m["schedule/max_turns"] for m in a[1:]] == [1.0, 1.0, 1.0, 2.0]
  for line_a, line_b in zip(a, b):
    assert training_metrics(line_a) == training_metrics(line_b), line_a["step"]
  with open(os.path.join(straight, "hf", "model.safetensors"), "rb") as f_a, \
       open(os.path.join(resumed, "hf", "model.safetensors"), "rb") as f_b:
    assert f_a.read() == f_b.read()  # identical final parameters, bit for bit


# ----- a budget of trained tokens (config.total_tokens) ---------------------------------------


@pytest.fixture(scope="module")
def budgeted(smoke, compile_cache, tmp_path_factory):
  """The smoke run's config for at most 4 steps, with a budget of one token more than its first
  step trained: the budget is reached at step 2 (same seed, same batches as the smoke run)."""
  budget = int(smoke[1][1]["update/trained_tokens"]) + 1
  workdir = str(tmp_path_factory.mktemp("budget") / "run")
  train(workdir, compile_cache, *SCALING, "--config.total_steps=4",
        f"--config.total_tokens={budget}")
  return workdir, budget


def test_a_token_budget_ends_the_run_at_the_step_that_reaches_it(smoke, budgeted):
  workdir, budget = budgeted
  lines = metrics(workdir)
  assert [m["step"] for m in lines] == [0, 1, 2]
  totals = [m["update/trained_tokens_total"] for m in lines[1:]]
  assert totals[0] < budget <= totals[1]
  assert totals[1] == sum(m["update/trained_tokens"] for m in lines[1:])
  # The last step is checkpointed, evaluated and exported as total_steps' would be, and the
  # two steps are the smoke run's (which had no budget).
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]
  assert lines[2]["eval/num_tasks"] == 4.0
  assert os.path.exists(os.path.join(workdir, "hf", "model.safetensors"))
  with open(os.path.join(workdir, "checkpoints", "2", "meta", "metadata")) as f:
    assert json.load(f)[loop.TOKENS_KEY] == totals[1]
  for line_a, line_b in zip(lines, metrics(smoke[0]), strict=True):
    assert training_metrics(line_a) == training_metrics(line_b), line_a["step"]


def test_a_resumed_run_stops_at_the_budget_s_step(smoke, budgeted, compile_cache, tmp_path):
  """The smoke run as if stopped after checkpoint 1 (checkpoint 2 removed), resumed with the
  budget: it counts step 1's tokens from the checkpoint and stops at step 2 as the
  uninterrupted run did."""
  workdir, budget = str(tmp_path / "resumed"), budgeted[1]
  shutil.copytree(smoke[0], workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "2"))
  train(workdir, compile_cache, *SCALING, "--config.total_steps=4",
        f"--config.total_tokens={budget}")
  lines = metrics(workdir)
  assert [m["step"] for m in lines] == [0, 1, 2]
  for line_a, line_b in zip(lines, metrics(budgeted[0]), strict=True):
    assert training_metrics(line_a) == training_metrics(line_b), line_a["step"]


@pytest.mark.slow  # one more trainer process; the stop itself is tested above
def test_a_run_past_its_budget_resumes_to_no_steps(budgeted, compile_cache, tmp_path):
  workdir = str(tmp_path / "done")
  shutil.copytree(budgeted[0], workdir)
  before = metrics(workdir)
  train(workdir, compile_cache, *SCALING, "--config.total_steps=4",
        f"--config.total_tokens={budgeted[1]}")
  assert metrics(workdir) == before


def test_a_negative_token_budget_is_a_one_line_error(tmp_path):
  c = base.base_config()
  c.total_tokens = -1
  with pytest.raises(ValueError, match=r"^total_tokens must be >= 0 .*got -1\.$"):
    loop.train(c, str(tmp_path))
  assert not os.listdir(tmp_path)  # refused before anything was written


@pytest.mark.parametrize("algo,agg", [
    ("gigpo", "seq-mean-token-sum-norm"),
    # The critic's turn-level path; gigpo's run covers the resume and the phase change.
    pytest.param("turn_ppo", "seq-mean-token-sum", marks=pytest.mark.slow)])
def test_turn_level_estimators_train_resume_and_cross_a_scaling_inter_phase(
    algo, agg, compile_cache, tmp_path):
  """gigpo and turn_gae through the trainer: 1 step, resume for 2 more across the phase change
  (turn limit 1 -> 2), with another loss aggregation each (the default is token-mean)."""
  workdir = str(tmp_path / algo)
  args = ["--config.schedule.kind=scaling_inter", "--config.schedule.horizons=1,2",
          "--config.schedule.steps_per_phase=1", f"--config.algo.estimator={ALGORITHMS[algo]}",
          f"--config.algo.loss_agg_mode={agg}", "--config.algo.gamma=0.9",
          "--config.eval.every_steps=0"]
  train(workdir, compile_cache, *args, "--config.total_steps=1")
  train(workdir, compile_cache, *args, "--config.total_steps=3")
  lines = metrics(workdir)
  assert [m["step"] for m in lines] == [1, 2, 3]
  assert [m["schedule/max_turns"] for m in lines] == [1.0, 2.0, 2.0]
  assert all(np.isfinite(m["actor/pg_loss"]) and np.isfinite(m["actor/grad_norm"])
             for m in lines)
  if algo == "turn_ppo":
    assert all(np.isfinite(m["critic/value_loss"]) for m in lines)


def test_history_window_runs_turns_past_what_the_context_holds(tmp_path, compile_cache):
  """10 keypad turns in a 128-token context with rollout.history_turns=1 (unwindowed, the
  episodes stop on the context after about 4 turns): through the CLI, per-turn rows."""
  workdir = str(tmp_path / "window")
  train(workdir, compile_cache, "--config.total_steps=1", "--config.eval.every_steps=0",
        "--config.rollout.history_turns=1", "--config.rollout.max_context=128",
        "--config.schedule.horizons=(10,)", "--config.env.kwargs.max_steps=10")
  line = metrics(workdir)[-1]
  assert line["episodes/stop_context"] == 0 and line["episodes/length_mean"] > 128
  # The trainer's log-probs of the per-turn rows are the sampler's.
  assert line["rollout/logprob_gap"] < 1e-4


def test_misspelt_override_stops_the_run_naming_the_field(tmp_path, compile_cache):
  result = run_cli("agentgym_jax.train", [f"--config={CONFIG}", f"--workdir={tmp_path}",
                                          "--config.algo.klcoef=0.1"], compile_cache)
  assert result.returncode != 0
  assert "klcoef" in result.stderr and "kl_coef" in result.stderr  # the field and a suggestion
  assert "Traceback" not in result.stderr
  assert not os.path.exists(tmp_path / "checkpoints")


# ----- pieces of the loop, in process -----------------------------------------------------------


def test_task_stream_is_a_deterministic_sequence_of_shuffled_epochs():
  stream = data.TaskStream([10, 11, 12, 13, 14], seed=3)
  first = stream.take(0, 12)
  assert sorted(first[:5]) == sorted(first[5:10]) == [10, 11, 12, 13, 14]
  assert first[:5] != first[5:10]  # each epoch has its own order
  assert stream.take(4, 3) == first[4:7]  # reading from a cursor across an epoch boundary
  assert data.TaskStream([10, 11, 12, 13, 14], seed=3).take(0, 12) == first
  with pytest.raises(ValueError, match="empty"):
    data.TaskStream([], seed=0)


def test_summary_line_names_the_first_and_last_evaluation_or_the_only_one(tmp_path):
  def write(*records):
    with open(tmp_path / "metrics.jsonl", "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in records)
  write({"step": 0, "eval/success_rate": 0.25}, {"step": 1}, {"step": 2, "eval/success_rate": 0.5})
  assert loop.summary_line(str(tmp_path), 90).startswith(
      "Held-out success 0.250 at step 0 -> 0.500 at step 2 (2 steps, 1.5 min")
  write({"step": 1}, {"step": 2, "eval/success_rate": 0.5})  # evaluated at the end only
  assert loop.summary_line(str(tmp_path), 90).startswith("Held-out success 0.500 at step 2 (")
  write({"step": 1})
  assert loop.summary_line(str(tmp_path), 90).startswith("Done: 1 step, 1.5 min")


def test_batch_layout_is_checked_before_anything_runs():
  c = base.base_config()
  c.data.batch_tasks, c.data.group_size = 3, 2
  c.algo.minibatches, c.algo.microbatches = 2, 2
  with pytest.raises(ValueError, match="6 rows per step must be divisible"):
    batches.check_layout(c, sharding.make_mesh(c.mesh))
  c.algo.minibatches, c.algo.microbatches = 1, 1
  c.data.batch_tasks, c.data.group_size = 8, 1
  c.rollout.replicas = 3  # the default mesh puts all 8 test devices on the data axis
  with pytest.raises(ValueError, match="rollout.replicas: replicas=3 must divide the mesh's data"):
    batches.check_layout(c, sharding.make_mesh(c.mesh))
  c.rollout.replicas = 4
  batches.check_layout(c, sharding.make_mesh(c.mesh))


def test_bpe_tokenizer_is_trained_once_and_reused_from_the_workdir(tmp_path):
  c = base.base_config()
  c.env.name, c.tokenizer.spec, c.tokenizer.bpe_tasks = "keypad", "bpe:300", 4
  tok = policies.load_tokenizer(settings_lib.policy(c), settings_lib.env(c), str(tmp_path))
  assert tok.vocab_size == 300 and (tmp_path / "tokenizer" / "tokenizer.json").exists()
  # The role names of the ChatML template got merges: the corpus carries them.
  assert len(tok.encode_text("assistant")) == 1
  c.tokenizer.bpe_tasks = 32  # a different corpus would give other merges; the cache wins
  again = policies.load_tokenizer(settings_lib.policy(c), settings_lib.env(c), str(tmp_path))
  text = "user\nCode: 7.\nassistant\n7"
  assert again.encode_text(text) == tok.encode_text(text)


def test_hf_source_loads_the_checkpoint_and_its_tokenizer(tmp_path):
  c = base.base_config()
  c.env.name, c.tokenizer.spec, c.tokenizer.bpe_tasks = "keypad", "bpe:300", 4
  env = settings_lib.env(c)
  tok = policies.load_tokenizer(settings_lib.policy(c), env, None)
  c.model.arch.vocab_size = 0
  mesh = sharding.make_mesh(c.mesh)
  c.model.source = "random"
  original = policies.build_policy(settings_lib.policy(c), tok, mesh)
  assert original.cfg.vocab_size == tok.vocab_size  # vocab_size 0 = the tokenizer's
  save_hf(original, str(tmp_path))
  tok.save_pretrained(str(tmp_path))
  c.model.source, c.model.path, c.tokenizer.spec = "hf", str(tmp_path), "model"
  hf = settings_lib.policy(c)
  loaded = policies.build_policy(hf, policies.load_tokenizer(hf, env, None), mesh)
  assert policies.policy_config(hf, tok).num_params == original.cfg.num_params
  for a, b in zip(jax.tree.leaves(nnx.state(original)), jax.tree.leaves(nnx.state(loaded))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  critic = sources.build_critic(loaded, seed=0, mesh=mesh)
  np.testing.assert_array_equal(np.asarray(critic.backbone.embed[...]),
                                np.asarray(loaded.backbone.embed[...]))
  c.model.source, c.model.arch.vocab_size = "random", 100
  with pytest.raises(ValueError, match="smaller than the tokenizer"):
    policies.build_policy(settings_lib.policy(c), tok, mesh)


def test_lock_rejects_fields_the_trainer_does_not_know():
  c = base.base_config()
  c.env.kwargs.codes = "7"  # an environment's own arguments are free-form
  assert base.lock(c).is_locked
  for path in ("algo.kl_coeff", "model.arch.hiden_size", "evals"):
    c = base.base_config()
    *parents, leaf = path.split(".")
    node = c
    for name in parents:
      node = node[name]
    node[leaf] = 1
    with pytest.raises(ValueError, match=path.replace(".", r"\.")):
      base.lock(c)


def test_parse_arg_reads_literals_bare_bools_and_rejects_unknown_keys():
  args = base.parse_arg("algo=ppo,runlocal,lr=3e-4,horizons=(1, 2)", algo="grpo",
                        runlocal=False, lr=1e-3, horizons=(3,))
  assert (args.algo, args.runlocal, args.lr, args.horizons) == ("ppo", True, 3e-4, (1, 2))
  assert base.parse_arg(None, algo="grpo").algo == "grpo"
  with pytest.raises(ValueError, match="Unknown config argument 'algos'"):
    base.parse_arg("algos=ppo", algo="grpo")
  with pytest.raises(ValueError, match="needs a value"):
    base.parse_arg("algo", algo="grpo")
