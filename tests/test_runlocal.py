"""Each paper experiment's `runlocal` variant trains, checkpoints, resumes, evaluates (CLI).

Slow (about 1.5-4 minutes per environment on a free 2-core CPU; ScienceWorld starts JVMs):
run with `pytest -m slow tests/test_runlocal.py`.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENVS = ["textcraft", "babyai", "sciworld", "searchqa", "webarena"]


def _env():
  env = dict(os.environ)
  # One CPU device, as on a laptop: runlocal's 4 rows per step are not split over 8 fakes.
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(ROOT))
  return env


def _run(args, timeout=900):
  result = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout, check=False)
  assert result.returncode == 0, f"{args} failed:\n{result.stderr[-4000:]}"
  return result


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture
def extra_flags(request, tmp_path):
  """Overrides per environment; for WebArena, a local env server its remote client talks to."""
  if request.param != "webarena":
    yield []
    return
  port = _free_port()
  script = str(ROOT / "launch" / "env_server.sh")
  logdir = str(tmp_path / "env_logs")
  subprocess.run(["bash", script, "start", "--env", "textcraft", "--port", str(port),
                  "--logdir", logdir], cwd=ROOT, env=_env(), check=True, capture_output=True)
  try:
    deadline = time.time() + 120
    while time.time() < deadline:
      try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        break
      except OSError:
        time.sleep(0.5)
    else:
      pytest.fail(f"env server did not come up: {open(f'{logdir}/textcraft.{port}.log').read()}")
    yield [f"--config.env.kwargs.url=http://127.0.0.1:{port}"]
  finally:
    subprocess.run(["bash", script, "stop", "--env", "textcraft", "--logdir", logdir],
                   cwd=ROOT, env=_env(), check=False, capture_output=True)


def _steps(workdir):
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line)["step"] for line in f]


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("extra_flags", ENVS, indirect=True, ids=ENVS)
def test_runlocal_trains_resumes_and_evaluates(extra_flags, tmp_path, request):
  env = request.node.callspec.id
  config = f"experiments/agentgym_rl/{env}.py:runlocal,schedule=scaling_inter"
  workdir = tmp_path / "run"
  train = ["-m", "agentgym_jax.train", f"--config={config}", f"--workdir={workdir}",
           *extra_flags]

  # Step 1 only, then a second process resumes from its checkpoint and runs step 2: the
  # metrics log holds each step once (a restart from scratch would log step 1 twice).
  _run(train + ["--config.total_steps=1"])
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1"]
  _run(train)
  assert _steps(workdir) == [1, 2]
  assert "2" in os.listdir(workdir / "checkpoints")
  # A finished run re-launched does nothing.
  _run(train)
  assert _steps(workdir) == [1, 2]

  out = tmp_path / "eval"
  result = _run(["-m", "agentgym_jax.evaluate", f"--config={config}", f"--checkpoint={workdir}",
                 "--num_samples=2", "--pass_k=1,2", f"--output={out}", *extra_flags])
  report = json.loads((out / "eval_test.json").read_text())
  overall = report["metrics"]["Overall"]
  assert overall["n"] == 2 and overall["num_tasks"] == 2  # runlocal: eval.num_tasks = 2
  assert 0.0 <= overall["avg"] <= 1.0 and 0.0 <= overall["pass"] <= 1.0
  assert overall["pass@1"] <= overall["pass"]
  assert report["label"] == "run step 2"
  assert all(len(task["scores"]) == 2 for task in report["tasks"])
  assert len((out / "episodes_test.jsonl").read_text().splitlines()) == 4
  assert "| run step 2 (Pass@2) |" in result.stdout
  if env == "webarena":  # the served TextCraft's columns, from its split file's categories
    assert next(iter(report["metrics"])).startswith("Depth ")


def test_evaluate_cli_on_an_hf_checkpoint(tmp_path):
  """The CLI's wiring (flags, defaults from the config, report files) on a tiny HF directory."""
  from flax import nnx
  from agentgym_jax.models import Decoder, ModelConfig, save_hf
  from agentgym_jax.tokenization import ChatTokenizer
  tok = ChatTokenizer.train_bpe(["Craft the goal. Action: get 1 oak log. Thought:"] * 4,
                                vocab_size=300)
  cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                    max_position_embeddings=4096)
  hf_dir = tmp_path / "tiny_hf"
  save_hf(Decoder(cfg, rngs=nnx.Rngs(0)), hf_dir)
  tok.save_pretrained(str(hf_dir))
  out = tmp_path / "eval"
  config = "experiments/agentgym_rl/textcraft.py:runlocal"
  result = _run(["-m", "agentgym_jax.evaluate", f"--config={config}", f"--hf_model={hf_dir}",
                 "--split=test", "--num_tasks=2", "--num_samples=2", "--max_turns=1",
                 "--max_reply_tokens=4", "--temperature=0", "--label=tiny", f"--output={out}",
                 "--config.rollout.max_context=4096"], timeout=600)
  report = json.loads((out / "eval_test.json").read_text())
  assert report["settings"]["max_turns"] == 1 and report["settings"]["temperature"] == 0.0
  assert report["settings"]["max_context"] == 4096  # a --config.* override reached the run
  assert [t["task_id"] for t in report["tasks"]] == [0, 1]  # the first 2 test goals
  assert all(t["category"] == "depth1" for t in report["tasks"])
  assert all(t["num_turns"] == [1, 1] for t in report["tasks"])
  assert list(report["metrics"]) == ["Depth 1", "Overall"]
  assert "| tiny (Pass@2) |" in result.stdout
  both = subprocess.run([sys.executable, "-m", "agentgym_jax.evaluate", f"--config={config}",
                         f"--hf_model={hf_dir}", f"--checkpoint={tmp_path}",
                         f"--output={out}"], cwd=ROOT, env=_env(), capture_output=True,
                        text=True, timeout=300, check=False)
  assert both.returncode != 0 and "at most one of --checkpoint" in both.stderr
