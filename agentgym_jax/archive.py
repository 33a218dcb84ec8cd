r"""Keeps a study's records without its checkpoints: what `report` and the viewer's curves read.

  python -m agentgym_jax.archive RUN_OR_SWEEP... --into DIR

A run's workdir holds gigabytes of checkpoints beside a few hundred kilobytes that say what
it did: its config, provenance, metrics and evaluation reports. A study that spans machines
(or sessions on a machine that is wiped between them) keeps the latter, e.g. committed
beside the study's README, and reports over runs from every session at once:

  python -m agentgym_jax.archive /tmp/smollm2/bc /tmp/smollm2/algos \
      --into experiments/smollm2/runs   # runs/bc, runs/algos/<run>
  python -m agentgym_jax.report experiments/smollm2/runs/algos --eval_dir=eval_all

Each run (a workdir with metrics.jsonl; a sweep's base workdir gives all its runs) is copied
with `KEPT_FILES` and every `eval*/step_<N>/*.json`; checkpoints, TensorBoard events and logs
stay behind. The copies keep their layout below the runs' common parent: a sweep's runs land
in DIR/<run>, and a BC run with a sweep of RL runs from it in DIR/bc and DIR/algos/<run>.
A run's `init_from` (the run it started from: RL from BC) is rewritten to the relative path
of that run's copy when the same command archives it too, so `report` still finds the
evaluation the run started from; the original path stays in the copy's archived.json. A copy
that already exists is replaced (a rerun of the command after a run went on).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
from collections.abc import Sequence

from absl import app, flags

from agentgym_jax import cli, sweeps
from agentgym_jax.train import metrics as metrics_lib

# What train/metrics.py writes of every run; its metrics file also tells a run's workdir from
# other folders.
KEPT_FILES = ("config.json", "run_info.json", metrics_lib.METRICS_FILE)
RECORD = "archived.json"


class ArchiveError(ValueError):
  """A path that names no run; the message is one line saying what to do."""


def evaluation_reports(workdir: str) -> list[str]:
  """The evaluation reports of `workdir`, relative to it: eval*/step_<N>/*.json (the trainer's
  eval/ and the `evaluate` command's outputs placed beside it, e.g. eval_all/)."""
  found = glob.glob(os.path.join(workdir, "eval*", "step_*", "*.json"))
  return sorted(os.path.relpath(path, workdir) for path in found)


def find_runs(paths: Sequence[str]) -> list[str]:
  """The run workdirs `paths` name (each a run or a sweep's base workdir), in order, once each.

  Raises:
    ArchiveError: a path that is neither.
  """
  runs = []
  for path in paths:
    found = sweeps.runs_in(path, metrics_lib.METRICS_FILE)
    if not found:
      raise ArchiveError(f"{path!r} holds no run (no {metrics_lib.METRICS_FILE} in it or its "
                         "sub-directories): "
                         "pass training workdirs or a sweep's base workdir.")
    runs += [os.path.abspath(run) for run in found]
  return list(dict.fromkeys(runs))


def archive(paths: Sequence[str], into: str) -> list[str]:
  """Copies the records of the runs `paths` name into `into`/<run name>/; returns the copies.

  Raises:
    ArchiveError: see `find_runs`.
  """
  runs = find_runs(paths)
  root = os.path.commonpath([os.path.dirname(run) for run in runs])
  copies = {run: os.path.join(os.path.abspath(into), os.path.relpath(run, root)) for run in runs}
  if any(run == copy for run, copy in copies.items()):
    raise ArchiveError(f"The runs are already in {into}; archive them into another directory.")
  for run, copy in copies.items():
    if os.path.isdir(copy):
      shutil.rmtree(copy)
    os.makedirs(copy)
    for name in [*KEPT_FILES, *evaluation_reports(run)]:
      source = os.path.join(run, name)
      if os.path.exists(source):
        os.makedirs(os.path.dirname(os.path.join(copy, name)), exist_ok=True)
        shutil.copy2(source, os.path.join(copy, name))
    record = {"source": run, "init_from": None}
    if os.path.exists(os.path.join(run, RECORD)):  # a copy archived again keeps its origin
      with open(os.path.join(run, RECORD)) as f:
        record = json.load(f)
    config_path = os.path.join(copy, "config.json")
    if os.path.exists(config_path):
      with open(config_path) as f:
        config = json.load(f)
      init = config.get("init_from") or ""
      # A relative init_from is a copy's own (archived before): relative to its run.
      init_copy = copies.get(os.path.normpath(os.path.join(run, init))) if init else None
      if init_copy:
        record["init_from"] = record["init_from"] or init
        config["init_from"] = os.path.relpath(init_copy, copy)
        with open(config_path, "w") as f:
          json.dump(config, f, indent=2)
    with open(os.path.join(copy, RECORD), "w") as f:
      json.dump(record, f, indent=1)
  return list(copies.values())


_INTO = flags.DEFINE_string("into", None, "Directory to copy the runs' records into.")


def main(argv: list[str]) -> None:
  if len(argv) < 2 or not _INTO.value:
    cli.fatal("Usage: python -m agentgym_jax.archive RUN_OR_SWEEP... --into DIR: give "
              "training workdirs or a sweep's base workdir, and where to keep their records.")
  try:
    copies = archive(argv[1:], _INTO.value)
  except ArchiveError as e:
    cli.fatal(str(e))
  for copy in copies:
    print(copy)
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
