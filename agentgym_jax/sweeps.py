"""Sweeps as plain data: lists of dotted-key override dicts, and their command-line form.

An experiment file's `get_sweep(arg)` returns `list[dict[str, Any]]`, e.g.
  product(sweep("rl.algorithm", ["grpo", "rloo"]), sweep("seed", [0, 1]))
  -> [{"rl.algorithm": "grpo", "seed": 0}, {"rl.algorithm": "grpo", "seed": 1}, ...]
`launch/sweep.py` turns each dict into `--config.k=v` flags plus a workdir suffix.

A key of the form "arg.NAME" sets the config file's structural argument NAME (the `:k=v` part
of `--config=file.py:k=v`) instead of a config field, for knobs that change several fields at
once (the algorithm: PPO adds a critic).

A sweep's runs land in one workdir each, WORKDIR/NAME; `runs_in` finds them and `group_name`
joins the seeds of one point (`python -m agentgym_jax.report`, the viewer's sweep page).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import itertools
import os
import re
from typing import Any

Sweep = list[dict[str, Any]]
ARG_PREFIX = "arg."


def sweep(key: str, values: Sequence[Any]) -> Sweep:
  """One override dict per value of `key`."""
  return [{key: value} for value in values]


def fixed(key: str, value: Any) -> Sweep:
  """A one-point sweep: sets `key` in every point it is combined with."""
  return [{key: value}]


def product(*sweeps: Sweep) -> Sweep:
  """The cartesian product of sweeps; the first varies slowest. Keys must not repeat."""
  points = []
  for combo in itertools.product(*sweeps):
    points.append(_merge(combo))
  return points


def zipit(*sweeps: Sweep) -> Sweep:
  """Points taken together index by index; all sweeps must have the same length."""
  lengths = {len(s) for s in sweeps}
  if len(lengths) > 1:
    raise ValueError(f"zipit needs sweeps of equal length, got lengths {[len(s) for s in sweeps]}.")
  return [_merge(combo) for combo in zip(*sweeps)]


def _merge(dicts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  merged: dict[str, Any] = {}
  for d in dicts:
    clash = merged.keys() & d.keys()
    if clash:
      raise ValueError(f"Sweep key(s) {sorted(clash)} set twice in one point; combine sweeps "
                       "over different keys.")
    merged.update(d)
  return merged


# ----- command-line form ---------------------------------------------------------------------


def format_value(value: Any) -> str:
  """A config value as ml_collections' override flags parse it back.

  Tuples and lists become "a,b,c" (read back as a tuple; "a," for one element), booleans
  "true"/"false", everything else `str()`.
  """
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (tuple, list)):
    items = [format_value(v) for v in value]
    return ",".join(items) + ("," if len(items) == 1 else "")
  return str(value)


def split_point(point: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """Separates a sweep point into (structural config-arg settings, config-field overrides)."""
  args = {k[len(ARG_PREFIX):]: v for k, v in point.items() if k.startswith(ARG_PREFIX)}
  fields = {k: v for k, v in point.items() if not k.startswith(ARG_PREFIX)}
  return args, fields


def merge_config_arg(arg: str | None, updates: Mapping[str, Any]) -> str:
  """The `k=v,...` config argument `arg` with `updates` set (new keys appended, in order)."""
  items: dict[str, str | None] = {}
  for part in filter(None, (arg or "").split(",")):
    key, eq, value = part.partition("=")
    items[key.strip()] = value.strip() if eq else None
  for key, value in updates.items():
    items[key] = format_value(value)
  return ",".join(k if v is None else f"{k}={v}" for k, v in items.items())


def override_flags(fields: Mapping[str, Any], flag: str = "config") -> list[str]:
  """`--config.k=v` flags, one argv element each, in the point's key order."""
  return [f"--{flag}.{key}={format_value(value)}" for key, value in fields.items()]


def point_name(point: Mapping[str, Any]) -> str:
  """A short, path-safe name for a sweep point, used as the workdir suffix.

  Uses the last component of each dotted key: {"schedule.horizons": (5, 8, 10), "arg.algo":
  "ppo"} -> "horizons=5-8-10,algo=ppo".
  """
  parts = []
  for key, value in point.items():
    text = format_value(value).rstrip(",").replace(",", "-")
    parts.append(f"{key.rsplit('.', 1)[-1]}={text}")
  name = ",".join(parts)
  return re.sub(r"[^A-Za-z0-9_.,=+-]", "_", name) or "default"


# ----- the runs of a sweep -------------------------------------------------------------------

SEED_KEY = "seed"


def group_name(name: str) -> str:
  """A run's point name without its seed component: the runs of a sweep that differ only by
  seed share it. "algo=ppo,seed=3" -> "algo=ppo"; "seed=3" -> ""."""
  return ",".join(part for part in name.split(",") if part.partition("=")[0] != SEED_KEY)


def runs_in(path: str, marker: str) -> list[str]:
  """The runs a path names: itself if it holds `marker` (a file or folder every run writes,
  e.g. "metrics.jsonl"), else its sub-directories that hold it, sorted by name (a sweep's
  workdir: one per point). Empty when neither does."""
  if os.path.exists(os.path.join(path, marker)):
    return [path]
  if not os.path.isdir(path):
    return []
  children = (os.path.join(path, name) for name in sorted(os.listdir(path)))
  return [child for child in children if os.path.exists(os.path.join(child, marker))]
