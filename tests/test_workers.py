"""EnvPool: parity with in-process stepping, and survival of crashed, hung and raising workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import environments
from environments import workers
from environments.workers import EnvPool, StepOutcome
from toy_envs import CounterEnv, SlowStartCounterEnv


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie still answers kill(0); its /proc status says Z.
  with open(f"/proc/{pid}/stat") as f:
    return f.read().split(")")[-1].split()[0] != "Z"


def _in_process(env, response: str) -> StepOutcome:
  action = env.parse_action(response)
  observation, reward, terminated, truncated, info = env.step(action)
  info["action"] = action
  return StepOutcome(observation, reward, terminated, truncated, info)


@pytest.fixture
def pool():
  with EnvPool(CounterEnv, num_workers=2, timeout_s=20.0) as p:
    yield p


def test_results_equal_in_process_results():
  task_ids = list(range(10))
  script = ["Action: inc", "Thought: hm\nAction: inc", "no action here", "Action: inc",
            "Action: jump", "Action: inc", "Action: inc"]
  local = [CounterEnv() for _ in task_ids]
  expected = []
  for env, task_id in zip(local, task_ids):
    observation, info = env.reset(options={"task_id": task_id})
    expected.append([StepOutcome(observation, 0.0, False, False, info)])
  with EnvPool(CounterEnv, num_workers=3, timeout_s=20.0) as pool:
    got = [[outcome] for outcome in pool.reset(task_ids)]
    for response in script:
      for slot, env in enumerate(local):
        expected[slot].append(_in_process(env, response))
      for slot, outcome in enumerate(pool.step(list(range(len(task_ids))),
                                               [response] * len(task_ids))):
        got[slot].append(outcome)
  assert got == expected
  # Every episode ran to its end and took its reward: the targets are 1..5.
  assert [sum(o.reward for o in row) for row in got] == [1.0] * len(task_ids)
  assert got[0][1].info["action"] == "inc" and got[0][3].info["action"] == ""


def test_threads_overlap_waits_and_keep_results_in_order():
  with EnvPool(CounterEnv, num_workers=1, threads_per_worker=4, timeout_s=20.0) as pool:
    pool.reset([4, 3, 2, 1])
    start = time.monotonic()
    outcomes = pool.step([0, 1, 2, 3], ["Action: sleep 0.5"] * 4)
    # Four half-second waits overlap in four threads instead of adding up to 2 s.
    assert time.monotonic() - start < 1.5
    assert [o.info["task_id"] for o in outcomes] == [4, 3, 2, 1]
    outcomes = pool.step([3, 2, 1, 0], ["Action: inc", "Action: raise", "Action: inc",
                                        "Action: inc"])
    assert [o.terminated for o in outcomes] == [False, True, False, False]
    assert outcomes[1].failed and [o.observation for o in outcomes[::2]] == ["Count 1."] * 2


def test_step_order_follows_the_requested_slots(pool):
  pool.reset([0, 1, 2, 3])
  outcomes = pool.step([3, 0, 2], ["Action: inc"] * 3)
  # Task 3 needs four increments, task 0 one, task 2 three.
  assert [o.terminated for o in outcomes] == [False, True, False]
  assert [o.info["task_id"] for o in outcomes] == [3, 0, 2]


def test_submitted_steps_come_back_as_each_worker_answers(pool):
  pool.reset([4, 4, 4, 4])
  # Slot 0 (worker 0) sleeps; slot 1 (worker 1) answers at once.
  pool.submit([0, 1], ["Action: sleep 1.5", "Action: inc"])
  assert pool.in_flight == 2
  start = time.monotonic()
  first = pool.collect(None)
  assert time.monotonic() - start < 1.0
  assert [(slot, out.observation) for slot, out in first] == [(1, "Count 1.")]
  assert pool.collect(0.0) == []  # nothing more has arrived yet
  # Slot 1 steps again while slot 0 is still busy; a second step of slot 0 is refused.
  pool.submit([1], ["Action: inc"])
  with pytest.raises(ValueError, match="not in flight; got slot 0"):
    pool.submit([0], ["Action: inc"])
  with pytest.raises(RuntimeError, match="collect them first"):
    pool.step([2], ["Action: inc"])
  answered = {}
  while pool.in_flight:
    answered.update(pool.collect(None))
  assert answered[1].observation == "Count 2." and answered[0].observation == "Slept."
  assert time.monotonic() - start >= 1.5
  assert pool.step([2], ["Action: inc"])[0].observation == "Count 1."


def test_a_worker_with_threads_answers_a_later_call_before_a_slow_earlier_one():
  with EnvPool(CounterEnv, num_workers=1, threads_per_worker=2, timeout_s=20.0) as pool:
    pool.reset([4, 4])
    pool.submit([0], ["Action: sleep 1.5"])
    start = time.monotonic()
    pool.submit([1], ["Action: inc"])
    assert [(slot, out.observation) for slot, out in pool.collect(None)] == [(1, "Count 1.")]
    assert time.monotonic() - start < 1.0
    assert [(slot, out.observation) for slot, out in pool.collect(None)] == [(0, "Slept.")]


def test_a_submitted_step_past_its_limit_fails_and_the_worker_is_replaced():
  with EnvPool(CounterEnv, num_workers=2, timeout_s=2.0) as pool:
    pool.reset([4, 4])
    hung = pool.worker_pid(0)
    pool.submit([0, 1], ["Action: sleep 60", "Action: inc"])
    answered = {}
    while pool.in_flight:
      answered.update(pool.collect(None))
    assert answered[0].failed and answered[0].info["failure"] == "step_timeout"
    assert answered[0].info["task_id"] == 4 and answered[0].info["action"] == "sleep 60"
    assert answered[1].observation == "Count 1."
    assert not _alive(hung)


def test_killed_worker_fails_its_episodes_and_is_replaced(pool):
  pool.reset([4, 4, 4, 4])
  victim = pool.worker_pid(0)
  killer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
  killer.start()
  start = time.monotonic()
  outcomes = pool.step([0, 1, 2, 3], ["Action: sleep 30", "Action: inc", "Action: inc",
                                      "Action: inc"])
  killer.join()
  assert time.monotonic() - start < 15
  # Slots 0 and 2 live in worker 0, slots 1 and 3 in worker 1.
  for slot in (0, 2):
    assert outcomes[slot].terminated and outcomes[slot].reward == 0.0
    assert outcomes[slot].info["success"] is False
    assert "died" in outcomes[slot].info["error"] and "SIGKILL" in outcomes[slot].info["error"]
    assert outcomes[slot].info["task_id"] == 4
  assert outcomes[0].info["action"] == "sleep 30"
  for slot in (1, 3):
    assert not outcomes[slot].failed and outcomes[slot].observation == "Count 1."
  assert pool.worker_pid(0) != victim and not _alive(victim)

  # The lost episodes say so; the surviving ones carry on; new resets work everywhere.
  after = pool.step([0, 1], ["Action: inc", "Action: inc"])
  assert after[0].failed and "reset it first" in after[0].info["error"]
  assert after[1].observation == "Count 2."
  assert [o.observation for o in pool.reset([0, 1, 2, 3])] == [
      "Target 1. Count 0.", "Target 2. Count 0.", "Target 3. Count 0.", "Target 4. Count 0."]
  assert pool.step([0], ["Action: inc"])[0].terminated


def test_hung_worker_times_out_with_its_children():
  with EnvPool(CounterEnv, num_workers=2, timeout_s=3.0) as pool:
    pool.reset([4, 4])
    spawned = int(pool.step([0], ["Action: spawn"])[0].observation.split()[1])
    hung = pool.worker_pid(0)
    start = time.monotonic()
    outcomes = pool.step([0, 1], ["Action: sleep 60", "Action: inc"])
    assert 2.9 < time.monotonic() - start < 12
    assert outcomes[0].failed and "timeout_s=3" in outcomes[0].info["error"]
    assert outcomes[0].terminated and outcomes[0].reward == 0.0
    assert outcomes[1].observation == "Count 1." and not outcomes[1].failed
    # The worker went, and so did the process it had started (its process group).
    assert not _alive(hung) and not _alive(spawned)
    assert pool.reset([1])[0].observation == "Target 2. Count 0."
    assert pool.step([0], ["Action: inc"])[0].observation == "Count 1."


def test_first_reset_gets_time_to_build_the_instances():
  # Two instances of 1 s each in one worker: over timeout_s, within the creation allowance.
  with EnvPool(SlowStartCounterEnv, num_workers=1, timeout_s=0.8,
               create_timeout_s=3.0) as pool:
    assert not any(o.failed for o in pool.reset([0, 1]))
    assert not any(o.failed for o in pool.reset([2, 3]))  # instances are reused: fast
  with EnvPool(SlowStartCounterEnv, num_workers=1, timeout_s=0.8,
               create_timeout_s=0.0) as pool:
    assert all("did not answer reset within 0.8 s" in o.info["error"]
               for o in pool.reset([0, 1]))


def test_os_exit_in_step_is_reported_with_exit_code(pool):
  pool.reset([4, 4])
  outcomes = pool.step([0, 1], ["Action: crash", "Action: inc"])
  assert outcomes[0].failed and "exit code 3" in outcomes[0].info["error"]
  assert outcomes[1].observation == "Count 1."


def test_a_replacement_that_cannot_boot_is_replaced_at_the_next_call(pool, monkeypatch):
  pool.reset([4, 4])
  real_wait = workers._Worker.wait_ready
  def fail_once(worker):
    monkeypatch.setattr(workers._Worker, "wait_ready", real_wait)
    worker.kill()
    raise RuntimeError("Env worker 0 did not start")
  monkeypatch.setattr(workers._Worker, "wait_ready", fail_once)
  outcomes = pool.step([0, 1], ["Action: crash", "Action: inc"])
  # The call still returns: the crashed worker's episode failed, with both causes named.
  assert outcomes[0].failed and "its replacement: Env worker 0 did not start" in (
      outcomes[0].info["error"])
  assert outcomes[1].observation == "Count 1."
  # The next call finds the dead replacement, replaces it, and the pool serves again.
  outcome = pool.reset([2], slots=[0])[0]
  assert outcome.failed and "could not send reset" in outcome.info["error"]
  assert pool.reset([2], slots=[0])[0].observation == "Target 3. Count 0."


def test_env_exception_fails_one_episode_and_recreates_the_env(pool):
  pool.reset([4, 4, 4])
  pid = pool.worker_pid(0)
  outcomes = pool.step([0, 1, 2], ["Action: raise", "Action: inc", "Action: inc"])
  assert outcomes[0].failed and outcomes[0].terminated
  assert "RuntimeError: CounterEnv was told to raise." in outcomes[0].info["error"]
  assert outcomes[0].info["action"] == "raise" and outcomes[0].info["task_id"] == 4
  # Slot 2 shares worker 0 and is unaffected; the worker was not replaced.
  assert outcomes[2].observation == "Count 1." and pool.worker_pid(0) == pid
  assert pool.step([0], ["Action: inc"])[0].failed
  assert pool.reset([2], slots=[0])[0].observation == "Target 3. Count 0."
  assert pool.step([0], ["Action: inc"])[0].observation == "Count 1."


def test_unpicklable_info_values_arrive_as_their_repr(pool):
  pool.reset([4, 4])
  outcomes = pool.step([0, 1], ["Action: unpicklable", "Action: inc"])
  assert not outcomes[0].failed and outcomes[0].observation == "Odd info."
  assert outcomes[0].info["callback"].startswith("<function CounterEnv._step.<locals>.<lambda>")
  assert outcomes[1].observation == "Count 1."


def test_failed_reset_and_step_without_reset(pool):
  outcome = pool.reset([-1])[0]
  assert outcome.failed and "reset of task -1 failed: ValueError" in outcome.info["error"]
  assert outcome.info["task_id"] == -1
  outcome = pool.step([5], ["Action: inc"])[0]
  assert outcome.failed and "slot 5 has no running episode" in outcome.info["error"]
  assert outcome.info["action"] == "inc"


def test_bad_calls_raise():
  with pytest.raises(ValueError, match="num_workers"):
    EnvPool(CounterEnv, num_workers=0)
  pool = EnvPool(CounterEnv, num_workers=1)
  with pytest.raises(ValueError, match="2 responses for 1 slots"):
    pool.step([0], ["a", "b"])
  with pytest.raises(ValueError, match="distinct"):
    pool.reset([1, 2], slots=[3, 3])
  pool.close()
  pool.close()
  with pytest.raises(RuntimeError, match="closed"):
    pool.reset([0])


def test_worker_that_cannot_start_fails_the_pool_at_once(monkeypatch):
  monkeypatch.setattr(workers, "_BOOTSTRAP", "import sys; sys.exit(3)")
  with pytest.raises(RuntimeError, match="Env worker 0 exited at startup"):
    EnvPool(CounterEnv, num_workers=2)


def test_close_leaves_no_processes():
  pool = EnvPool(CounterEnv, num_workers=3)
  pool.reset([0, 1, 2])
  spawned = int(pool.step([1], ["Action: spawn"])[0].observation.split()[1])
  pids = [pool.worker_pid(slot) for slot in range(3)]
  assert all(_alive(pid) for pid in pids + [spawned])
  pool.close()
  assert not any(_alive(pid) for pid in pids + [spawned])


def test_interpreter_exit_stops_an_unclosed_pool():
  script = ("import sys; sys.path.insert(0, {tests!r}); from toy_envs import CounterEnv; "
            "from environments.workers import EnvPool; pool = EnvPool(CounterEnv, 2); "
            "pool.reset([0, 1]); spawned = pool.step([0], ['Action: spawn'])[0].observation; "
            "print(pool.worker_pid(0), pool.worker_pid(1), spawned.split()[1])")
  tests_dir = os.path.dirname(os.path.abspath(__file__))
  result = subprocess.run([sys.executable, "-c", script.format(tests=tests_dir)],
                          capture_output=True, text=True, timeout=60, check=True)
  pids = [int(pid) for pid in result.stdout.split()]
  assert len(pids) == 3 and not any(_alive(pid) for pid in pids)


def _text(name: str, observation: str) -> str:
  # ScienceWorld lists a room's objects in an order that can differ between two JVMs.
  return "\n".join(sorted(observation.split("\n"))) if name == "sciworld" else observation


@pytest.mark.parametrize("name", ["babyai", "textcraft", "searchqa",
                                  pytest.param("sciworld", marks=pytest.mark.slow)])
def test_real_env_pool_equals_in_process(name):
  task_ids = environments.task_splits(name)["test"][:3]
  local = [environments.make(name) for _ in task_ids]
  try:
    with EnvPool(name, num_workers=2, timeout_s=120.0) as pool:
      first = pool.reset(task_ids)
      for env, task_id, outcome in zip(local, task_ids, first):
        observation, info = env.reset(options={"task_id": task_id})
        assert (_text(name, outcome.observation), outcome.info) == (_text(name, observation),
                                                                   info)
      for _ in range(4):
        responses = [env.format_action(env.expert_action()) for env in local]
        responses[-1] = "Thought: nothing.\nAction: an invalid action !!"
        expected = [_in_process(env, r) for env, r in zip(local, responses)]
        got = pool.step(list(range(len(task_ids))), responses)
        for outcome in got + expected:
          outcome.observation = _text(name, outcome.observation)
        assert got == expected
  finally:
    for env in local:
      env.close()
