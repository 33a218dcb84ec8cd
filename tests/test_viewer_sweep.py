"""The viewer's sweep page: per group of seeds the mean of their curves and the band of their
range, by hand; the page, each run's own site, and the page in headless Chromium."""

import json
import re
import subprocess

import pytest

from agentgym_jax import viewer
from agentgym_jax.viewer import charts
from test_user_view import _chromium


def test_mean_and_band_by_hand_at_the_steps_every_run_logged():
  runs = [[{"step": 1, "m": 0.0}, {"step": 2, "m": 0.5}, {"step": 3, "m": 1.0}],
          [{"step": 1, "m": 1.0}, {"step": 3, "m": 0.5}, {"step": 4, "m": 0.0}],
          [{"step": 1, "m": 0.5}, {"step": 2, "x": 1.0}, {"step": 3, "m": 0.0}]]
  got = charts.mean_and_band(runs, "m")
  assert got.steps == [1, 3]  # step 2 lacks "m" in two runs, step 4 in two
  assert got.values == pytest.approx([0.5, 0.5])
  assert (got.low, got.high) == ([0.0, 0.0], [1.0, 1.0])
  assert charts.mean_and_band(runs, "absent") is None
  assert charts.mean_and_band(runs[:1], "m").low == charts.mean_and_band(runs[:1], "m").values


def _write_run(path, successes, eval_at_end):
  path.mkdir(parents=True)
  lines = [{"step": step + 1, "episodes/success_rate": s} for step, s in enumerate(successes)]
  lines[-1]["eval/success_rate"] = eval_at_end
  (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.fixture
def sweep(tmp_path):
  base = tmp_path / "horizon"
  _write_run(base / "kind=fixed,seed=0", [0.0, 0.2, 0.4], 0.5)
  _write_run(base / "kind=fixed,seed=1", [0.2, 0.4, 0.8], 0.7)
  _write_run(base / "kind=scaling_inter,seed=0", [0.1, 0.1, 0.1], 0.25)
  (base / "notes").mkdir()  # not a run: left out
  return base


def test_a_sweep_directory_gets_a_sweep_page_and_each_run_its_site(sweep, tmp_path):
  out = tmp_path / "site"
  index = viewer.build(str(sweep), str(out))
  assert index == str(out / "index.html")
  text = (out / "index.html").read_text()
  assert text.startswith("<!DOCTYPE html>") and f"Sweep {sweep}" in text
  for run in ("kind=fixed,seed=0", "kind=fixed,seed=1", "kind=scaling_inter,seed=0"):
    assert (out / run / "index.html").exists()  # the run's own site
    assert f'href="{run}/index.html"' in text
  assert not (out / "notes").exists()
  # Training success: one band per group; the fixed group's mean at step 3 is (0.4+0.8)/2.
  chart = re.search(r'<svg class="chart".*?Success rate: episodes/success_rate.*?</svg>', text,
                    re.S).group(0)
  assert chart.count('<polygon class="band"') == 2
  assert 'data-metric="kind=fixed (2)"' in chart and 'data-metric="kind=scaling_inter (1)"' in chart
  fixed = charts.mean_and_band([[{"step": 3, "m": 0.4}], [{"step": 3, "m": 0.8}]], "m")
  assert fixed.values == pytest.approx([0.6])
  assert "<td>kind=fixed</td><td>kind=fixed,seed=1</td><td>3</td><td>0.700</td>" in text


def test_a_single_run_keeps_its_run_page(sweep, tmp_path):
  index = viewer.build(str(sweep / "kind=fixed,seed=0"), str(tmp_path / "one"))
  text = open(index).read()
  assert "<h1>Run " in text and '<polygon class="band"' not in text


def test_the_sweep_page_in_headless_chromium(sweep, tmp_path):
  chromium = _chromium()  # fails instead of skipping under CI
  out = tmp_path / "site"
  viewer.build(str(sweep), str(out))
  result = subprocess.run(
      [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
       f"--user-data-dir={tmp_path / 'chromium'}", "--dump-dom",
       (out / "index.html").as_uri()], capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.count('class="band"') == 4  # 2 groups x (training, held-out) success
  assert result.stdout.count('class="series"') == 4
