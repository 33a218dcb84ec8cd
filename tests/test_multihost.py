"""Two JAX processes on localhost train, resume, lose a peer and evaluate as one job (CPU).

Each process sees 2 fake CPU devices, so the runlocal mesh {'data': 4} spans both: every
process rolls out its half of each batch on its own devices, the update is one SPMD program
over all four. The module's fixture runs, in order (2-4 minutes on 2 cores, with load):

  1. one process with 4 devices, 2 steps: the reference;
  2. two processes, 2 steps, a checkpoint each step;
  3. two processes asked for 3 steps; process 1 is killed once it has restored checkpoint 2;
  4. the same command again: it resumes from checkpoint 2 and runs step 3;
  5. two processes evaluate the checkpoint on every test task, on an FSDP mesh {'fsdp': 4}
     whose parameters each process gathers into its own copy for the rollout.

A separate launch checks each process's rows and copy of the parameters on meshes whose
devices alternate between the processes, as a TPU slice's physical device order does, and a
second thread's gathers through the coordination service's key-value store.

Slow (1.5-2 minutes each on 2 busy cores): asynchronous rollout over both processes
(train/asynchronous.py), each rolling out on one of its two devices and training on the other:
staleness 1 for 2 steps, then resumed for a third; staleness 0 resumed from step 1's checkpoint
equals the uninterrupted run bit for bit.

The runs share a persistent compilation cache and skip most XLA optimisations: compiling
dominates runs this small, and both settings apply to the reference as well.
"""

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from agentgym_jax.evaluate import eval_metrics

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = "experiments/keypad/learn.py:runlocal"
# The runlocal config, minus what only costs time here (in-loop evaluation, the HF export),
# plus an entropy bonus: its gradient is never zero, so the parameters move at every step
# even when no episode succeeds, and comparing them across runs is never vacuous. The checks
# read the trainer's INFO log (restored checkpoints, fingerprints), so it stays on the console.
TRAIN_FLAGS = ["--config.log.progress_bar=False", "--config.eval.every_steps=0",
               "--config.checkpoint.export_hf=False", "--config.algo.entropy_coef=0.01",
               "--alsologtostderr"]
# Seconds without heartbeats before the job stops (multihost.HEARTBEAT_TIMEOUT_ENV).
HEARTBEAT_S = 10
# The stated bound for a lost process to stop the others, with room for a busy machine.
LOST_PROCESS_DEADLINE_S = HEARTBEAT_S + 30
RUN_TIMEOUT_S = 300
_CLUSTER_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                 "MEGASCALE_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES", "SLURM_NTASKS",
                 "OMPI_COMM_WORLD_SIZE")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class Job:
  """The processes of one launch and their logs (stdout and stderr together)."""

  procs: list[subprocess.Popen]
  logs: list[pathlib.Path]

  def wait(self, timeout: float = RUN_TIMEOUT_S) -> list[int]:
    """The exit codes; fails with every process's log tail if one runs past `timeout`."""
    deadline = time.monotonic() + timeout
    try:
      return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in self.procs]
    except subprocess.TimeoutExpired:
      pytest.fail(f"still running after {timeout:.0f} s:\n" + "\n".join(
          f"process {i}:\n{self.log(i)[-3000:]}" for i in range(len(self.procs))))
    finally:
      for p in self.procs:
        if p.poll() is None:
          p.kill()
          p.wait()

  def log(self, process: int) -> str:
    return self.logs[process].read_text()

  def check(self, timeout: float = RUN_TIMEOUT_S) -> None:
    codes = self.wait(timeout)
    failed = [i for i, code in enumerate(codes) if code != 0]
    assert not failed, "\n".join(
        f"process {i} exited {codes[i]}:\n{self.log(i)[-3000:]}" for i in failed)


def _launch(args: list[str], logdir: pathlib.Path, cache: pathlib.Path, processes: int) -> Job:
  """Starts `python args` as `processes` JAX processes (one: 4 devices, no cluster)."""
  logdir.mkdir(parents=True, exist_ok=True)
  port = _free_port()
  procs, logs = [], []
  for i in range(processes):
    env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARS}
    env.update(
        JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={4 // processes}",
        JAX_DISABLE_MOST_OPTIMIZATIONS="1", JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        AGENTGYM_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_S))
    if processes > 1:
      env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                 JAX_PROCESS_ID=str(i))
    logs.append(logdir / f"process{i}.log")
    with open(logs[-1], "w") as out:
      procs.append(subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env,
                                    stdout=out, stderr=subprocess.STDOUT))
  return Job(procs, logs)


