"""One run over several environments (`env.name = "mix"`, `env.mix`): each batch's tasks by
ratio, the cursor that resumes them, one-line errors for bad mixtures, the pool that routes
episodes to their environments, per-environment metrics and held-out results, and the
SmolLM2 mixture's runlocal config trained end to end with a tiny random model in SmolLM2's
place (through the command line, resumed after its first step).

The same config with SmolLM2 itself (BC then RL, a few minutes) is marked slow:

  pytest -m slow tests/test_multienv.py -q
"""

import importlib
import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

import environments
from agentgym_jax import evaluate
from agentgym_jax import settings
from agentgym_jax.rollout import envs
from agentgym_jax.rollout.episodes import opening_messages
from agentgym_jax.tokenization import ChatTokenizer
from agentgym_jax.train import config as base
from agentgym_jax.train import data, sources

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # experiment files import `experiments.smollm2.common`.
  sys.path.insert(0, REPO)
CONFIG = "experiments/smollm2/multienv.py"


def mixture(**members):
  """A locked mixed run's config of `members` (label -> envs.member)."""
  c = base.base_config()
  c.env.name = envs.MIX
  c.env.mix = ml_collections.ConfigDict(members)
  return base.lock(c)


def babyai_and_textcraft(babyai=0.5, textcraft=0.5):
  return mixture(babyai=envs.member("babyai", babyai, max_turns=3),
                 textcraft=envs.member("textcraft", textcraft, categories=("depth1",),
                                       system_prompt="You craft."))


# ----- the stream: golden counts and resumption ------------------------------------------------


def _counts(owners, batch, members):
  return [np.bincount(owners[i:i + batch], minlength=members).tolist()
          for i in range(0, len(owners), batch)]


@pytest.mark.parametrize("ratios, batch, expected_owners, expected_counts", [
    # deficits at p=0: .5 .25 .25 -> 0; p=1: 0 .5 .5 -> 1 (tie: lower); p=2: .5 -.25 .75 -> 2;
    # p=3: 1 0 0 -> 0; then the same again.
    ((0.5, 0.25, 0.25), 4, [0, 1, 2, 0, 0, 1, 2, 0], [[2, 1, 1], [2, 1, 1]]),
    # p=0: .75 .25 -> 0; p=1: .5 .5 -> 0; p=2: .25 .75 -> 1; p=3: 1 0 -> 0.
    ((0.75, 0.25), 2, [0, 0, 1, 0, 0, 0, 1, 0], [[2, 0], [1, 1], [2, 0], [1, 1]]),
    ((0.5, 0.5), 2, [0, 1, 0, 1, 0, 1, 0, 1], [[1, 1]] * 4),
])
def test_mixture_stream_gives_each_batch_its_share(ratios, batch, expected_owners,
                                                   expected_counts):
  stream = data.MixtureStream([data.TaskStream([10 * i], 0) for i in range(len(ratios))],
                              ratios)
  owners = stream.owners(0, 8)
  assert owners == expected_owners
  assert _counts(owners, batch, len(ratios)) == expected_counts
  assert stream.take(0, 8) == [10 * i for i in expected_owners]


def test_mixture_stream_holds_every_share_to_within_one_task():
  ratios = (0.6, 0.3, 0.1)
  stream = data.MixtureStream([data.TaskStream([i], 0) for i in range(3)], ratios)
  owners = np.asarray(stream.owners(0, 1000))
  for p in range(1, 1001):
    counts = np.bincount(owners[:p], minlength=3)
    assert np.all(np.abs(counts - np.asarray(ratios) * p) < 1), p


def test_each_environment_keeps_its_own_shuffled_epochs_in_a_mixed_run():
  config = babyai_and_textcraft()
  env = settings.env(config)
  stream = sources.task_stream(env, config.seed)
  drawn = stream.take(0, 40)
  babyai, textcraft = env.mix
  # One task of each per batch of 2, in the members' label order.
  assert [envs.environment_of(env, t) for t in drawn] == ["babyai", "textcraft"] * 20
  # Each environment's ids are its own stream's: its training tasks, in its shuffled order.
  for m, ids in ((babyai, drawn[0::2]), (textcraft, drawn[1::2])):
    own = data.TaskStream([m.encode(t) for t in envs.training_tasks(m.env)], config.seed)
    assert ids == own.take(0, 20)
  assert {t % envs.TASK_STRIDE for t in drawn[1::2]} <= set(envs.training_tasks(textcraft.env))


