"""Turn-limit schedules: fixed and ScalingInter-RL phases, phases that end on training evidence
(by hand), resume invariance (pure and through the trainer), validation of the schedule's
fields."""

import json

import numpy as np
import pytest
from test_trainer import CONFIG, metrics, run_cli, training_metrics

from agentgym_jax import settings as settings_lib
from agentgym_jax.rl import schedule
from agentgym_jax.train import config as base


def scaling_fields(horizons, steps_per_phase):
  return {"kind": "scaling_inter", "horizons": horizons, "steps_per_phase": steps_per_phase}


def scaling(horizons, steps_per_phase):
  return schedule.Schedule(**scaling_fields(horizons, steps_per_phase))


def test_fixed():
  config = schedule.Schedule("fixed", [20])
  assert [schedule.max_turns(config, s) for s in (0, 1, 99, 10**6)] == [20] * 4
  assert schedule.phase(config, 12345) == 0


def test_scaling_inter_paper_webarena():
  # AgentGym-RL's WebArena script: [8, 12, 15] every 80 steps. Upstream's 1-based steps 1-80
  # are our 0-based 0-79.
  config = scaling([8, 12, 15], 80)
  got = {s: schedule.max_turns(config, s) for s in (0, 79, 80, 159, 160, 274, 10**6)}
  assert got == {0: 8, 79: 8, 80: 12, 159: 12, 160: 15, 274: 15, 10**6: 15}
  assert [schedule.phase(config, s) for s in (0, 80, 160, 5000)] == [0, 1, 2, 2]


def test_the_config_s_schedule_and_contract_name():
  c = base.base_config()
  c.schedule.kind, c.schedule.horizons = "scaling_inter", (5, 8, 10)
  c.schedule.steps_per_phase = 100
  config = settings_lib.schedule(base.lock(c))
  assert (config.kind, config.horizons, config.steps_per_phase, config.advance) == (
      "scaling_inter", (5, 8, 10), 100, "steps")
  assert schedule.max_turns(config, 150) == 8
  assert schedule.horizon(config, 250) == 10


def run_training(turn_limit, start_step, num_steps):
  """The turn limits a trainer loop uses for steps start_step .. start_step + num_steps - 1."""
  return [turn_limit(step) for step in range(start_step, start_step + num_steps)]


