"""A static HTML view of a run: training curves, evaluation tables and the episodes; or of a
sweep: its runs' curves, mean and band per group of seeds, and each run's own site.

  python -m agentgym_jax.viewer WORKDIR [--out DIR]

Reads from WORKDIR: metrics.jsonl (curves, held-out evaluations during training),
config.json and run_info.json (the facts at the top), trajectories/step_N.jsonl (episodes
saved during training, `log.trajectories_every`) and, anywhere below WORKDIR, the output of
`python -m agentgym_jax.evaluate`: eval_<split>.json reports and episodes_<split>.jsonl.
Writes into DIR (default WORKDIR/viewer) index.html (the run page), one page per episode
file and the stylesheet and script they share; the pages open from disk, with no server.

A WORKDIR without metrics.jsonl whose sub-directories have one is a sweep's base workdir
(`launch/sweep.py`: one run per point): DIR/index.html is then the sweep page, whose charts
draw per group of runs that differ only by seed (`sweeps.group_name`) their mean at each step
and the band of their range, and DIR/<run>/ holds each run's site.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
from typing import Any

from agentgym_jax import sweeps
from agentgym_jax.train import metrics as metrics_lib
from agentgym_jax.train import trajectories
from agentgym_jax.viewer import charts, pages

VIEWER_DIR = "viewer"
STATIC = os.path.join(os.path.dirname(__file__), "static")


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _read_jsonl(path: str) -> list[dict[str, Any]]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def episode_files(workdir: str, out: str) -> list[tuple[str, str, str]]:
  """(path, page href, label) of every episode file: training steps in step order, then the
  evaluation files below `workdir` (those under `out` excluded)."""
  steps = glob.glob(os.path.join(workdir, trajectories.TRAJECTORY_DIR, "step_*.jsonl"))
  steps.sort(key=lambda p: int(re.search(r"step_(\d+)\.jsonl$", p).group(1)))
  found = [(p, os.path.basename(p).replace(".jsonl", ".html"),
            f"training step {os.path.basename(p)[5:-6]}") for p in steps]
  for path in sorted(glob.glob(os.path.join(workdir, "**", "episodes_*.jsonl"), recursive=True)):
    if os.path.abspath(path).startswith(os.path.abspath(out) + os.sep):
      continue
    rel = os.path.relpath(path, workdir)
    found.append((path, "eval_" + re.sub(r"[^A-Za-z0-9_.-]", "_", rel[:-6]) + ".html",
                  f"evaluation {rel}"))
  return found


def _facts(workdir: str) -> dict[str, Any]:
  config = _read_json(os.path.join(workdir, "config.json"))
  info = _read_json(os.path.join(workdir, "run_info.json"))
  algo = config.get("algo", {})
  facts = {
      "environment": config.get("env", {}).get("name"),
      # Runs before the rename of algo.advantage to algo.estimator name it the old way.
      "mode / estimator": f"{config.get('mode')} / {algo.get('estimator', algo.get('advantage'))}"
                          if config else None,
      "total steps": config.get("total_steps"),
      "git commit": info.get("git_commit"),
      "started": info.get("started"),
      "devices": f"{info.get('devices')} x {info.get('backend')}" if info else None,
  }
  return {k: v for k, v in facts.items() if v is not None}


def build(workdir: str, out: str | None = None) -> str:
  """Writes the site for `workdir` into `out` (default workdir/viewer); returns index.html.

  Raises:
    FileNotFoundError: `workdir` is not a directory.
  """
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"{workdir!r} is not a directory: pass a training workdir or an "
                            "evaluation --output directory.")
  out = out or os.path.join(workdir, VIEWER_DIR)
  runs = sweeps.runs_in(workdir, metrics_lib.METRICS_FILE)
  if runs and runs != [workdir]:
    return _build_sweep(workdir, runs, out)
  os.makedirs(out, exist_ok=True)
  for name in ("viewer.css", "viewer.js"):
    shutil.copy(os.path.join(STATIC, name), os.path.join(out, name))

  files = episode_files(workdir, out)
  siblings = [(href, label) for _, href, label in files]
  listed = []
  for path, href, label in files:
    records = _read_jsonl(path)
    with open(os.path.join(out, href), "w") as f:
      f.write(pages.trajectory_page(f"{os.path.basename(os.path.abspath(workdir))}: {label}",
                                    records, siblings, href))
    success = sum(r["success"] for r in records) / max(len(records), 1)
    listed.append({"href": href, "label": label, "episodes": len(records), "success": success})

  records = (metrics_lib.read_metrics(workdir)
             if os.path.exists(os.path.join(workdir, metrics_lib.METRICS_FILE)) else [])
  reports = []
  for path in sorted(glob.glob(os.path.join(workdir, "**", "eval_*.json"), recursive=True)):
    reports.append({**_read_json(path), "path": os.path.relpath(path, workdir)})
  index = os.path.join(out, "index.html")
  with open(index, "w") as f:
    f.write(pages.run_page(os.path.abspath(workdir), _facts(workdir), charts.curves(records),
                           [r for r in records if "eval/success_rate" in r], reports, listed))
  return index


def _build_sweep(workdir: str, runs: list[str], out: str) -> str:
  """Writes each run's site into out/<run> and the sweep page; returns its index.html."""
  groups: dict[str, list[list[dict[str, Any]]]] = {}
  listed = []
  for run in runs:
    name = os.path.basename(run)
    build(run, os.path.join(out, name))
    records = metrics_lib.read_metrics(run)
    group = sweeps.group_name(name) or os.path.basename(os.path.abspath(workdir))
    groups.setdefault(group, []).append(records)
    evals = [r["eval/success_rate"] for r in records if "eval/success_rate" in r]
    listed.append({"group": group, "name": name, "href": f"{name}/index.html",
                   "steps": max((r["step"] for r in records), default=0),
                   "eval": evals[-1] if evals else ""})
  for name in ("viewer.css", "viewer.js"):
    shutil.copy(os.path.join(STATIC, name), os.path.join(out, name))
  index = os.path.join(out, "index.html")
  with open(index, "w") as f:
    f.write(pages.sweep_page(os.path.abspath(workdir), charts.sweep_curves(groups), listed))
  return index