def _train(workdir, logdir, cache, processes, steps):
  return _launch(["-m", "agentgym_jax.train", f"--config={CONFIG}", f"--workdir={workdir}",
                  f"--config.total_steps={steps}", *TRAIN_FLAGS], logdir, cache, processes)


def _metrics(workdir) -> list[dict]:
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line) for line in f]


def _policy_at(workdir, step) -> dict:
  """The checkpointed policy of `workdir` at `step`, as host arrays by parameter path."""
  import jax  # pylint: disable=import-outside-toplevel
  from agentgym_jax import policies, settings, sharding  # pylint: disable=import-outside-toplevel
  path, arg = CONFIG.split(":")
  spec = importlib.util.spec_from_file_location("multihost_config", ROOT / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg)
  _, params, _, _ = policies.load_policy(settings.policy(config), settings.env(config),
                                         str(workdir), mesh=sharding.make_mesh(config.mesh),
                                         step=step)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {jax.tree_util.keystr(path): np.asarray(x) for path, x in flat}


def _fingerprints(log: str) -> dict[int, str]:
  return {int(step): fp for step, fp in re.findall(
      r"Step (\d+): parameters agree on all 2 processes \(fingerprint ([0-9a-f]+)\)", log)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Runs the five launches of the module docstring; returns what the tests check."""
  tmp = tmp_path_factory.mktemp("multihost")
  cache = tmp / "xla_cache"
  out = {"tmp": tmp, "ref": tmp / "ref", "two": tmp / "two"}

  reference = _train(out["ref"], tmp / "logs_ref", cache, processes=1, steps=2)
  reference.check()
  two = _train(out["two"], tmp / "logs_two", cache, processes=2, steps=2)
  two.check()
  out["two_logs"] = [two.log(0), two.log(1)]
  out["metrics_after_2"] = _metrics(out["two"])
  out["params_ref_1"] = _policy_at(out["ref"], 1)
  out["params_ref"] = _policy_at(out["ref"], 2)
  out["params_two"] = _policy_at(out["two"], 2)

  lost = _train(out["two"], tmp / "logs_lost", cache, processes=2, steps=3)
  deadline = time.monotonic() + RUN_TIMEOUT_S
  while "Restored checkpoint 2" not in lost.log(1):
    assert lost.procs[1].poll() is None and time.monotonic() < deadline, (
        f"process 1 did not restore checkpoint 2:\n{lost.log(1)[-3000:]}")
    time.sleep(0.2)
  lost.procs[1].send_signal(signal.SIGKILL)
  killed = time.monotonic()
  out["lost_codes"] = lost.wait(LOST_PROCESS_DEADLINE_S + 5)
  out["lost_seconds"] = time.monotonic() - killed
  out["lost_log"] = lost.log(0)

  resumed = _train(out["two"], tmp / "logs_resumed", cache, processes=2, steps=3)
  resumed.check()
  out["resumed_logs"] = [resumed.log(0), resumed.log(1)]

  evaluation = _launch([
      "-m", "agentgym_jax.evaluate", f"--config={CONFIG}", f"--checkpoint={out['two']}",
      "--split=test", "--num_tasks=0", f"--output={tmp / 'eval'}",
      "--config.env.kwargs.codes=0123456789",
      "--config.mesh=(('data', 1), ('fsdp', 4), ('tensor', 1))"], tmp / "logs_eval", cache,
      processes=2)
  evaluation.check()
  out["eval_stdout"] = [evaluation.log(0), evaluation.log(1)]
  return out


def test_two_processes_train_as_one_process_with_their_devices(runs):
  # The same parameters on both processes after every checkpointed step.
  prints = [_fingerprints(log) for log in runs["two_logs"]]
  assert sorted(prints[0]) == [1, 2] and prints[0] == prints[1]

  # Written once (one line per step, by process 0), over all 8 episodes of both processes.
  metrics = runs["metrics_after_2"]
  assert [m["step"] for m in metrics] == [1, 2]
  assert all(m["episodes/count"] == 8 for m in metrics)
  reference = _metrics(runs["ref"])
  for mine, ref in zip(metrics, reference):
    for name in ("episodes/success_rate", "episodes/reward_mean", "episodes/length_mean",
                 "episodes/turns_mean", "batch/length"):
      assert mine[name] == ref[name], name
    assert mine["actor/grad_norm"] > 0

  # Step 2's parameters equal one process's with 4 devices, to float rounding. The samples
  # are the same (keys by global episode index) and so is the SPMD update, but the gradient's
  # all-reduce runs over Gloo between processes instead of inside one process, in another
  # summation order: float32 rounding, which Adam's normalisation can enlarge in the few
  # entries whose gradient nearly cancels. So the check is per array, on the norm: the two
  # runs' difference must be under 0.1% of the norm of step 2's own update (measured: <= 1e-5
  # of it, largest entry 2e-6 against lr 5e-3), where one wrong row, group id or key would
  # change the update by a sizeable fraction of itself.
  ref, ref_1, two = runs["params_ref"], runs["params_ref_1"], runs["params_two"]
  assert ref.keys() == two.keys()
  for name in ref:
    update = np.linalg.norm(ref[name] - ref_1[name])
    assert np.linalg.norm(two[name] - ref[name]) <= 1e-3 * update, name


def test_lost_process_stops_the_other_and_a_rerun_resumes(runs):
  assert runs["lost_codes"][0] != 0
  assert runs["lost_seconds"] < LOST_PROCESS_DEADLINE_S
  # JAX's coordination service names the lost process (id 1).
  assert re.search(r"Task 1 heartbeat timeout|stopped sending heartbeats\):\s*1\b",
                   runs["lost_log"]), runs["lost_log"][-3000:]

  for log in runs["resumed_logs"]:
    assert "Restored checkpoint 2" in log
  assert [m["step"] for m in _metrics(runs["two"])] == [1, 2, 3]
  prints = [_fingerprints(log) for log in runs["resumed_logs"]]
  assert sorted(prints[0]) == [3] and prints[0] == prints[1]


def test_evaluation_over_two_processes_reports_every_test_task_once(runs):
  import environments  # pylint: disable=import-outside-toplevel
  test_ids = environments.task_splits("keypad")["test"]
  eval_dir = runs["tmp"] / "eval"
  report = json.loads((eval_dir / "eval_test.json").read_text())
  assert sorted(t["task_id"] for t in report["tasks"]) == sorted(test_ids)
  assert all(len(t["scores"]) == 1 for t in report["tasks"])
  with open(eval_dir / "episodes_test.jsonl") as f:
    assert sorted(json.loads(line)["task_id"] for line in f) == sorted(test_ids)
  # One table, printed by process 0 only, with a column per code digit.
  columns = set(report["metrics"]) - {eval_metrics.OVERALL}
  assert columns == {f"code {d}" for d in "0123456789"}
  assert sum(report["metrics"][c]["num_tasks"] for c in columns) == len(test_ids)
  tables = [log.count(f"# {report['label']}: keypad test") for log in runs["eval_stdout"]]
  assert tables == [1, 0]


# Run by each of two processes: meshes whose devices alternate between the processes, as a
# TPU slice's physical order spreads a host's chips (tests/test_process_share_tpu.py).
_SHUFFLED_MESHES = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.experimental import multihost_utils
from agentgym_jax import multihost, sharding
assert multihost.maybe_initialize_distributed()
a, b = ([d for d in jax.devices() if d.process_index == p] for p in (0, 1))
# fsdp over the four devices in the order 0 1 1 0: each process's devices a sub-grid;
# data x fsdp as [[0, 1], [1, 0]]: no process's devices a sub-grid.
for shape, order in [((1, 4, 1), [a[0], b[0], b[1], a[1]]),
                     ((2, 2, 1), [a[0], b[0], b[1], a[1]])]:
  mesh = Mesh(np.array(order).reshape(shape), sharding.MESH_AXES)
  share = multihost.process_share(mesh)
  whole = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
  specs = {"rows": P("fsdp"), "columns": P(None, "fsdp"), "whole": P()}
  params = {k: sharding.put_global(whole, NamedSharding(mesh, s)) for k, s in specs.items()}
  for spec, x in share.local(params).items():
    assert x.is_fully_addressable and x.sharding.mesh == share.mesh, (shape, spec)
    np.testing.assert_array_equal(np.asarray(x), whole)
  rows = multihost_utils.process_allgather(share.rows(8))
  assert sorted(rows.reshape(-1).tolist()) == list(range(8)), (shape, rows)
  print(shape, dict(share.mesh.shape), "gather" if share.gather else "view", "ok")
"""


# Then: gathers on a second thread through the key-value store, and a gather that a peer
# never answers, cancelled by its stop event.
_CHANNEL_GATHERS = """
import threading, time
me, stop = jax.process_index(), threading.Event()
channel = multihost.KeyValueChannel("test", stop)
out = []
def gather(obj):
  with multihost.gathers_through(channel):
    try:
      out.append(multihost.allgather_objects(obj))
    except multihost.GatherCancelled as exc:
      out.append(str(exc))
for obj in ({"rows": [me]}, "x" * (me + 1)):
  thread = threading.Thread(target=gather, args=(obj,))
  thread.start()
  thread.join()
assert out == [[{"rows": [0]}, {"rows": [1]}], ["x", "xx"]], out
if me == 0:  # process 1 never answers this one
  thread = threading.Thread(target=gather, args=("alone",))
  thread.start()
  time.sleep(1.0)
  stop.set()
  thread.join()
  assert out[-1].startswith("Stopped waiting for agentgym/test.0/2/1"), out
multihost.barrier("done")
print("channel ok")
"""


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
  """The logs of both processes running the two scripts above, one launch."""
  tmp = tmp_path_factory.mktemp("scripts")
  job = _launch(["-c", _SHUFFLED_MESHES + _CHANNEL_GATHERS], tmp / "logs", tmp / "cache",
                processes=2)
  job.check(timeout=120)
  return [job.log(0), job.log(1)]


def test_local_params_and_rows_on_meshes_that_interleave_the_processes(scripts):
  for log in scripts:
    assert log.count("gather ok") + log.count("view ok") == 2, log[-3000:]


def test_a_second_threads_gathers_go_through_the_key_value_store(scripts):
  for log in scripts:
    assert "channel ok" in log, log[-3000:]


def test_each_process_gets_its_own_env_service_url(monkeypatch):
  import jax  # pylint: disable=import-outside-toplevel
  from agentgym_jax import multihost, settings  # pylint: disable=import-outside-toplevel
  from agentgym_jax.train import config as base  # pylint: disable=import-outside-toplevel
  config = base.base_config()
  config.env.name = "remote"
  config.env.urls = ("http://a:1", "http://b:2")
  env = settings.env(base.lock(config))
  urls = []
  for process in range(3):
    monkeypatch.setattr(jax, "process_index", lambda process=process: process)
    urls.append(multihost.process_env(env).kwargs["url"])
  assert urls == ["http://a:1", "http://b:2", "http://a:1"]
  assert "url" not in env.kwargs  # the caller's settings are left as they were
  config = base.base_config()
  config.env.urls = ("http://a:1",)
  with pytest.raises(ValueError, match="env.urls is set but env.name is 'scripted'"):
    multihost.process_env(settings.env(base.lock(config)))


def test_maybe_initialize_distributed_detects_clusters_and_sets_timeouts(monkeypatch):
  import jax  # pylint: disable=import-outside-toplevel
  from agentgym_jax import multihost  # pylint: disable=import-outside-toplevel
  for var in ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS",
              "TPU_WORKER_HOSTNAMES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
              multihost.HEARTBEAT_TIMEOUT_ENV, multihost.DISTRIBUTED_ENV):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")
  assert multihost.maybe_initialize_distributed() is False
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  monkeypatch.setenv("SLURM_NTASKS", "4")
  assert multihost.maybe_initialize_distributed() is True
  # A lost process stops the others within the heartbeat timeout, and a failed one does not
  # wait JAX's default 300 s at shutdown.
  assert calls == [{"heartbeat_timeout_seconds": 100, "shutdown_timeout_seconds": 100}]
  monkeypatch.setenv(multihost.HEARTBEAT_TIMEOUT_ENV, "7")
  calls.clear()
  multihost.maybe_initialize_distributed()
  assert calls == [{"heartbeat_timeout_seconds": 7, "shutdown_timeout_seconds": 7}]
  # launch/tpu.sh's switch: JAX finds the TPU slice's coordinator itself.
  monkeypatch.delenv("SLURM_NTASKS")
  monkeypatch.setenv(multihost.DISTRIBUTED_ENV, "1")
  calls.clear()
  assert multihost.maybe_initialize_distributed() is True
  assert calls == [{"heartbeat_timeout_seconds": 7, "shutdown_timeout_seconds": 7}]
  monkeypatch.setenv(multihost.HEARTBEAT_TIMEOUT_ENV, "soon")
  with pytest.raises(ValueError, match="AGENTGYM_HEARTBEAT_TIMEOUT_S='soon'"):
    multihost.maybe_initialize_distributed()


