"""Turn-limit (horizon) schedules: how many agent turns an episode may take at a training step.

A `Schedule` (`config.schedule`, typed once by agentgym_jax/settings.py:schedule; it checks
itself when made):

  kind = "fixed"           horizons = [H]              every step allows H turns
  kind = "scaling_inter"   horizons = [h1 < h2 < ...]  ScalingInter-RL (AgentGym-RL, arXiv
                           steps_per_phase = Δ         2509.08755): phase p allows h_{p+1}
                           advance = "steps"           turns; the last one holds.

`advance` names the rule that ends a phase, a key of `ADVANCE_RULES`:

  "steps"    after Δ steps (the paper's schedule): phase p = min(step // Δ, n - 1).
  "success"  once the mean training success (`episodes/success_rate`) of the phase's last
             `window` steps reaches `success_threshold`, or after Δ steps at the latest.
  "plateau"  once that mean rose by less than `min_gain` over the `window` steps before them
             (2 x window steps into the phase at the earliest), or after Δ steps at the latest.

The evidence rules are ours, not the paper's: the horizon lengthens when the policy has
learned what the short one teaches, instead of at a step fixed in advance.

`step` is the 0-based global training step about to run, i.e. the number of updates already
done, which is what a checkpoint stores. Upstream counts steps from 1 (steps 1..Δ use h1); ours
0..Δ-1 use h1, the same steps. Under "steps" the horizon is a pure function of (schedule, step):
restoring step s from a checkpoint gives exactly the horizons of an uninterrupted run. Upstream
keeps a counter that advances one step early at the next boundary after a resume; nothing here
can drift. Under an evidence rule it is a pure function of (schedule, step, progress), where
`Progress` is what the rule has seen so far, folded step by step with `advance`; the trainer
saves it in each checkpoint's meta (`Progress.to_meta`, exact as JSON), so a resumed run
continues the fold where the checkpoint left it.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agentgym_jax.rl.registry import Registry

KINDS = ("fixed", "scaling_inter")
# The training metric the evidence rules read, from the step's metrics.
SUCCESS_METRIC = "episodes/success_rate"
# The key of the schedule's progress in a checkpoint's meta.
META_KEY = "schedule"

# rule(recent, *, window, success_threshold, min_gain) -> whether the phase ends now, where
# recent holds the training success of the phase's steps so far (the last 2 x window of them).
ADVANCE_RULES: Registry = Registry("schedule advance rule", reads_success=True)


@ADVANCE_RULES.register("steps", reads_success=False)
def after_steps(recent: tuple[float, ...], *, window: int, success_threshold: float,
                min_gain: float) -> bool:
  """Never on evidence: the phase ends after steps_per_phase steps (ScalingInter-RL)."""
  del recent, window, success_threshold, min_gain
  return False


@ADVANCE_RULES.register("success")
def on_success(recent: tuple[float, ...], *, window: int, success_threshold: float,
               min_gain: float) -> bool:
  """mean(recent[-window:]) >= success_threshold, once the phase has `window` steps."""
  del min_gain
  return len(recent) >= window and float(np.mean(recent[-window:])) >= success_threshold


@ADVANCE_RULES.register("plateau")
def on_plateau(recent: tuple[float, ...], *, window: int, success_threshold: float,
               min_gain: float) -> bool:
  """mean(recent[-window:]) - mean(recent[-2 window:-window]) < min_gain, once the phase has
  2 x window steps: success stopped rising at this horizon."""
  del success_threshold
  if len(recent) < 2 * window:
    return False
  gain = float(np.mean(recent[-window:])) - float(np.mean(recent[-2 * window:-window]))
  return gain < min_gain


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A turn-limit schedule, checked when made (`config.schedule`'s fields, train/config.py).

  steps_per_phase, advance, window, success_threshold and min_gain are read by
  "scaling_inter" only (and checked only there).

  Raises:
    ValueError: unknown kind; horizons empty, not integers, not positive, not strictly
      increasing, or (fixed) more than one; steps_per_phase not a positive integer
      (scaling_inter); an unknown advance rule, a window that is not a positive integer, a
      success_threshold outside [0, 1] (scaling_inter).
  """
  kind: str
  horizons: Sequence[int]
  steps_per_phase: int | None = None
  advance: str = "steps"
  window: int = 1
  success_threshold: float = 1.0
  min_gain: float = 0.0

  def __post_init__(self):
    kind, raw = self.kind, self.horizons
    if kind not in KINDS:
      raise ValueError(f"schedule.kind must be one of {KINDS}, got {kind!r}")
    if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
      raise ValueError(f"schedule.horizons must be a list of turn limits, e.g. [10, 20, 30]; "
                       f"got {raw!r}")
    horizons = tuple(raw)
    if not horizons:
      raise ValueError("schedule.horizons is empty; give at least one turn limit, e.g. [20]")
    if not all(_is_int(h) for h in horizons):
      raise ValueError(f"schedule.horizons must be integers, got {list(horizons)}")
    if min(horizons) <= 0:
      raise ValueError(f"schedule.horizons must be positive turn counts, got {list(horizons)}")
    object.__setattr__(self, "horizons", tuple(int(h) for h in horizons))
    if kind == "fixed":
      if len(horizons) != 1:
        raise ValueError(f"schedule.kind='fixed' takes exactly one horizon, got "
                         f"{list(horizons)}; use kind='scaling_inter' for a list")
      return
    if any(b <= a for a, b in zip(horizons, horizons[1:])):
      raise ValueError(f"schedule.horizons must be strictly increasing for 'scaling_inter' "
                       f"(h1 < h2 < ...), got {list(horizons)}")
    if not _is_int(self.steps_per_phase) or self.steps_per_phase <= 0:
      raise ValueError(f"schedule.steps_per_phase must be a positive integer for "
                       f"'scaling_inter', got {self.steps_per_phase!r}")
    if self.advance not in ADVANCE_RULES:
      raise ValueError(f"schedule.advance must be one of {sorted(ADVANCE_RULES)}, got "
                       f"{self.advance!r}")
    if not _is_int(self.window) or self.window <= 0:
      raise ValueError(f"schedule.window must be a positive number of steps, got "
                       f"{self.window!r}")
    if not 0.0 <= float(self.success_threshold) <= 1.0:
      raise ValueError(f"schedule.success_threshold is a success rate in [0, 1], got "
                       f"{self.success_threshold}")

  @property
  def reads_success(self) -> bool:
    """Whether a phase may end on training evidence (then the turn limit needs `Progress`)."""
    return self.kind == "scaling_inter" and ADVANCE_RULES.traits(self.advance)["reads_success"]


