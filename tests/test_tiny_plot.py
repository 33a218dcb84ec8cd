"""experiments/tiny/plot.py turns runs' metrics.jsonl into the study's tables and PNG curves."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(workdir, records):
  os.makedirs(workdir)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)


def test_tables_and_curves_from_metrics(tmp_path):
  root, out = tmp_path / "runs", tmp_path / "out"
  out.mkdir()
  _write(root / "babyai" / "bc", [{"step": 0, "eval/success_rate": 0.0},
                                  {"step": 4, "time/step": 30.0, "eval/success_rate": 0.25}])
  for name, final in (("grpo", 0.75), ("grpo_s1", 0.5)):
    _write(root / "babyai" / name, [
        {"step": 0, "eval/success_rate": 0.25},
        {"step": 1, "time/step": 60.0, "episodes/success_rate": 0.3},
        {"step": 2, "time/step": 60.0, "episodes/success_rate": 0.6, "eval/success_rate": final}])
  for name, sampled in (("grpo", (0.625, 0.5, 0.875)), ("grpo_s1", (0.375, 0.25, 0.625))):
    os.makedirs(root / "babyai" / name / "eval_avg4")
    with open(root / "babyai" / name / "eval_avg4" / "eval_test.json", "w") as f:
      json.dump({"metrics": {"Overall": dict(zip(("pass@1", "avg", "pass"), sampled))}}, f)
  result = subprocess.run([sys.executable, "experiments/tiny/plot.py", f"--root={root}",
                           f"--out={out}"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert "| BC (noisy expert) | 1 | 0.0 | 25.0 | +25.0 | 4 | 0.5 |" in result.stdout
  # Two seeds of GRPO: mean and each seed, the mean gain, wall minutes per run.
  assert "| GRPO | 2 | 25.0 (25.0, 25.0) | 62.5 (75.0, 50.0) | +37.5 | 2 | 2.0 |" in result.stdout
  # Their eval_avg4 reports: mean and each seed.
  assert "| GRPO | 2 | 50.0 (62.5, 37.5) | 37.5 (50.0, 25.0) | 75.0 (87.5, 62.5) |" in (
      result.stdout)
  assert (out / "babyai_curves.png").stat().st_size > 10_000


def test_envs_flag_draws_only_the_named_environments(tmp_path):
  root, out = tmp_path / "runs", tmp_path / "out"
  out.mkdir()
  for env in ("babyai", "textcraft"):
    _write(root / env / "grpo", [{"step": 0, "eval/success_rate": 0.0},
                                 {"step": 1, "time/step": 6.0, "episodes/success_rate": 0.5,
                                  "eval/success_rate": 0.5}])
  result = subprocess.run([sys.executable, "experiments/tiny/plot.py", f"--root={root}",
                           f"--out={out}", "--envs=textcraft"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert "**textcraft**" in result.stdout and "**babyai**" not in result.stdout
  assert sorted(os.listdir(out)) == ["textcraft_curves.png"]