def test_a_restarted_mixture_draws_from_its_cursor_what_the_first_would_have():
  env = settings.env(babyai_and_textcraft(0.75, 0.25))
  uninterrupted = sources.task_stream(env, 0).take(0, 30)
  restarted = sources.task_stream(env, 0)  # a new process: nothing but the saved cursor
  assert restarted.take(14, 16) == uninterrupted[14:]
  assert sources.task_stream(env, 0).take(7, 3) == uninterrupted[7:10]


def test_each_environment_runs_alone_in_its_member_settings():
  config = babyai_and_textcraft()
  config.env.num_workers = 3
  env = settings.env(config)
  babyai, textcraft = env.mix
  assert (babyai.label, babyai.env.name, babyai.max_turns) == ("babyai", "babyai", 3)
  assert (textcraft.label, textcraft.index, textcraft.max_turns) == ("textcraft", 1, 0)
  assert textcraft.env.categories == ("depth1",)
  assert textcraft.env.system_prompt == "You craft."
  # The run's pool settings hold for each environment; a member mixes nothing itself.
  assert babyai.env.num_workers == textcraft.env.num_workers == 3
  assert not textcraft.env.mix and env.name == envs.MIX and env.is_mixture


def test_a_capped_environment_s_demonstrations_stop_at_its_cap(tmp_path, monkeypatch):
  config = babyai_and_textcraft()
  config.schedule.kind, config.schedule.horizons = "scaling_inter", (2, 6, 10)
  config.bc.num_tasks, config.bc.cache_dir = 1, str(tmp_path)
  corpus = [environments.env_class(n).instruction for n in ("babyai", "textcraft")] * 10
  tok = ChatTokenizer.train_bpe(corpus, vocab_size=300)
  played = []
  original = sources.demos_lib.expert_episodes

  def spy(env, tok, task_ids, expert):
    played.append((env.name, expert.max_turns))
    return original(env, tok, task_ids, expert)

  monkeypatch.setattr(sources.demos_lib, "expert_episodes", spy)
  sources.demonstrations(config, settings.env(config), tok)
  # BabyAI's 3-turn cap below the schedule's longest horizon; TextCraft has no cap.
  assert played == [("babyai", 3), ("textcraft", 10)]


# ----- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", [
    (lambda c: setattr(c.env.mix.babyai, "name", "babyaii"),
     r"Unknown environment config\.env\.mix\.babyai\.name='babyaii'"),
    (lambda c: setattr(c.env.mix.babyai, "ratio", -0.5),
     r"config\.env\.mix\.babyai\.ratio=-0\.5 must be > 0"),
    (lambda c: setattr(c.env.mix.babyai, "ratio", 0.7),
     r"config\.env\.mix ratios sum to 1\.2 .*must sum to 1"),
    (lambda c: setattr(c.env.mix.textcraft, "max_turns", -1),
     r"config\.env\.mix\.textcraft\.max_turns=-1"),
    (lambda c: setattr(c.env.mix.textcraft, "categories", ("depth9",)),
     r"config\.env\.mix\.textcraft: config\.env\.categories names \['depth9'\]"),
    (lambda c: setattr(c.env, "name", "babyai"),
     r"config\.env\.mix lists environments but config\.env\.name is 'babyai'"),
    (lambda c: setattr(c.env, "categories", ("depth1",)),
     r"config\.env\.categories is set, but a mixture sets it per environment"),
])
def test_a_bad_mixture_is_a_one_line_error_naming_the_field(change, message):
  config = babyai_and_textcraft()
  change(config)
  with pytest.raises(ValueError, match=message) as error:
    envs.check(settings.env(config))
  assert "\n" not in str(error.value)


def test_a_mixture_member_with_missing_or_unknown_fields_is_named():
  config = babyai_and_textcraft()
  with config.env.mix.unlocked():
    config.env.mix.extra = ml_collections.ConfigDict({"name": "keypad", "ratio": 0.0,
                                                      "turns": 3})
  with pytest.raises(ValueError, match=r"config\.env\.mix\.extra lacks \['kwargs', .*"
                                       r"has unknown \['turns'\]"):
    settings.env(config)
  with pytest.raises(ValueError, match=r"config\.env\.name='mix' needs its environments"):
    envs.check(settings.env(mixture()))


