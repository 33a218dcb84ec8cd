"""Turn-limit schedules: fixed and ScalingInter-RL phases, resume invariance, config validation."""

import ml_collections
import pytest

from agentgym_jax.rl import schedule


def scaling(horizons, steps_per_phase):
  return {"kind": "scaling_inter", "horizons": horizons, "steps_per_phase": steps_per_phase}


def test_fixed():
  config = {"kind": "fixed", "horizons": [20]}
  assert [schedule.max_turns(config, s) for s in (0, 1, 99, 10**6)] == [20] * 4
  assert schedule.phase(config, 12345) == 0


def test_scaling_inter_paper_webarena():
  # AgentGym-RL's WebArena script: [8, 12, 15] every 80 steps. Upstream's 1-based steps 1-80
  # are our 0-based 0-79.
  config = scaling([8, 12, 15], 80)
  got = {s: schedule.max_turns(config, s) for s in (0, 79, 80, 159, 160, 274, 10**6)}
  assert got == {0: 8, 79: 8, 80: 12, 159: 12, 160: 15, 274: 15, 10**6: 15}
  assert [schedule.phase(config, s) for s in (0, 80, 160, 5000)] == [0, 1, 2, 2]


def test_config_dict_and_contract_name():
  config = ml_collections.ConfigDict({"kind": "scaling_inter", "horizons": [5, 8, 10],
                                      "steps_per_phase": 100})
  config.lock()
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
    (scaling([10, 10, 20], 5), "strictly increasing"),
    (scaling([10, 8], 5), "strictly increasing"),
    (scaling([0, 8], 5), "positive turn counts"),
    ({"kind": "fixed", "horizons": [-3]}, "positive turn counts"),
    (scaling([5, 8.5], 5), "must be integers"),
    (scaling([5, 8], 0), "steps_per_phase must be a positive integer"),
    (scaling([5, 8], 2.5), "steps_per_phase must be a positive integer"),
    ({"kind": "scaling_inter", "horizons": [5, 8]}, "steps_per_phase must be a positive integer"),
    ({"kind": "fixed", "horizons": [10, 20]}, "exactly one horizon"),
    ({"kind": "fixed", "horizons": 20}, "must be a list"),
    ({"kind": "linear", "horizons": [20]}, "schedule.kind must be one of"),
])
def test_invalid_configs(config, message):
  with pytest.raises(ValueError, match=message):
    schedule.max_turns(config, 0)


@pytest.mark.parametrize("step", [-1, 1.5, None])
def test_invalid_step(step):
  with pytest.raises(ValueError, match="non-negative integer"):
    schedule.max_turns({"kind": "fixed", "horizons": [20]}, step)