@dataclasses.dataclass(frozen=True)
class Progress:
  """What an evidence rule has seen: the phase, the step it began at, and the training
  success of its steps so far (the last 2 x window of them)."""
  phase: int = 0
  since: int = 0
  recent: tuple[float, ...] = ()

  def to_meta(self) -> dict[str, Any]:
    """JSON-ready (floats survive JSON exactly)."""
    return {"phase": self.phase, "since": self.since, "recent": list(self.recent)}

  @classmethod
  def from_meta(cls, meta: Mapping[str, Any] | None) -> "Progress":
    """From `to_meta`'s dict; a checkpoint without one (a run from before evidence rules, or
    a new run) starts at phase 0."""
    if not meta:
      return cls()
    return cls(phase=int(meta["phase"]), since=int(meta["since"]),
               recent=tuple(float(x) for x in meta["recent"]))


def _is_int(x: Any) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_step(step: Any) -> int:
  if not _is_int(step) or step < 0:
    raise ValueError(f"step must be a non-negative integer (0-based global step), got {step!r}")
  return int(step)


def phase(schedule: Schedule, step: int, progress: Progress | None = None) -> int:
  """0-based schedule phase at `step`: 0 for `fixed`, min(step // Δ, n - 1) for `scaling_inter`
  advancing on steps, `progress.phase` for an evidence rule.

  Raises:
    ValueError: an evidence rule without `progress` past step 0 (nothing to decide from).
  """
  step = _check_step(step)
  if schedule.kind == "fixed":
    return 0
  if not schedule.reads_success:
    return min(step // schedule.steps_per_phase, len(schedule.horizons) - 1)
  if progress is None:
    if step == 0:
      return 0
    raise ValueError(f"schedule.advance={schedule.advance!r} decides step {step}'s turn limit "
                     "from the training success of the steps before it: pass the run's "
                     "Progress (asynchronous rollout, which samples ahead, cannot use it).")
  return progress.phase


def max_turns(schedule: Schedule, step: int, progress: Progress | None = None) -> int:
  """Turn limit for the episodes collected at `step` (0-based global training step)."""
  return schedule.horizons[phase(schedule, step, progress)]


def phase_of(schedule: Schedule, turns: int) -> int:
  """The phase whose turn limit is `turns` (the horizons are strictly increasing)."""
  return schedule.horizons.index(turns)


def advance(schedule: Schedule, progress: Progress, step: int, metrics: Mapping[str, Any]
            ) -> Progress:
  """`progress` after step `step` ran with `metrics` (its training metrics): the phase ends
  when its rule says so or after steps_per_phase steps. Unchanged for "fixed" and in the last
  phase. Under "steps" the fold gives the phase `phase` computes from the step alone, and
  reads no metric.

  Raises:
    ValueError: an evidence rule, and `metrics` without the training success (behaviour
      cloning has none).
  """
  step = _check_step(step)
  if schedule.kind == "fixed" or progress.phase == len(schedule.horizons) - 1:
    return progress
  recent = ()
  if schedule.reads_success:
    if SUCCESS_METRIC not in metrics:
      raise ValueError(f"schedule.advance={schedule.advance!r} reads the training success "
                       f"({SUCCESS_METRIC}), which step {step}'s metrics lack (behaviour "
                       "cloning rolls out nothing): use schedule.advance='steps'.")
    recent = (*progress.recent, float(metrics[SUCCESS_METRIC]))[-2 * schedule.window:]
  rule = ADVANCE_RULES[schedule.advance]
  ends = rule(recent, window=schedule.window, success_threshold=schedule.success_threshold,
              min_gain=schedule.min_gain)
  if ends or step + 1 - progress.since >= schedule.steps_per_phase:
    return Progress(phase=progress.phase + 1, since=step + 1)
  return Progress(phase=progress.phase, since=progress.since, recent=recent)


# The name used in the team contract (`schedule.horizon(schedule, step)`).
horizon = max_turns