class CounterScheduler:
  """Upstream's pattern: a counter advanced each step, re-seeded on resume. Here the resume
  re-seeds from the 1-based checkpoint step, one ahead: the off-by-one the pure function avoids."""

  def __init__(self, horizons, steps_per_phase, resumed_from=None):
    self.horizons, self.steps_per_phase = horizons, steps_per_phase
    self.count = 0 if resumed_from is None else resumed_from + 1

  def __call__(self, step):
    del step  # the counter, not the step, decides
    h = self.horizons[min(self.count // self.steps_per_phase, len(self.horizons) - 1)]
    self.count += 1
    return h


def test_resume_does_not_shift_the_phase():
  # Phase boundary right after the resume point: 4 steps straight vs 2 + checkpoint + 2.
  config = scaling([5, 8, 10], 2)
  straight = run_training(lambda s: schedule.max_turns(config, s), 0, 4)
  resumed = (run_training(lambda s: schedule.max_turns(config, s), 0, 2)
             + run_training(lambda s: schedule.max_turns(config, s), 2, 2))
  assert straight == resumed == [5, 5, 8, 8]
  # The same harness catches a stateful scheduler that drifts on resume.
  counter_straight = run_training(CounterScheduler([5, 8, 10], 2), 0, 4)
  counter_resumed = (run_training(CounterScheduler([5, 8, 10], 2), 0, 2)
                     + run_training(CounterScheduler([5, 8, 10], 2, resumed_from=2), 2, 2))
  assert counter_straight == straight
  assert counter_resumed != straight


@pytest.mark.parametrize("config,message", [
    ({"kind": "scaling_inter", "horizons": [], "steps_per_phase": 10}, "horizons is empty"),
    ({"kind": "fixed", "horizons": []}, "horizons is empty"),
    (scaling_fields([10, 10, 20], 5), "strictly increasing"),
    (scaling_fields([10, 8], 5), "strictly increasing"),
    (scaling_fields([0, 8], 5), "positive turn counts"),
    ({"kind": "fixed", "horizons": [-3]}, "positive turn counts"),
    (scaling_fields([5, 8.5], 5), "must be integers"),
    (scaling_fields([5, 8], 0), "steps_per_phase must be a positive integer"),
    (scaling_fields([5, 8], 2.5), "steps_per_phase must be a positive integer"),
    ({"kind": "scaling_inter", "horizons": [5, 8]}, "steps_per_phase must be a positive integer"),
    ({"kind": "fixed", "horizons": [10, 20]}, "exactly one horizon"),
    ({"kind": "fixed", "horizons": 20}, "must be a list"),
    ({"kind": "linear", "horizons": [20]}, "schedule.kind must be one of"),
])
def test_invalid_configs(config, message):
  with pytest.raises(ValueError, match=message):
    schedule.Schedule(**config)


@pytest.mark.parametrize("step", [-1, 1.5, None])
def test_invalid_step(step):
  with pytest.raises(ValueError, match="non-negative integer"):
    schedule.max_turns(schedule.Schedule("fixed", [20]), step)


# ----- phases that end on evidence (schedule.advance) ----------------------------------------


def evidence_fields(advance, horizons=(2, 4, 6), steps_per_phase=100, **fields):
  return {"kind": "scaling_inter", "horizons": list(horizons), "steps_per_phase": steps_per_phase,
          "advance": advance, **fields}


def evidence(advance, **fields):
  return schedule.Schedule(**evidence_fields(advance, **fields))


def fold(config, successes, progress=None, start=0):
  """The turn limit of each step and the progress after the last, as the trainer folds them."""
  progress = progress or schedule.Progress()
  limits = []
  for step, success in enumerate(successes, start):
    limits.append(schedule.max_turns(config, step, progress))
    progress = schedule.advance(config, progress, step, {"episodes/success_rate": success})
  return limits, progress


def test_success_rule_by_hand():
  # window 2, threshold 0.5: after step 2 the last two (0.6, 0.5) average 0.55 -> phase 1 from
  # step 3; its first two steps (0.9, 0.1) average 0.5 -> phase 2 from step 5; then it holds.
  config = evidence("success", window=2, success_threshold=0.5)
  limits, progress = fold(config, [0.2, 0.6, 0.5, 0.9, 0.1, 0.0, 0.0])
  assert limits == [2, 2, 2, 4, 4, 6, 6]
  assert progress == schedule.Progress(phase=2, since=5)


def test_plateau_rule_by_hand():
  # window 2, min_gain 0.05: the means of the last two against the two before: step 3
  # 0.51 - 0.2, step 4 0.51 - 0.4 (rising), step 5 0.50 - 0.51 (flat) -> phase 1 from step 6.
  config = evidence("plateau", window=2, min_gain=0.05)
  limits, progress = fold(config, [0.1, 0.3, 0.5, 0.52, 0.5, 0.5, 0.0])
  assert limits == [2, 2, 2, 2, 2, 2, 4]
  assert progress == schedule.Progress(phase=1, since=6, recent=(0.0,))


def test_evidence_rules_end_a_phase_after_steps_per_phase_at_the_latest():
  never = evidence("success", steps_per_phase=3, window=1, success_threshold=1.0)
  limits, _ = fold(never, [0.0] * 10)
  assert limits == [2, 2, 2, 4, 4, 4, 6, 6, 6, 6]


def test_folding_the_steps_rule_gives_the_phase_of_the_step():
  # The trainer folds every schedule; under "steps" the fold must agree with step // Δ, and
  # reads no metric (behaviour cloning has none).
  config = scaling([3, 5, 8, 13], 7)
  progress = schedule.Progress()
  for step in range(60):
    assert schedule.max_turns(config, step, progress) == schedule.max_turns(config, step)
    assert progress.phase == schedule.phase(config, step)
    progress = schedule.advance(config, progress, step, {})


def test_progress_survives_a_checkpoint_exactly():
  """12 steps straight == 5 steps, the progress through the checkpoint's JSON meta, 7 more;
  restarting the fold from nothing instead (a resume that lost it) changes the limits."""
  config = evidence("success", horizons=(2, 4, 6, 8), window=3, success_threshold=0.4)
  successes = list(np.random.default_rng(0).uniform(0.0, 0.8, size=12))
  straight, end = fold(config, successes)
  first, saved = fold(config, successes[:5])
  meta = json.loads(json.dumps({schedule.META_KEY: saved.to_meta()}))
  rest, resumed_end = fold(config, successes[5:], schedule.Progress.from_meta(
      meta[schedule.META_KEY]), start=5)
  assert first + rest == straight and resumed_end == end
  lost, _ = fold(config, successes[5:], schedule.Progress(), start=5)
  assert first + lost != straight
  assert schedule.Progress.from_meta(None) == schedule.Progress()  # a run from before


@pytest.mark.parametrize("config,message", [
    (evidence_fields("sucess"), "schedule.advance must be one of"),
    (evidence_fields("success", window=0), "window must be a positive"),
    (evidence_fields("plateau", window=1.5), "window must be a positive"),
    (evidence_fields("success", success_threshold=1.5), r"in \[0, 1\]"),
])
def test_invalid_evidence_configs(config, message):
  with pytest.raises(ValueError, match=message):
    schedule.Schedule(**config)


def test_evidence_rules_need_their_evidence():
  config = evidence("success")
  assert schedule.max_turns(config, 0) == 2  # the first step has nothing to decide from
  with pytest.raises(ValueError, match="pass the run's Progress"):
    schedule.max_turns(config, 3)
  with pytest.raises(ValueError, match="behaviour cloning"):
    schedule.advance(config, schedule.Progress(), 0, {"actor/nll": 1.0})


# ----- through the trainer --------------------------------------------------------------------

# Keypad runlocal; turn limit 1 until the first step's training success (>= 0: always) ends the
# phase, then 2.
ON_SUCCESS = [f"--config={CONFIG}", "--config.log.progress_bar=False",
              "--config.schedule.kind=scaling_inter", "--config.schedule.horizons=1,2",
              "--config.schedule.advance=success", "--config.schedule.window=1",
              "--config.schedule.success_threshold=0.0", "--config.eval.every_steps=0",
              "--config.checkpoint.export_hf=False"]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("jax_cache"))


def train(workdir, cache, *overrides):
  return run_cli("agentgym_jax.train", [f"--workdir={workdir}", *ON_SUCCESS, *overrides], cache)


@pytest.mark.slow  # two trainer processes (~30 s); the schedule's rules are tested above
def test_the_trainer_keeps_an_evidence_phase_across_a_resume(tmp_path, compile_cache):
  workdir = tmp_path / "run"
  for total in (1, 3):  # one step, then resumed from its checkpoint for two more
    result = train(workdir, compile_cache, f"--config.total_steps={total}")
    assert result.returncode == 0, result.stderr[-3000:]
  lines = metrics(workdir)
  assert [m["schedule/max_turns"] for m in lines] == [1.0, 2.0, 2.0]
  assert [m["schedule/phase"] for m in lines] == [0.0, 1.0, 1.0]
  meta = json.loads((workdir / "checkpoints" / "3" / "meta" / "metadata").read_text())
  assert meta[schedule.META_KEY] == {"phase": 1, "since": 1, "recent": []}


def test_the_trainer_refuses_an_evidence_rule_with_asynchronous_rollout(tmp_path, compile_cache):
  result = train(tmp_path / "run", compile_cache, "--config.rollout.max_staleness=1",
                 "--config.algo.tis_cap=2.0")
  assert result.returncode != 0
  assert "asynchronous rollout samples ahead" in result.stderr


@pytest.mark.slow
def test_an_evidence_run_resumed_equals_it_straight(tmp_path, compile_cache):
  """Every training metric but times of 3 steps straight == 1 step + 2 resumed."""
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  assert train(straight, compile_cache, "--config.total_steps=3").returncode == 0
  for total in (1, 3):
    assert train(resumed, compile_cache, f"--config.total_steps={total}").returncode == 0
  for a, b in zip(metrics(straight), metrics(resumed), strict=True):
    assert training_metrics(a) == training_metrics(b), a["step"]
