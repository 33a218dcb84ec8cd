"""Pieces the command lines share: defining and reading the --config flag, the compilation
cache, one-line fatal errors, INFO logging to a file instead of the terminal. (What the config
means, and its one-line checks, are agentgym_jax/settings.py's.)

A mistake on the command line (a wrong path, a name that does not exist) ends the program
with one line that says what was wrong and what to do, and with nothing written: a
traceback would bury that line, and a half-made workdir would be taken for a run.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import NoReturn

import ml_collections
from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from agentgym_jax import caches

EXAMPLE_CONFIG = "experiments/keypad/learn.py:runlocal"


def define_config_flag(help_string: str, name: str = "config", **kwargs) -> flags.FlagHolder:
  """Defines the experiment-file flag `--name` (config_flags), with `--name.a.b=v` overrides.

  The experiment file locks its config (`train.config.lock`), so an override of a field that
  does not exist fails, but for `algo.estimator_kwargs`, the estimator's own options, which
  it leaves open: there the command line may add a key (`--config.algo.estimator_kwargs.x=v`),
  checked against the estimator when the run starts. config_flags' own locking would close
  that sub-tree too, so it is off, and its `accept_new_attributes` lets an override create a
  key where the config is unlocked (and only there).

  Args:
    help_string: the flag's help.
    name: the flag's name.
    **kwargs: passed on to `config_flags.DEFINE_config_file` (tests: flag_values, sys_argv).
  """
  return config_flags.DEFINE_config_file(name, None, help_string, lock_config=False,
                                         accept_new_attributes=True, **kwargs)


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
    fatal(f"bad config override among {bad}: no such field: {_missing_field(e)}; "
          "agentgym_jax/train/config.py:base_config() defines every field")
  except flags.Error as e:
    fatal(f"{e} (--helpshort lists the flags)")
  except OSError as e:
    # A missing config file with --config.x=v overrides: config_flags reads the file to parse
    # them, instead of deferring the error to `config_from_flag`.
    paths = [a.split("=", 1)[1].split(":", 1)[0] for a in argv[1:] if a.startswith("--config=")]
    for path in paths:
      if not os.path.isfile(path):
        _no_config_file("config", path)
    fatal(str(e))


def _missing_field(error: Exception) -> str:
  """The missing field of ml_collections' error, and its "did you mean" where it has one.

  A locked section's error also lists every field of the section, and arrives as nested reprs
  (quotes escaped once per level, newlines as text): the key and the hint are what matter.
  """
  text = str(error)
  key = re.search(r'Key "([^"\\]+)" does not exist', text)
  if key is None:
    return text.strip("'\"").replace("\\n", " ").replace("\\'", "'")
  hint = re.search(r'Did you mean "([^"\\]+)"', text)
  return repr(key.group(1)) + (f' (Did you mean "{hint.group(1)}"?)' if hint else "")


def config_from_flag(name: str = "config") -> ml_collections.ConfigDict:
  """The config of the config_flags flag `--name`; exits with one line if its file is missing.

  config_flags defers a load error until the first field is read, where it surfaces as a
  long traceback from deep inside the program.
  """
  path = flags.FLAGS[name].config_filename.split(":", 1)[0]
  if not os.path.isfile(path):
    _no_config_file(name, path)
  return flags.FLAGS[name].value


def _no_config_file(name: str, path: str) -> NoReturn:
  fatal(f"--{name}: no config file {path!r} (relative to {os.getcwd()}); pass an experiment "
        f"file, e.g. --{name}={EXAMPLE_CONFIG}")


def use_compilation_cache(directory: str) -> None:
  """Turns on JAX's persistent compilation cache in `directory` (`config.compile.cache_dir`;
  "" = off), before anything compiles; exits with one line if it cannot be created."""
  try:
    caches.use_compilation_cache(directory)
  except OSError as e:
    fatal(f"config.compile.cache_dir: cannot create {directory!r} ({e.strerror}); pass a "
          "writable directory, or --config.compile.cache_dir= to compile without the cache")


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
