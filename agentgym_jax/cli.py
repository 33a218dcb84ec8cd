"""Pieces the command lines share: reading the --config flag, one-line fatal errors.

A mistake on the command line (a wrong path, a name that does not exist) ends the program
with one line that says what was wrong and what to do, and with nothing written: a
traceback would bury that line, and a half-made workdir would be taken for a run.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import ml_collections
from absl import flags

EXAMPLE_CONFIG = "experiments/keypad/learn.py:runlocal"


def fatal(message: str) -> NoReturn:
  """Exits with status 1 after printing `message` as one line on stderr."""
  sys.exit(f"FATAL: {' '.join(str(message).split())}")


def config_from_flag(name: str = "config") -> ml_collections.ConfigDict:
  """The config of the config_flags flag `--name`; exits with one line if its file is missing.

  config_flags defers a load error until the first field is read, where it surfaces as a
  long traceback from deep inside the program.
  """
  path = flags.FLAGS[name].config_filename.split(":", 1)[0]
  if not os.path.isfile(path):
    fatal(f"--{name}: no config file {path!r} (relative to {os.getcwd()}); pass an experiment "
          f"file, e.g. --{name}={EXAMPLE_CONFIG}")
  return flags.FLAGS[name].value