def test_explicit_coordinator_needs_process_count(monkeypatch):
  from agentgym_jax import multihost  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
    multihost.maybe_initialize_distributed()


# ----- asynchronous rollout over both processes ------------------------------------------------

# Each process rolls out on the last of its 2 devices and trains on the other: both groups span
# the two processes (train/asynchronous.py).
ASYNC_FLAGS = ["--config.rollout.devices=1", "--config.algo.tis_cap=2.0"]
# What an asynchronous run logs beyond a synchronous one (with algo.tis_cap > 0, its correction).
ASYNC_METRICS = {"async/policy_version", "async/staleness", "async/staleness_mean",
                 "time/rollout_wait", "actor/tis_weight", "actor/tis_capped"}


def _train_async(workdir, logdir, cache, steps, staleness):
  return _launch(["-m", "agentgym_jax.train", f"--config={CONFIG}", f"--workdir={workdir}",
                  f"--config.total_steps={steps}", *TRAIN_FLAGS, *ASYNC_FLAGS,
                  f"--config.rollout.max_staleness={staleness}"], logdir, cache, processes=2)


@pytest.mark.slow
def test_two_processes_train_and_resume_with_asynchronous_rollout(runs, tmp_path):
  cache, workdir = tmp_path / "xla_cache", tmp_path / "async"
  first = _train_async(workdir, tmp_path / "logs_first", cache, steps=2, staleness=1)
  first.check()
  metrics = _metrics(workdir)
  assert [m["step"] for m in metrics] == [1, 2]
  # The episodes of both processes' rollout devices, the sync run's metrics and the async ones.
  assert all(m["episodes/count"] == 8 for m in metrics)
  assert set(metrics[1]) == set(runs["metrics_after_2"][1]) | ASYNC_METRICS
  assert [m["async/staleness"] for m in metrics] == [0, 1]
  assert all(m["actor/grad_norm"] > 0 for m in metrics)
  prints = [_fingerprints(first.log(i)) for i in range(2)]
  assert sorted(prints[0]) == [1, 2] and prints[0] == prints[1]

  resumed = _train_async(workdir, tmp_path / "logs_resumed", cache, steps=3, staleness=1)
  resumed.check()
  assert all("Restored checkpoint 2" in resumed.log(i) for i in range(2))
  metrics = _metrics(workdir)
  assert [m["step"] for m in metrics] == [1, 2, 3]
  # The first step after a resume samples with the resumed weights (docs/async.md, Resume).
  assert metrics[2]["async/staleness"] == 0 and metrics[2]["episodes/count"] == 8
  prints = [_fingerprints(resumed.log(i)) for i in range(2)]
  assert sorted(prints[0]) == [3] and prints[0] == prints[1]


def _same_run(a: dict, b: dict) -> list[str]:
  """The metrics of two records that differ, timings and compile counts aside."""
  timing = lambda k: k.startswith(("time/", "compile/")) or "per_s" in k or "seconds" in k
  return [k for k in a if not timing(k) and a[k] != b.get(k)]


@pytest.mark.slow
def test_staleness_0_over_two_processes_resumes_bit_exact(tmp_path):
  cache, whole, resumed = tmp_path / "xla_cache", tmp_path / "whole", tmp_path / "resumed"
  _train_async(whole, tmp_path / "logs_whole", cache, steps=2, staleness=0).check()
  # The same run stopped after step 1: its workdir as it was then.
  shutil.copytree(whole, resumed)
  shutil.rmtree(resumed / "checkpoints" / "2")
  job = _train_async(resumed, tmp_path / "logs_resumed", cache, steps=2, staleness=0)
  job.check()
  assert "Restored checkpoint 1" in job.log(0)
  assert _same_run(_metrics(whole)[1], _metrics(resumed)[1]) == []
  a, b = _policy_at(whole, 2), _policy_at(resumed, 2)
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
