"""Turn-limit (horizon) schedules: how many agent turns an episode may take at a training step.

Config data (`config.schedule`, a ConfigDict, a dict or any object with these attributes):

  kind = "fixed"           horizons = [H]              every step allows H turns
  kind = "scaling_inter"   horizons = [h1 < h2 < ...]  ScalingInter-RL (AgentGym-RL, arXiv
                           steps_per_phase = Δ         2509.08755): phase p = step // Δ allows
                                                       h_{p+1} turns; the last one holds.

`step` is the 0-based global training step about to run, i.e. the number of updates already
done, which is what a checkpoint stores. Upstream counts steps from 1 (steps 1..Δ use h1); ours
0..Δ-1 use h1, the same steps. The horizon is a pure function of (config, step): restoring step s
from a checkpoint gives exactly the horizons of an uninterrupted run. Upstream keeps a counter
that advances one step early at the next boundary after a resume; nothing here can drift.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

KINDS = ("fixed", "scaling_inter")


def _field(config: Any, name: str, default: Any = None) -> Any:
  if isinstance(config, Mapping):
    return config.get(name, default)
  return getattr(config, name, default)


def _is_int(x: Any) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def validate(config: Any) -> tuple[str, tuple[int, ...], int | None]:
  """Checks a schedule config and returns (kind, horizons, steps_per_phase).

  Raises:
    ValueError: unknown kind; horizons empty, not integers, not positive, not strictly
      increasing, or (fixed) more than one; steps_per_phase missing or not a positive integer
      (scaling_inter).
  """
  kind = _field(config, "kind")
  if kind not in KINDS:
    raise ValueError(f"schedule.kind must be one of {KINDS}, got {kind!r}")
  raw = _field(config, "horizons")
  if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
    raise ValueError(f"schedule.horizons must be a list of turn limits, e.g. [10, 20, 30]; got "
                     f"{raw!r}")
  horizons = tuple(raw)
  if not horizons:
    raise ValueError("schedule.horizons is empty; give at least one turn limit, e.g. [20]")
  if not all(_is_int(h) for h in horizons):
    raise ValueError(f"schedule.horizons must be integers, got {list(horizons)}")
  if min(horizons) <= 0:
    raise ValueError(f"schedule.horizons must be positive turn counts, got {list(horizons)}")
  if kind == "fixed":
    if len(horizons) != 1:
      raise ValueError(f"schedule.kind='fixed' takes exactly one horizon, got {list(horizons)}; "
                       "use kind='scaling_inter' for a list")
    return kind, (int(horizons[0]),), None
  if any(b <= a for a, b in zip(horizons, horizons[1:])):
    raise ValueError(f"schedule.horizons must be strictly increasing for 'scaling_inter' "
                     f"(h1 < h2 < ...), got {list(horizons)}")
  steps_per_phase = _field(config, "steps_per_phase")
  if not _is_int(steps_per_phase) or steps_per_phase <= 0:
    raise ValueError(f"schedule.steps_per_phase must be a positive integer for 'scaling_inter', "
                     f"got {steps_per_phase!r}")
  return kind, tuple(int(h) for h in horizons), int(steps_per_phase)


def _check_step(step: Any) -> int:
  if not _is_int(step) or step < 0:
    raise ValueError(f"step must be a non-negative integer (0-based global step), got {step!r}")
  return int(step)


def phase(config: Any, step: int) -> int:
  """0-based schedule phase at `step`: 0 for `fixed`, min(step // Δ, n - 1) for `scaling_inter`."""
  kind, horizons, steps_per_phase = validate(config)
  step = _check_step(step)
  if kind == "fixed":
    return 0
  return min(step // steps_per_phase, len(horizons) - 1)


def max_turns(config: Any, step: int) -> int:
  """Turn limit for the episodes collected at `step` (0-based global training step)."""
  _, horizons, _ = validate(config)
  return horizons[phase(config, step)]


# The name used in the team contract (`schedule.horizon(config.schedule, step)`).
horizon = max_turns