def test_behaviour_cloning_mixes_each_environment_s_demonstrations_by_ratio(tmp_path):
  config = babyai_and_textcraft()
  config.bc.num_tasks, config.bc.cache_dir = 3, str(tmp_path)
  corpus = [environments.env_class(n).instruction for n in ("babyai", "textcraft")] * 10
  tok = ChatTokenizer.train_bpe(corpus, vocab_size=300)
  env = settings.env(config)
  demos = sources.demonstrations(config, env, tok)
  babyai, textcraft = env.mix
  # Each environment's first 3 training tasks, played by its own expert in its own episode
  # layout (TextCraft's with its system prompt), ids the mixed run's.
  assert [e.task_id for e in demos] == (
      [babyai.encode(t) for t in envs.training_tasks(babyai.env)[:3]]
      + [textcraft.encode(t) for t in envs.training_tasks(textcraft.env)[:3]])
  assert [e.messages[0]["role"] for e in demos] == ["user"] * 3 + ["system"] * 3
  assert all(e.success for e in demos)
  order = sources.task_stream(env, config.seed, demos).take(0, 6)
  assert sorted(order[0::2]) == [0, 1, 2] and sorted(order[1::2]) == [3, 4, 5]


# ----- the pool and the evaluation split --------------------------------------------------------


def test_mixed_pool_routes_each_episode_and_gives_its_environment_s_opening():
  env = settings.env(babyai_and_textcraft())
  babyai, textcraft = env.mix
  task_ids = [textcraft.encode(envs.training_tasks(textcraft.env)[0]),
              babyai.encode(envs.training_tasks(babyai.env)[0])]
  with envs.make_pool(env) as pool:
    opened = pool.reset(task_ids)
    assert [out.info["task_id"] for out in opened] == task_ids
    assert [out.info["system_prompt"] for out in opened] == ["You craft.", None]
    assert [out.info["turn_limit"] for out in opened] == [0, 3]
    assert "Crafting commands" in opened[0].observation
    assert opened[1].info["acknowledgement"] == pool.pools[0].env_cls.acknowledgement
    stepped = pool.step([1, 0], ["Action:\nturn left", "Action:\ninventory"])
    assert not any(out.failed for out in stepped)
    assert [out.info["action"] for out in stepped] == ["turn left", "inventory"]
    # Overlapped rollouts submit and collect: both environments' pools answer.
    pool.submit([0, 1], ["Action:\ninventory", "Action:\nturn right"])
    answered = {}
    while pool.in_flight:
      answered.update(pool.collect(None))
    assert [answered[slot].info["action"] for slot in (0, 1)] == ["inventory", "turn right"]


def test_the_opening_takes_its_environment_s_system_prompt_from_the_reset():
  info = {"instruction": "Craft.", "acknowledgement": "OK.", "system_prompt": "You craft."}
  assert opening_messages(info, "Goal: stick.", "The run's prompt.", "Ack.") == [
      {"role": "system", "content": "You craft."}, {"role": "user", "content": "Craft."},
      {"role": "assistant", "content": "OK."}, {"role": "user", "content": "Goal: stick."}]
  info["system_prompt"] = None  # this environment has none, whatever the run's
  assert opening_messages(info, "Goal: stick.", "The run's prompt.", "Ack.")[0]["role"] == "user"


def test_evaluation_takes_the_first_tasks_of_each_environment():
  env = settings.env(babyai_and_textcraft())
  babyai, textcraft = env.mix
  ids = envs.evaluation_tasks(env, "test", 3)
  assert ids == ([babyai.encode(t) for t in envs.task_splits(babyai.env)["test"][:3]]
                 + [textcraft.encode(t) for t in envs.task_splits(textcraft.env)["test"][:3]])
  with pytest.raises(ValueError, match="Split 'dev' not in"):
    envs.evaluation_tasks(env, "dev", 3)


