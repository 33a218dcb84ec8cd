"""Pieces the command lines share: reading the --config flag, checking its environment,
one-line fatal errors, INFO logging to a file instead of the terminal.

A mistake on the command line (a wrong path, a name that does not exist) ends the program
with one line that says what was wrong and what to do, and with nothing written: a
traceback would bury that line, and a half-made workdir would be taken for a run.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

import ml_collections
from absl import flags
from absl import logging as absl_logging

from agentgym_jax.rollout import envs

EXAMPLE_CONFIG = "experiments/keypad/learn.py:runlocal"


def fatal(message: str) -> NoReturn:
  """Exits with status 1 after printing `message` as one line on stderr."""
  sys.exit(f"FATAL: {' '.join(str(message).split())}")


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (app.run's flags_parser), with one line for a bad flag.

  ml_collections raises a misspelt `--config.x=v` override as AttributeError/KeyError (with a
  "did you mean") from deep inside flag parsing; the traceback would bury the one line that
  matters.
  """
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    bad = [a for a in argv[1:] if a.startswith("--config.")]
    # The message arrives as the repr of a KeyError's: quoted, with escaped quotes and newlines.
    message = str(e).strip("'\"").replace("\\n", " ").replace("\\'", "'")
    fatal(f"bad config override among {bad}: no such field: {message}")
  except flags.Error as e:
    fatal(f"{e} (--helpshort lists the flags)")


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


def check_env(config: ml_collections.ConfigDict) -> None:
  """Exits with one line when `config.env` names no environment this install has (or a
  remote one that names no served environment): `envs.check`'s error."""
  try:
    envs.check(config)
  except ValueError as e:
    fatal(f"config.env: {e}")


def log_to(path: str | None) -> None:
  """Sends INFO logging to the file `path` (None: nowhere) and keeps only warnings and errors
  on the terminal, unless --alsologtostderr: absl's and orbax's INFO lines would bury the
  progress bar and the results."""
  logging.getLogger().setLevel(logging.INFO)
  if path is not None:
    handler = logging.FileHandler(path)
    handler.setFormatter(absl_logging.PythonFormatter())
    logging.getLogger().addHandler(handler)
  if not flags.FLAGS.alsologtostderr:
    absl_logging.get_absl_handler().setLevel(logging.WARNING)
