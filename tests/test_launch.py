"""Sweep helpers, sweep expansion into command lines, and the launch scripts (no real gcloud)."""

import importlib.util
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import time

from absl import flags
import pytest

from agentgym_jax import cli
from agentgym_jax import sweeps

ROOT = pathlib.Path(__file__).resolve().parent.parent
BABYAI = "experiments/agentgym_rl/babyai.py"


def _load_sweep_script():
  spec = importlib.util.spec_from_file_location("launch_sweep", ROOT / "launch" / "sweep.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


sweep_script = _load_sweep_script()


# ----- sweep helpers ---------------------------------------------------------------------------


def test_product_zipit_fixed_golden():
  algos = sweeps.sweep("algo.estimator", ["grpo", "rloo"])
  seeds = sweeps.sweep("seed", [0, 1])
  assert sweeps.product(algos, seeds) == [
      {"algo.estimator": "grpo", "seed": 0}, {"algo.estimator": "grpo", "seed": 1},
      {"algo.estimator": "rloo", "seed": 0}, {"algo.estimator": "rloo", "seed": 1}]
  lrs = sweeps.sweep("optim.lr", [1e-6, 5e-7])
  assert sweeps.zipit(algos, lrs) == [
      {"algo.estimator": "grpo", "optim.lr": 1e-6}, {"algo.estimator": "rloo", "optim.lr": 5e-7}]
  # A fixed key joins every point; product of a zip nests.
  assert sweeps.product(sweeps.zipit(algos, lrs), sweeps.fixed("seed", 3))[1] == {
      "algo.estimator": "rloo", "optim.lr": 5e-7, "seed": 3}


def test_sweep_helper_errors():
  with pytest.raises(ValueError, match="equal length"):
    sweeps.zipit(sweeps.sweep("a", [1, 2]), sweeps.sweep("b", [1]))
  with pytest.raises(ValueError, match=r"\['a'\] set twice"):
    sweeps.product(sweeps.sweep("a", [1]), sweeps.sweep("a", [2]))


def test_format_value_and_flags_golden():
  assert sweeps.format_value((5, 8, 10)) == "5,8,10"
  assert sweeps.format_value((20,)) == "20,"
  assert sweeps.format_value(True) == "true"
  assert sweeps.format_value(1e-6) == "1e-06"
  assert sweeps.override_flags({"schedule.horizons": (6, 13), "optim.lr": 5e-7}) == [
      "--config.schedule.horizons=6,13", "--config.optim.lr=5e-07"]
  assert sweeps.point_name({"schedule.horizons": (5, 8, 10), "arg.algo": "ppo"}) == (
      "horizons=5-8-10,algo=ppo")
  assert sweeps.point_name({"env.kwargs.url": "http://h:1/x"}) == "url=http___h_1_x"
  assert sweeps.point_name({}) == "default"


def test_merge_config_arg_keeps_order_and_bare_flags():
  assert sweeps.merge_config_arg("schedule=scaling_inter,runlocal", {"algo": "ppo"}) == (
      "schedule=scaling_inter,runlocal,algo=ppo")
  assert sweeps.merge_config_arg("algo=grpo,model=7b", {"algo": "rloo"}) == "algo=rloo,model=7b"
  assert sweeps.merge_config_arg(None, {}) == ""


def _parse_with_config_flags(argv):
  """Parses argv exactly as the trainer's --config flag does (cli.define_config_flag)."""
  flag_values = flags.FlagValues()
  cli.define_config_flag("config", flag_values=flag_values, sys_argv=["prog", *argv])
  flag_values(["prog", *argv])
  return flag_values.config


def test_built_flags_parse_back_into_the_config():
  # Every value type our sweeps emit survives the trip through ml_collections' flag parsers.
  point = {"arg.algo": "rloo", "schedule.kind": "scaling_inter", "schedule.horizons": (5, 9),
           "optim.lr": 5e-7, "data.group_size": 4, "model.remat": False,
           "env.kwargs.reward_mode": "paper"}
  argv = sweep_script.command_for(f"{BABYAI}:schedule=fixed", point, "/tmp/w")[3:]
  assert argv[:2] == [f"--config={BABYAI}:schedule=fixed,algo=rloo",
                      "--workdir=/tmp/w/algo=rloo,kind=scaling_inter,horizons=5-9,lr=5e-07,"
                      "group_size=4,remat=false,reward_mode=paper"]
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    config = _parse_with_config_flags([argv[0], *argv[2:]])
  finally:
    os.chdir(cwd)
  assert config.algo.estimator == "rloo"
  assert config.schedule.kind == "scaling_inter"
  assert config.schedule.horizons == (5, 9)
  assert config.optim.lr == 5e-7
  assert config.data.group_size == 4
  assert config.model.remat is False
  assert config.env.kwargs.reward_mode == "paper"
  with pytest.raises((AttributeError, KeyError), match="lr_typo"):
    os.chdir(ROOT)
    try:
      _parse_with_config_flags([argv[0], "--config.optim.lr_typo=1.0"])
    finally:
      os.chdir(cwd)


# ----- launch/sweep.py -------------------------------------------------------------------------


def test_command_for_local_and_tpu_golden():
  point = {"schedule.horizons": (6,), "schedule.kind": "fixed"}
  local = sweep_script.command_for(f"{BABYAI}:schedule=scaling_inter", point, "gs://b/runs/",
                                   extra=("--config.seed=1",))
  assert local == ["python", "-m", "agentgym_jax.train",
                   f"--config={BABYAI}:schedule=scaling_inter",
                   "--workdir=gs://b/runs/horizons=6,kind=fixed",
                   "--config.schedule.horizons=6,", "--config.schedule.kind=fixed",
                   "--config.seed=1"]
  tpu = sweep_script.command_for(BABYAI, {"arg.model": "3b"}, "gs://b/r", launcher="tpu")
  assert tpu == ["launch/tpu.sh", "run", "--session", "model_3b", "--",
                 f"--config={BABYAI}:model=3b", "--workdir=gs://b/r/model=3b"]
  with pytest.raises(ValueError, match="Unknown launcher"):
    sweep_script.command_for(BABYAI, {}, "w", launcher="slurm")


def test_sweep_main_prints_one_line_per_point(capsys, monkeypatch):
  monkeypatch.chdir(ROOT)
  assert sweep_script.main([f"--config={BABYAI}:schedule=scaling_inter", "--sweep=horizon",
                            "--workdir=/tmp/sweep", "--", "--config.seed=2"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 3
  assert shlex.split(lines[2])[4:] == [
      "--workdir=/tmp/sweep/kind=scaling_inter,horizons=6-13-20",
      "--config.schedule.kind=scaling_inter", "--config.schedule.horizons=6,13,20",
      "--config.seed=2"]
  with pytest.raises(SystemExit):
    sweep_script.main([f"--config={BABYAI}", "--sweep=horizon", "--workdir=w",
                       "--launcher=tpu", "--run"])
  with pytest.raises(ValueError, match="Unknown sweep"):
    sweep_script.main([f"--config={BABYAI}", "--sweep=nope", "--workdir=w"])


def test_sweep_docstring_example_runs_and_names_its_points(capsys, monkeypatch):
  """The usage line at the top of launch/sweep.py expands (its --sweep names a real sweep),
  and the point name the docstring quotes is one of the workdirs it prints."""
  monkeypatch.chdir(ROOT)
  doc = sweep_script.__doc__
  usage = re.sub(r"\[[^\]]*\]", "", doc.split("\n\n")[1].replace("\\\n", " "))
  argv = shlex.split(usage)
  assert argv[:2] == ["python", "launch/sweep.py"], usage
  assert sweep_script.main(argv[2:]) == 0
  name = re.search(r"NAME names the point \(`([^`]+)`\)", doc).group(1)
  workdirs = [arg for line in capsys.readouterr().out.splitlines()
              for arg in shlex.split(line) if arg.startswith("--workdir=")]
  assert len(workdirs) == 3 and any(w.endswith(f"/{name}") for w in workdirs), workdirs


def test_sweep_run_executes_local_lines_and_stops_on_failure(tmp_path, monkeypatch):
  # --module points at a tiny module that records its argv and fails on the second point.
  (tmp_path / "fake_train.py").write_text(
      "import sys, pathlib\n"
      f"log = pathlib.Path({str(tmp_path / 'calls')!r})\n"
      "with log.open('a') as f: f.write(' '.join(sys.argv[1:]) + '\\n')\n"
      "sys.exit(3 if 'horizons=20' in ' '.join(sys.argv) else 0)\n")
  monkeypatch.setenv("PYTHONPATH", str(tmp_path))
  rc = sweep_script.main([f"--config={BABYAI}:schedule=scaling_inter", "--sweep=horizon",
                          "--workdir=/tmp/s", "--module=fake_train", "--run"])
  assert rc == 3
  calls = (tmp_path / "calls").read_text().splitlines()
  assert len(calls) == 2 and "--config.schedule.horizons=20," in calls[1]


# ----- launch/tpu.sh with a fake gcloud ----------------------------------------------------------


@pytest.fixture
def fake_gcloud(tmp_path):
  """A gcloud stand-in that appends its argv (one arg per line, blank line between calls)."""
  log = tmp_path / "gcloud.log"
  script = tmp_path / "gcloud"
  script.write_text(f"#!/usr/bin/env bash\nprintf '%s\\n' \"$@\" >> {log}\necho >> {log}\n")
  script.chmod(0o755)
  env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "GCLOUD": str(script),
         "TPU_NAME": "slice-a", "TPU_ZONE": "zone-b"}
  return env, log


def _calls(log):
  return [block.splitlines() for block in log.read_text().split("\n\n") if block.strip()]


def _tpu(args, env):
  return subprocess.run(["bash", str(ROOT / "launch" / "tpu.sh"), *args], env=env,
                        capture_output=True, text=True, check=False)


def test_tpu_run_command_round_trips_through_two_shells(fake_gcloud, tmp_path):
  env, log = fake_gcloud
  args = ["--config=experiments/agentgym_rl/babyai.py:schedule=scaling_inter,model=7b",
          "--workdir=gs://b/run with space", "--config.env.system_prompt=You're $HOME"]
  result = _tpu(["run", "--session", "si", "--dir", "repo", "--", *args], env)
  assert result.returncode == 0, result.stderr
  (call,) = _calls(log)
  assert call[:8] == ["compute", "tpus", "tpu-vm", "ssh", "slice-a", "--zone=zone-b",
                      "--worker=all", call[7]]
  remote = call[7].removeprefix("--command=")
  # Play the remote host: the ssh shell runs `remote`; tmux runs its command with sh -c.
  host = tmp_path / "host"
  (host / "repo" / ".venv" / "bin").mkdir(parents=True)
  (host / "repo" / ".venv" / "bin" / "python").write_text(
      "#!/usr/bin/env bash\necho \"[$AGENTGYM_DISTRIBUTED $AGENTGYM_HEARTBEAT_TIMEOUT_S]\"\n"
      "printf '<%s>\\n' \"$@\"\n")
  (host / "repo" / ".venv" / "bin" / "python").chmod(0o755)
  (host / "tmux").write_text("#!/usr/bin/env bash\nsh -c \"${@: -1}\"\n")
  (host / "tmux").chmod(0o755)
  subprocess.run(["bash", "-c", remote], cwd=host, check=True,
                 env={"PATH": f"{host}:{os.environ['PATH']}", "HOME": "/home/tpu"})
  (log_file,) = (host / "repo" / "logs").glob("si.*.log")
  # Every host starts jax.distributed (JAX reads the slice's coordinator from the metadata).
  assert log_file.read_text().splitlines() == [
      "[1 100]", "<-m>", "<agentgym_jax.train>", *[f"<{a}>" for a in args]]


def test_tpu_verbs_build_gcloud_lines(fake_gcloud):
  env, log = fake_gcloud
  assert _tpu(["create", "--type", "v5litepod-16", "--runtime", "v2-alpha-tpuv5-lite",
               "--project", "proj"], {**env, "TPU_SPOT": "1"}).returncode == 0
  assert _tpu(["logs", "--worker", "0", "--session", "si"], env).returncode == 0
  assert _tpu(["stop", "--session", "si"], env).returncode == 0
  assert _tpu(["copy"], env).returncode == 0
  create, logs, stop, scp, unpack = _calls(log)
  assert create == ["compute", "tpus", "tpu-vm", "create", "slice-a", "--zone=zone-b",
                    "--project=proj", "--accelerator-type=v5litepod-16",
                    "--version=v2-alpha-tpuv5-lite", "--spot"]
  assert logs[6:] == ["--worker=0", "--command=cd agentgym_jax && tail -n 50 logs/si.*.log"]
  assert stop[6:] == ["--worker=all", "--command=tmux kill-session -t si 2>/dev/null || true"]
  assert scp[3] == "scp" and scp[5:] == ["slice-a:agentgym_jax.tgz", "--zone=zone-b",
                                         "--worker=all"]
  assert not pathlib.Path(scp[4]).exists()  # the local archive is cleaned up
  assert "tar -xzf agentgym_jax.tgz -C agentgym_jax" in unpack[-1]


def test_tpu_refuses_missing_settings(fake_gcloud):
  env, log = fake_gcloud
  no_name = {k: v for k, v in env.items() if k != "TPU_NAME"}
  result = _tpu(["stop"], no_name)
  assert result.returncode == 2 and "TPU_NAME" in result.stderr
  result = _tpu(["create"], env)
  assert result.returncode == 2 and "TPU_TYPE" in result.stderr
  assert _tpu(["run"], env).returncode == 2
  assert "unknown verb" in _tpu(["explode"], env).stderr
  assert not log.exists()  # nothing reached gcloud


def test_launch_scripts_pass_bash_n_and_shellcheck():
  scripts = sorted(str(p) for p in (ROOT / "launch").glob("*.sh")) + [str(ROOT / ".ci" / "run")]
  for script in scripts:
    result = subprocess.run(["bash", "-n", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
  if shutil.which("shellcheck") is None:
    pytest.skip("shellcheck is not installed (apt-get install shellcheck; .ci/run installs it)")
  result = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stdout


# ----- launch/env_server.sh -----------------------------------------------------------------


def test_env_server_starts_and_stops_its_replicas(tmp_path):
  # The fake interpreter records its argv and then lives until stopped.
  fake = tmp_path / "python"
  fake.write_text(f"#!/usr/bin/env bash\necho \"$@\" >> {tmp_path}/argv\nexec sleep 60\n")
  fake.chmod(0o755)
  env = {"PATH": os.environ["PATH"], "PYTHON": str(fake), "ENV_SERVER_HOST": "h"}
  script = str(ROOT / "launch" / "env_server.sh")
  logdir = str(tmp_path / "logs")

  def run(*args):
    return subprocess.run(["bash", script, *args, "--logdir", logdir], env=env,
                          capture_output=True, text=True, check=False)

  started = run("start", "--env", "babyai", "--replicas", "2", "--port", "40100")
  assert started.returncode == 0, started.stderr
  assert started.stdout.splitlines()[-2:] == ["http://h:40100", "http://h:40101"]
  pid_lines = (tmp_path / "logs" / "babyai.pids").read_text().splitlines()
  pids = [int(line.split()[0]) for line in pid_lines]
  try:
    deadline = time.time() + 10
    while time.time() < deadline and len((tmp_path / "argv").read_text().splitlines()
                                         if (tmp_path / "argv").exists() else []) < 2:
      time.sleep(0.05)
    assert sorted((tmp_path / "argv").read_text().splitlines()) == [
        "-m environments.server --env babyai --port 40100",
        "-m environments.server --env babyai --port 40101"]
    assert run("start", "--env", "babyai").returncode == 2  # refuses to start twice
    assert run("status", "--env", "babyai").stdout.count("running") == 2
    assert run("stop", "--env", "babyai").returncode == 0
    for pid in pids:
      deadline = time.time() + 5
      while time.time() < deadline and _alive(pid):
        time.sleep(0.05)
      assert not _alive(pid)
  finally:
    for pid in pids:
      if _alive(pid):
        os.kill(pid, signal.SIGKILL)
  assert "--replicas must be" in run("start", "--env", "x", "--replicas", "0").stderr


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A killed child of an exited shell may linger as a zombie until reaped by init.
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split()[2] != "Z"
  except FileNotFoundError:
    return False


# ----- launch/local.sh -------------------------------------------------------------------------


def test_local_sh_trains_then_evaluates_the_runlocal_variant(tmp_path):
  fake = tmp_path / "python"
  fake.write_text(f"#!/usr/bin/env bash\necho \"$JAX_PLATFORMS $*\" >> {tmp_path}/argv\n")
  fake.chmod(0o755)
  env = {"PATH": os.environ["PATH"], "PYTHON": str(fake)}
  script = str(ROOT / "launch" / "local.sh")
  result = subprocess.run(["bash", script, BABYAI, "schedule=scaling_inter", "--",
                           "--config.seed=3"], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=False)
  assert result.returncode == 0, result.stderr
  workdir = "/tmp/agentgym_local/babyai_schedule_scaling_inter"
  config = f"--config={BABYAI}:runlocal,schedule=scaling_inter"
  assert (tmp_path / "argv").read_text().splitlines() == [
      f"cpu -m agentgym_jax.train {config} --workdir={workdir} --config.seed=3",
      f"cpu -m agentgym_jax.evaluate {config} --checkpoint={workdir} --split=test "
      f"--num_samples=2 --output={workdir}/eval"]
  missing = subprocess.run(["bash", script, "nope.py"], cwd=ROOT, env=env, capture_output=True,
                           text=True, check=False)
  assert missing.returncode == 2 and "no config file" in missing.stderr


def test_local_sh_preloads_the_named_malloc_or_none(tmp_path):
  fake = tmp_path / "python"
  fake.write_text(f"#!/usr/bin/env bash\necho \"$LD_PRELOAD|$MALLOC_CONF\" >> {tmp_path}/env\n")
  fake.chmod(0o755)
  library = tmp_path / "libjemalloc.so.2"  # not a real library: the loader skips it, bash runs
  library.write_text("")
  script = str(ROOT / "launch" / "local.sh")

  def run(jemalloc):
    (tmp_path / "env").unlink(missing_ok=True)
    env = {"PATH": os.environ["PATH"], "PYTHON": str(fake), "JEMALLOC": jemalloc}
    return subprocess.run(["bash", script, BABYAI], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=False)

  assert run(str(library)).returncode == 0
  assert (tmp_path / "env").read_text().splitlines() == [
      f"{library}|dirty_decay_ms:-1,muzzy_decay_ms:-1"] * 2
  assert run("").returncode == 0
  assert (tmp_path / "env").read_text().splitlines() == ["|"] * 2
  missing = run(str(tmp_path / "nope.so"))
  assert missing.returncode == 2 and "is not a file" in missing.stderr