def test_held_out_results_per_environment_by_hand():
  env = settings.env(babyai_and_textcraft())
  babyai, textcraft = env.mix
  task_ids = [babyai.encode(1), babyai.encode(2), textcraft.encode(5), textcraft.encode(6)]
  success = np.array([True, False, True, True])
  failed = np.array([False, False, False, True])
  summary = {"babyai": {"avg": 0.5, "pass": 0.5}, "textcraft": {"avg": 1.0, "pass": 1.0}}
  result = evaluate.EvalResult(
      summary=summary, settings={}, task_ids=task_ids, rewards=success * 1.0,
      scores=success * 1.0, success=success, passed=success, num_turns=np.ones(4, np.int32),
      failed=failed, stop_reasons=["terminated"] * 4, categories={}, seconds=0.0)
  assert evaluate.environment_metrics(env, result) == {
      "babyai/success_rate": 0.5, "babyai/avg": 0.5, "babyai/pass": 0.5,
      # the failed episode measured nothing: 1 of 1 healthy
      "textcraft/success_rate": 1.0, "textcraft/avg": 1.0, "textcraft/pass": 1.0}


# ----- end to end through the command line -----------------------------------------------------


def _train(workdir, config_arg, *overrides, timeout=600):
  """The trainer's command line on one CPU device, with the test processes' compilation cache
  (tests/conftest.py), so a second run loads what the first compiled."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # one device, as a laptop runs runlocal
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  result = subprocess.run(
      [sys.executable, "-m", "agentgym_jax.train", f"--config={CONFIG}:{config_arg}",
       f"--workdir={workdir}", "--config.log.progress_bar=False", *overrides],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


# The runlocal config with a tiny random model and a small BPE tokenizer in SmolLM2's place:
# seconds a step. BabyAI's episodes stop after 1 turn (its cap), TextCraft's after 2. Without
# dynamic sampling each step draws exactly its 2 tasks, so the resumed step's are known.
TINY = ["--config.init_from=", "--config.algo.dynamic_sampling=False", "--config.model.source=random", "--config.tokenizer.spec=bpe:400",
        "--config.tokenizer.bpe_tasks=4", "--config.rollout.max_reply_tokens=16",
        "--config.env.mix.babyai.max_turns=1", "--config.eval.num_tasks=1",
        "--config.log.trajectories_every=1", "--config.compile.max_resident_gib=0",
        "--config.env.num_workers=1"]


def test_multienv_runlocal_trains_resumes_and_reports_each_environment(tmp_path):
  workdir = tmp_path / "run"
  arg = "stage=rl,init=unused,runlocal"
  _train(workdir, arg, *TINY)
  resumed = _train(workdir, arg, *TINY, "--config.total_steps=2")
  assert "Resuming from step 1" in resumed.stdout
  lines = _lines(workdir / "metrics.jsonl")
  assert [m["step"] for m in lines] == [1, 2]
  config = importlib.import_module("experiments.smollm2.multienv").get_config(arg)
  stream = sources.task_stream(settings.env(config), config.seed)
  for line in lines:
    assert line["data/cursor"] == 2 * line["step"]
    for label in ("babyai", "textcraft"):
      assert line[f"episodes/{label}/count"] == 2.0  # one task of each, 2 samples
      for name in ("success_rate", "reward_mean", "turns_mean", "length_mean"):
        assert f"episodes/{label}/{name}" in line
      assert f"eval/{label}/success_rate" in line
    assert line["episodes/babyai/turns_mean"] == 1.0  # its cap, below the schedule's 2
    assert line["episodes/textcraft/turns_mean"] == 2.0
    assert "eval/success_rate" in line
    # Each step's groups are the stream's tasks at its cursor: the resumed step 2 too.
    step = _lines(workdir / "trajectories" / f"step_{line['step']}.jsonl")
    start = 2 * (line["step"] - 1)
    assert [e["task_id"] for e in step] == [t for t in stream.take(start, 2) for _ in range(2)]
  with open(workdir / "eval" / "step_2" / "eval_test.json") as f:
    report = json.load(f)
  assert report["settings"]["num_tasks"] == 2  # the first test task of each environment


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_multienv_runlocal_bc_then_rl(tmp_path):
  """The config as written, SmolLM2 included: BC's runlocal, then RL's from it."""
  _train(tmp_path / "bc", "stage=bc,runlocal", timeout=1200)
  _train(tmp_path / "rl", f"stage=rl,init={tmp_path / 'bc'},runlocal", timeout=1200)
  line = _lines(tmp_path / "rl" / "metrics.jsonl")[-1]
  for label in ("babyai", "textcraft"):
    assert f"episodes/{label}/success_rate" in line and f"eval/{label}/success_rate" in line
