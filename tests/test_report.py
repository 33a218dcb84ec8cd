"""The sweep report (agentgym_jax/report.py): its bootstrap intervals against values by hand,
an exact enumeration and scipy; the report of a real run's directory; one-line errors."""

import itertools
import json
import os
import shutil

import numpy as np
import pytest
from test_user_view import run_cli

from agentgym_jax import report


def interval(cells, resamples=10_000, seed=0):
  return report.bootstrap_mean(np.asarray(cells, float), resamples=resamples,
                               rng=np.random.default_rng(seed))


# ----- the intervals: golden values -------------------------------------------------------------


def test_a_constant_change_has_a_point_interval():
  got = interval(np.full((3, 7), 0.25))
  assert (got.mean, got.low, got.high) == pytest.approx((0.25, 0.25, 0.25))


def test_two_tasks_one_gained_spans_zero_to_one():
  # Resampled means of {0, 1}: 0 (p 1/4), 1/2 (p 1/2), 1 (p 1/4); both tails hold > 2.5%.
  got = interval([[0.0, 1.0]])
  assert (got.mean, got.low, got.high) == pytest.approx((0.5, 0.0, 1.0))


def test_one_gain_in_ten_tasks_by_the_binomial():
  # The resampled mean is k/10, k ~ Binomial(10, 0.1): P(k=0) = 0.349 > 2.5%, so low = 0;
  # P(k <= 2) = 0.930 and P(k <= 3) = 0.987 bracket 97.5%, so high = 0.3.
  got = interval([[0.0] * 9 + [1.0]])
  assert (got.mean, got.low, got.high) == pytest.approx((0.1, 0.0, 0.3))


def test_seeds_that_disagree_on_every_task_span_their_range():
  # Each resample draws 2 seeds: both the 0-seed (1/4), one of each (1/2), both the 1-seed.
  got = interval([[0.0] * 5, [1.0] * 5])
  assert (got.mean, got.low, got.high) == pytest.approx((0.5, 0.0, 1.0))


def test_identical_seeds_give_the_one_seed_interval_exactly():
  row = np.random.default_rng(1).normal(0.1, 0.4, size=20)
  pooled, single = interval(np.stack([row] * 4)), interval(row[None])
  assert (pooled.mean, pooled.low, pooled.high) == pytest.approx(
      (single.mean, single.low, single.high), abs=1e-12)  # the same draws, summed otherwise


def test_bad_cells_are_refused():
  for cells in (np.zeros((0, 3)), np.zeros((2, 0)), np.zeros(4)):
    with pytest.raises(ValueError, match=r"\[seeds, tasks\]"):
      interval(cells)


# ----- the intervals: against independent computations --------------------------------------------


