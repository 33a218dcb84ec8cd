"""The records archive (agentgym_jax/archive.py): a real run's copy keeps what report and viewer
read and none of its checkpoints; a BC -> RL pair reports the same from its copies after the
originals are gone; bad paths fail in one line."""

import json
import os
import shutil

import pytest
from test_report import _write_eval
from test_user_view import run_cli

from agentgym_jax import archive, report


def test_a_real_run_keeps_its_records_and_leaves_its_checkpoints(tmp_path):
  run = tmp_path / "runs" / "seed=0"
  result = run_cli("agentgym_jax.train", "--config=experiments/keypad/learn.py:runlocal",
                   f"--workdir={run}", "--config.checkpoint.export_hf=False",
                   "--config.eval.num_tasks=4")
  assert result.returncode == 0, result.stdout[-3000:]
  assert os.listdir(run / "checkpoints")
  into = tmp_path / "kept"
  result = run_cli("agentgym_jax.archive", str(tmp_path / "runs"), f"--into={into}")
  assert result.returncode == 0, result.stdout[-3000:]
  copy = into / "seed=0"
  kept = sorted(os.path.relpath(os.path.join(d, f), copy)
                for d, _, files in os.walk(copy) for f in files)
  assert kept == ["archived.json", "config.json", "eval/step_0/eval_test.json",
                  "eval/step_2/eval_test.json", "metrics.jsonl", "run_info.json"]
  for name in ("config.json", "metrics.jsonl", "eval/step_2/eval_test.json"):
    assert (copy / name).read_bytes() == (run / name).read_bytes()
  assert json.loads((copy / "archived.json").read_text()) == {"source": str(run),
                                                              "init_from": None}
  shutil.rmtree(run)
  [group] = report.build([str(into)], resamples=100)["groups"]
  assert group["runs"][0]["after_step"] == 2
  result = run_cli("agentgym_jax.viewer", str(copy), f"--out={tmp_path / 'site'}")
  assert result.returncode == 0, result.stdout[-3000:]
  assert "<svg" in (tmp_path / "site" / "index.html").read_text()


def test_a_run_from_an_archived_checkpoint_still_finds_its_before(tmp_path):
  bc, sweep = tmp_path / "bc", tmp_path / "sweep"
  rl = sweep / "algo=gigpo,seed=1"
  _write_eval(bc, 8, [(1, "GoToRedBall", True), (2, "PickupLoc", False)])
  _write_eval(rl, 24, [(1, "GoToRedBall", True), (2, "PickupLoc", True)])
  for run, config in ((bc, {"seed": 0, "init_from": ""}),
                      (rl, {"seed": 1, "init_from": str(bc)})):
    (run / "config.json").write_text(json.dumps(config))
    (run / "metrics.jsonl").write_text("")
  (rl / "checkpoints" / "24").mkdir(parents=True)
  before = report.build([str(rl)], resamples=200)["groups"][0]["pooled"]
  into = tmp_path / "kept"
  copies = archive.archive([str(bc), str(rl)], str(into))  # the layout below tmp_path
  copy = into / "sweep" / "algo=gigpo,seed=1"
  assert copies == [str(into / "bc"), str(copy)]  # tmp_path is absolute
  assert not (copy / "checkpoints").exists()
  assert json.loads((copy / "config.json").read_text())["init_from"] == "../../bc"
  assert json.loads((copy / "archived.json").read_text()) == {"source": str(rl),
                                                             "init_from": str(bc)}
  shutil.rmtree(bc)
  shutil.rmtree(sweep)
  data = report.build([str(into / "sweep")], resamples=200)
  [run] = data["groups"][0]["runs"]
  assert (os.path.basename(run["before_from"]), run["before_step"]) == ("bc", 8)
  assert data["groups"][0]["pooled"] == before
  # Copies archive again with their BC run, and an archive replaces an older copy.
  (tmp_path / "again" / "bc").mkdir(parents=True)
  (tmp_path / "again" / "bc" / "stale.json").write_text("{}")
  archive.archive([str(into / "bc"), str(into / "sweep")], str(tmp_path / "again"))
  assert not (tmp_path / "again" / "bc" / "stale.json").exists()
  again = report.build([str(tmp_path / "again" / "sweep")], resamples=200)
  assert again["groups"][0]["pooled"] == before
  assert json.loads((tmp_path / "again" / "sweep" / "algo=gigpo,seed=1" / "archived.json")
                    .read_text()) == {"source": str(rl), "init_from": str(bc)}
  with pytest.raises(archive.ArchiveError, match="already in"):
    archive.archive([str(into / "bc")], str(into))


def test_bad_paths_fail_in_one_line(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(archive.ArchiveError) as error:
    archive.archive([str(tmp_path / "empty")], str(tmp_path / "kept"))
  assert "holds no run" in str(error.value) and "\n" not in str(error.value)
  result = run_cli("agentgym_jax.archive", str(tmp_path / "empty"), f"--into={tmp_path / 'kept'}")
  assert result.returncode == 1 and result.stdout.strip().startswith("FATAL: ")
  assert "holds no run" in result.stdout and not (tmp_path / "kept").exists()


def test_the_smollm2_studys_kept_records_still_report():
  """The records committed in experiments/smollm2/runs read as runs: every RL run starts from
  the kept BC run, whose greedy evaluation on all 90 test tasks is 48 of 90."""
  root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "experiments", "smollm2", "runs")
  data = report.build([os.path.join(root, "algos")], eval_dir="eval_all", resamples=200)
  runs = [run for group in data["groups"] for run in group["runs"]]
  assert runs
  for run in runs:
    assert os.path.basename(run["before_from"]) == "bc" and run["evaluated"] == [90, 90]
    assert run["levels"]["Overall"]["before"] == pytest.approx(48 / 90)
