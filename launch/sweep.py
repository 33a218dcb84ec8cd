"""Expands an experiment's `get_sweep(arg)` into one command line per point; prints or runs them.

  python launch/sweep.py --config=experiments/agentgym_rl/searchqa.py:schedule=scaling_inter \
      --sweep=horizon --workdir=gs://BUCKET/agentgym/searchqa_horizon [--launcher=tpu] \
      [--run] [-- EXTRA FLAGS]

Each point becomes `python -m agentgym_jax.train --config=FILE:ARG --workdir=WORKDIR/NAME
--config.k=v ...`, where NAME names the point (`kind=scaling_inter,horizons=5-8-10`) and
"arg.k" keys of the point edit the config argument ARG instead of adding a flag. With
--launcher=tpu the lines are `launch/tpu.sh run --session NAME -- ...` (one slice per point:
set TPU_NAME per line).
--run executes local lines one after another and stops at the first failure.
`python -m agentgym_jax.report WORKDIR` then reports the points' held-out success, their seeds
pooled, with intervals; `python -m agentgym_jax.viewer WORKDIR` draws their curves.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import shlex
import subprocess
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # experiment files import `experiments.*` and `agentgym_jax`.
  sys.path.insert(0, str(ROOT))

from agentgym_jax import sweeps  # pylint: disable=wrong-import-position


def load_module(path: str):
  """Imports an experiment file by path (the part of --config before ':')."""
  file = pathlib.Path(path)
  if not file.is_file():
    raise FileNotFoundError(f"No experiment file {path!r}.")
  spec = importlib.util.spec_from_file_location(f"sweep_config_{file.stem}", file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def expand(config: str, sweep_arg: str | None) -> list[dict[str, Any]]:
  """The sweep points of `config` ("file.py[:arg]") for `get_sweep(sweep_arg)`."""
  path = config.split(":", 1)[0]
  module = load_module(path)
  if not hasattr(module, "get_sweep"):
    raise ValueError(f"{path} defines no get_sweep(arg); nothing to sweep.")
  points = module.get_sweep(sweep_arg)
  if not points:
    raise ValueError(f"{path}: get_sweep({sweep_arg!r}) returned no points.")
  return points


def command_for(
    config: str,
    point: dict[str, Any],
    workdir: str,
    launcher: str = "local",
    module: str = "agentgym_jax.train",
    extra: tuple[str, ...] = (),
    python: str = "python",
) -> list[str]:
  """The argv that runs one sweep point.

  Args:
    config: "file.py[:arg]" as given to --config.
    point: one sweep point; "arg.k" keys go into the config argument, others become flags.
    workdir: the sweep's base workdir; the point's name is appended as a sub-directory.
    launcher: "local" (python -m ...) or "tpu" (launch/tpu.sh run ...).
    module: the entry point module.
    extra: flags appended verbatim.
    python: the interpreter for local lines.
  """
  path, _, arg = config.partition(":")
  args, fields = sweeps.split_point(point)
  config_arg = sweeps.merge_config_arg(arg, args)
  name = sweeps.point_name(point)
  flags = [f"--config={path}" + (f":{config_arg}" if config_arg else ""),
           f"--workdir={workdir.rstrip('/')}/{name}",
           *sweeps.override_flags(fields), *extra]
  if launcher == "local":
    return [python, "-m", module, *flags]
  if launcher == "tpu":
    session = name.replace("=", "_").replace(",", "_")[:60]
    return ["launch/tpu.sh", "run", "--session", session, "--", *flags]
  raise ValueError(f"Unknown launcher {launcher!r}; use 'local' or 'tpu'.")


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  extra: list[str] = []
  if "--" in argv:
    cut = argv.index("--")
    argv, extra = argv[:cut], argv[cut + 1:]
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", required=True, help="experiment file, optionally :arg")
  parser.add_argument("--sweep", default=None, help="argument passed to get_sweep")
  parser.add_argument("--workdir", required=True, help="base workdir; one sub-dir per point")
  parser.add_argument("--launcher", default="local", choices=["local", "tpu"])
  parser.add_argument("--module", default="agentgym_jax.train")
  parser.add_argument("--run", action="store_true", help="run local lines one by one")
  opts = parser.parse_args(argv)
  if opts.run and opts.launcher != "local":
    parser.error("--run only runs local lines: a tpu line returns at once (tmux), so several "
                 "on one slice would overlap; give each line its own TPU_NAME and run them.")
  python = sys.executable if opts.run else "python"
  commands = [command_for(opts.config, point, opts.workdir, opts.launcher, opts.module,
                          tuple(extra), python)
              for point in expand(opts.config, opts.sweep)]
  for command in commands:
    print(shlex.join(command), flush=True)
    if opts.run:
      result = subprocess.run(command, cwd=ROOT, check=False)
      if result.returncode != 0:
        print(f"failed with exit code {result.returncode}: {shlex.join(command)}", file=sys.stderr)
        return result.returncode
  return 0


if __name__ == "__main__":
  sys.exit(main())