def test_crossed_resampling_matches_its_exact_enumeration():
  """3 tasks x 2 seeds: every resample (27 task draws x 4 seed draws) equally likely. The
  sampled means' mean and spread match the enumeration's; resampling each seed's tasks on
  its own instead (the unpaired scheme) would give a smaller spread here."""
  cells = np.array([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
  exact = [cells[np.ix_(seeds, tasks)].mean()
           for tasks in itertools.product(range(3), repeat=3)
           for seeds in itertools.product(range(2), repeat=2)]
  sampled = report.bootstrap_means(cells, resamples=200_000, rng=np.random.default_rng(0))
  assert sampled.mean() == pytest.approx(np.mean(exact), abs=2e-3)
  assert sampled.std() == pytest.approx(np.std(exact), abs=2e-3)
  # Each seed drawing its own tasks would spread the means less: 0.2257 by its enumeration.
  assert np.std(exact) == pytest.approx(0.2805, abs=1e-4) and sampled.std() > 0.27


def test_one_seed_matches_scipy_percentile_bootstrap():
  scipy_stats = pytest.importorskip("scipy.stats")
  changes = np.random.default_rng(3).normal(0.1, 0.5, size=48)
  ours = interval(changes[None], resamples=20_000)
  theirs = scipy_stats.bootstrap((changes,), np.mean, confidence_level=0.95, method="percentile",
                                 n_resamples=20_000, random_state=np.random.default_rng(7))
  # Monte Carlo error of either 2.5% quantile at 20,000 resamples: ~0.0014 here.
  assert ours.low == pytest.approx(theirs.confidence_interval.low, abs=0.01)
  assert ours.high == pytest.approx(theirs.confidence_interval.high, abs=0.01)


# ----- reading runs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
  """A sweep directory holding one real 2-step keypad run (evaluated at steps 0 and 2) as
  seed=0, and a copy of it as seed=1."""
  base = tmp_path_factory.mktemp("sweep")
  result = run_cli("agentgym_jax.train", "--config=experiments/keypad/learn.py:runlocal",
                   f"--workdir={base / 'seed=0'}", "--config.checkpoint.export_hf=False",
                   "--config.eval.num_tasks=6")
  assert result.returncode == 0, result.stdout[-3000:]
  shutil.copytree(base / "seed=0", base / "seed=1")
  return base


def test_the_command_reports_a_real_sweep(sweep, tmp_path):
  result = run_cli("agentgym_jax.report", str(sweep), f"--out={tmp_path}")
  assert result.returncode == 0, result.stdout[-3000:]
  data = json.loads((tmp_path / "report.json").read_text())
  assert (tmp_path / "report.md").read_text() in result.stdout
  [group] = data["groups"]
  assert group["name"] == sweep.name and group["env"] == "keypad"
  assert [run["name"] for run in group["runs"]] == ["seed=0", "seed=1"]
  run = group["runs"][0]
  assert (run["before_step"], run["after_step"], run["evaluated"]) == (0, 2, [6, 6])
  # The numbers are the eval reports' own: success per task, averaged.
  after = json.loads((sweep / "seed=0" / "eval" / "step_2" / "eval_test.json").read_text())
  overall = run["levels"]["Overall"]
  assert overall["tasks"] == 6
  assert overall["after"] == pytest.approx(after["metrics"]["Overall"]["pass"])
  assert overall["change"] == pytest.approx(overall["after"] - overall["before"])
  assert overall["low"] <= overall["change"] <= overall["high"]
  # Two identical seeds: the pooled interval is the run's own.
  assert group["pooled"]["Overall"] == dict(overall, seeds=2)


def test_evaluations_written_by_the_evaluate_command_are_read_with_eval_dir(sweep, tmp_path):
  run = tmp_path / "run"
  shutil.copytree(sweep / "seed=0", run)
  shutil.copytree(run / "eval" / "step_0", run / "eval_all" / "step_0")
  result = run_cli("agentgym_jax.evaluate", "--config=experiments/keypad/learn.py:runlocal",
                   f"--checkpoint={run}", "--num_tasks=8", f"--output={run / 'eval_all' / 'step_2'}")
  assert result.returncode == 0, result.stdout[-3000:]
  result = run_cli("agentgym_jax.report", str(run), "--eval_dir=eval_all", f"--out={tmp_path}")
  assert result.returncode == 0, result.stdout[-3000:]
  [group] = json.loads((tmp_path / "report.json").read_text())["groups"]
  # The trainer's step-0 report has 6 tasks, the command's 8: the 6 of both are compared.
  assert group["runs"][0]["evaluated"] == [6, 8] and group["pooled"]["Overall"]["tasks"] == 6


def test_runs_group_by_name_without_their_seed(tmp_path):
  for name in ("algo=ppo,seed=0", "algo=ppo,seed=1", "algo=grpo,seed=0"):
    (tmp_path / name / "eval").mkdir(parents=True)
  (tmp_path / "notes").mkdir()
  groups = report.find_groups([str(tmp_path)])
  top = tmp_path.name
  assert {k: [os.path.basename(p) for p in v] for k, v in groups.items()} == {
      f"{top}/algo=grpo": ["algo=grpo,seed=0"],
      f"{top}/algo=ppo": ["algo=ppo,seed=0", "algo=ppo,seed=1"]}


def test_runs_given_one_by_one_pool_by_name_without_their_seed(tmp_path):
  runs = [tmp_path / "a" / "algo=ppo,seed=0", tmp_path / "b" / "algo=ppo,seed=1",
          tmp_path / "b" / "algo=grpo,seed=0", tmp_path / "c" / "seed=2"]
  for run in runs:
    (run / "eval").mkdir(parents=True)
  groups = report.find_groups([str(run) for run in runs])
  assert {k: [os.path.relpath(p, tmp_path) for p in v] for k, v in groups.items()} == {
      "algo=ppo": ["a/algo=ppo,seed=0", "b/algo=ppo,seed=1"],
      "algo=grpo": ["b/algo=grpo,seed=0"], "seed=2": ["c/seed=2"]}


# ----- bad input ------------------------------------------------------------------------------


def _write_eval(workdir, step, tasks, env="babyai", eval_dir="eval"):
  path = workdir / eval_dir / f"step_{step}"
  path.mkdir(parents=True)
  (path / "eval_test.json").write_text(json.dumps({"settings": {"env": env}, "tasks": [
      {"task_id": t, "category": c, "success": [s], "failed": [False]} for t, c, s in tasks]}))


def test_synthetic_runs_pair_on_shared_tasks_and_levels(tmp_path):
  run = tmp_path / "run"
  _write_eval(run, 0, [(1, "GoToRedBall", False), (2, "PickupLoc", False),
                       (3, "GoToObj", True)])
  _write_eval(run, 5, [(1, "GoToRedBall", True), (2, "PickupLoc", True),
                       (4, "GoToObj", True)])  # task 3 not evaluated after: left out
  data = report.build([str(run)], resamples=1000)
  pooled = data["groups"][0]["pooled"]
  assert pooled["Overall"] | {} == {"seeds": 1, "tasks": 2, "before": 0.0, "after": 1.0,
                                     "change": 1.0, "low": 1.0, "high": 1.0}
  assert set(pooled) == {"Overall", "GoTo", "Pickup"}
  assert "| GoTo | 1 | 0.0 | 100.0 | +100.0 | [+100.0, +100.0] |" in report.markdown(data)


def test_a_run_from_a_checkpoint_takes_its_before_from_that_runs_last_evaluation(tmp_path):
  # The main job: BC evaluates its end (step 8); RL starts from it without evaluating its
  # start (eval.at_start = False) and evaluates step 24 only.
  bc, rl = tmp_path / "bc", tmp_path / "grpo,seed=3"
  _write_eval(bc, 4, [(1, "GoToRedBall", False), (2, "PickupLoc", False)])
  _write_eval(bc, 8, [(1, "GoToRedBall", True), (2, "PickupLoc", False)])
  _write_eval(rl, 24, [(1, "GoToRedBall", True), (2, "PickupLoc", True)])
  (rl / "config.json").write_text(json.dumps({"seed": 3, "init_from": str(bc)}))
  data = report.build([str(rl)], resamples=1000)
  [run] = data["groups"][0]["runs"]
  assert (run["before_from"], run["before_step"], run["after_step"]) == (str(bc), 8, 24)
  assert run["levels"]["Overall"] | {} == {"seeds": 1, "tasks": 2, "before": 0.5, "after": 1.0,
                                           "change": 0.5, "low": 0.0, "high": 1.0}
  assert "| grpo,seed=3 | 3 | bc's 8 -> 24 | 2 |" in report.markdown(data)
  # Other evaluations of the same checkpoints (python -m agentgym_jax.evaluate --output=
  # RUN/eval_all/step_24, e.g. on all 90 tasks), read with eval_dir.
  _write_eval(bc, 8, [(t, "GoToRedBall", t < 3) for t in range(1, 5)], eval_dir="eval_all")
  _write_eval(rl, 24, [(t, "GoToRedBall", True) for t in range(1, 5)], eval_dir="eval_all")
  data = report.build([str(rl)], resamples=1000, eval_dir="eval_all")
  [run] = data["groups"][0]["runs"]
  assert (run["before_from"], run["before_step"], run["evaluated"]) == (str(bc), 8, [4, 4])
  assert (run["levels"]["Overall"]["before"], run["levels"]["Overall"]["after"]) == (0.5, 1.0)
  assert data["settings"]["eval_dir"] == "eval_all"
  # A run that evaluated its own start keeps it.
  _write_eval(rl, 0, [(1, "GoToRedBall", False), (2, "PickupLoc", False)])
  [run] = report.build([str(rl)], resamples=10)["groups"][0]["runs"]
  assert (run["before_from"], run["before_step"]) == ("", 0)


@pytest.mark.parametrize("make, needle", [
    (lambda d: None, "is not a directory"),
    (lambda d: d.mkdir(), "holds no run"),
    (lambda d: _write_eval(d, 0, [(1, "GoTo", True)]), "1 evaluated step(s)"),
    (lambda d: (_write_eval(d, 0, [(1, "GoTo", True)]),
                (d / "eval" / "step_4").mkdir()), "eval_test.json"),
    (lambda d: (_write_eval(d, 0, [(1, "GoTo", True)]), (d / "eval" / "step_4").mkdir(),
                (d / "eval" / "step_4" / "eval_test.json").write_text("{")),
     "is not an evaluation report"),
])
def test_bad_workdirs_raise_one_line(tmp_path, make, needle):
  workdir = tmp_path / "w"
  make(workdir)
  with pytest.raises(report.ReportError) as error:
    report.build([str(workdir)], resamples=10)
  assert needle in str(error.value) and "\n" not in str(error.value)


def test_the_command_fails_in_one_line_and_writes_nothing(tmp_path):
  workdir = tmp_path / "w"
  _write_eval(workdir, 3, [(1, "GoTo", True)])
  result = run_cli("agentgym_jax.report", str(workdir))
  assert result.returncode == 1
  lines = [line for line in result.stdout.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("FATAL: ") and "1 evaluated step(s)" in lines[0]
  assert not (workdir / "report.md").exists()
