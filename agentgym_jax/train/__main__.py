r"""Command line of the trainer.

  python -m agentgym_jax.train --config=experiments/<study>/<exp>.py[:k=v,...] \
      --workdir=DIR [--config.a.b=v ...]

Re-running with the same --workdir resumes from its newest complete checkpoint. SIGTERM (a
preemption) makes the run save a checkpoint at the next step boundary and exit 0. A `--config.x=v`
override of a field the config does not have, a missing config file, a --workdir that is a
file, an unknown environment or an invalid algorithm (an unknown estimator, an estimator option
it does not take) stops the run with one line before anything is written.

The terminal shows the progress bar, a line per held-out evaluation and the summary line;
absl/orbax INFO logging goes to WORKDIR/train.log (`--alsologtostderr` shows it here too).
XLA's executables are saved in and loaded from `config.compile.cache_dir` (agentgym_jax/caches.py),
so a second run of the same config compiles almost nothing; freed host buffers go back to the
operating system (agentgym_jax/freed_memory.py), so resident memory follows what a step holds.
"""

from __future__ import annotations

import logging
import os

import jax
import ml_collections
from absl import app, flags

from agentgym_jax import cli
from agentgym_jax import freed_memory
from agentgym_jax import multihost
from agentgym_jax import policies
from agentgym_jax import settings

cli.define_config_flag(f"Experiment config file[:arg], e.g. {cli.EXAMPLE_CONFIG}.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, exports.")
flags.mark_flags_as_required(["config", "workdir"])
LOG_FILE = "train.log"


def check_run(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Fails with one line when the run cannot start, before anything is written."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    cli.fatal(f"--workdir={workdir} is a file; pass a directory (a new one, or a run's workdir "
              "to resume it).")
  settings.checked_env(config)
  settings.checked_algorithm(config)


def log_to_workdir(workdir: str) -> str:
  """Sends INFO logging to a file in `workdir` (one per process), not the terminal; returns
  the file's path."""
  index = jax.process_index()
  path = os.path.join(workdir, LOG_FILE if index == 0 else f"train.process{index}.log")
  cli.log_to(path)
  return path


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config, workdir = cli.config_from_flag(), _WORKDIR.value
  check_run(config, workdir)
  freed_memory.return_freed_memory()
  cli.use_compilation_cache(config.compile.cache_dir)
  # A preempted job gets SIGTERM: the trainer then saves at the next step boundary and returns
  # (exit 0). Before the distributed runtime, whose preemption service takes SIGTERM over.
  multihost.watch_sigterm()
  multi_process = multihost.maybe_initialize_distributed()
  os.makedirs(workdir, exist_ok=True)
  log_to_workdir(workdir)
  # Imported once the distributed runtime is up, so nothing at import time can touch a device
  # before it.
  from agentgym_jax.train import loop  # pylint: disable=import-outside-toplevel
  try:
    loop.train(config, workdir)
  except (loop.EnvironmentFailing, policies.InitFromError,
          loop.checkpoints.NoSpaceForCheckpoint) as exc:
    cli.fatal(str(exc))
  except Exception:
    if multi_process:
      # When a peer is lost, the first error here is a collective's ("Connection closed by
      # peer"), which does not say which process is gone; JAX's coordination service does.
      logging.error("Training failed (traceback below). If another process was lost, JAX's "
                    "coordination service names it and stops this one within %d s. Rerun "
                    "every process with the same --workdir to resume from the last checkpoint.",
                    multihost.heartbeat_timeout_s())
    raise


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
