"""Asynchronous rollout with a staleness bound: the environments and the decoding do not wait
for the update (docs/async.md).

With `rollout.max_staleness = k > 0`, or a device group of its own (`rollout.devices = n > 0`),
a rollout thread samples the steps' episodes while the main thread scores and updates:

  rollout thread:  step i sampled with the weights of version max(i - k, v0)  -> queue (k slots)
  main thread:     step i from the queue, scored, updated (version i -> i + 1), published

A policy version is the number of updates its weights have had (`state.step`); v0 is the
version the run started or resumed from. Step i's episodes are sampled by version
max(i - k, v0) and trained by version i: at most k updates stale (the bound), exactly k once
the run is k steps past v0. A fixed lag, not "the newest weights": the rollout thread starts
step i at the same moment either way (when version i - k is out), and a version fixed by the
step makes a run a function of its config, not of the threads' timing. With k = 0 the thread
waits for each update, which is the synchronous loop's order, value for value.

The correction for the lag is the synchronous loop's: the batch is scored by the trainer's
current policy (the proximal policy of decoupled PPO, AReaL arXiv 2505.24298) and truncated
importance sampling weighs each token by min(pi_prox / pi_sampler, algo.tis_cap) with the
sampler's own log-probs (`losses.tis_weights`), so k > 0 needs `algo.tis_cap > 0`.

Partial rollouts (`rollout.partial`): the thread starts step i with the newest weights out
(never older than i - k), and an episode in flight takes weights published since at its next
turn, its context prefilled again with them (rollout/episodes.py: a KV cache never outlives the
weights that computed it). Each turn records its version; the batch's oldest bounds it. The run
then depends on the threads' timing, hence off by default.

Devices: with `rollout.devices = n`, the last n devices of every host (process) roll out on a
mesh of their own (`config.mesh`'s axes over them) and the others train; after each update the
trainer publishes its weights to them with a device-to-device `jax.device_put` onto the same
partition specs on the rollout mesh, tagged with the new version (no file). With n = 0 both
share the trainer's mesh and the published weights are a copy (the update donates its state's
buffers).

Several hosts: both groups span the processes, and each process rolls out its share of every
step's rows on its own rollout devices with its own environments, as the synchronous loop does
on its share of the trainer's mesh (agentgym_jax/multihost.py). Publishing is the main thread's:
the trainer's collective that gathers each process's copy of the policy (`batches.
rollout_params`), then a device-to-device copy onto the process's rollout devices. The rollout
thread never calls a program that spans processes (each process would interleave it with the
main thread's collectives in its own order); it gathers a step's episodes from every process
through the coordination service's key-value store (`multihost.KeyValueChannel`), so every
process's thread holds the whole batch, as the synchronous loop's gather gives it, and dynamic
sampling decides alike on all of them.

Failures: each step's episodes come from `batches.sample_step`, as in the synchronous loop, so
failed episodes (a crashed, raising or hung worker: `env.timeout_s`) train nothing and stay out
of the group baselines, and the loop's `env.max_failed_steps` stop applies. The rollout thread
has its own environment pool (evaluation keeps the trainer's). An error in the thread reaches
the main thread after the batches it finished before it: those are trained first.

Resume: the checkpoint holds the version it was saved at and the task cursor after the steps it
trained; batches sampled but not trained are sampled again after a resume, with the resumed
weights (v0). At k = 0 a resumed run is therefore bit-exact with an uninterrupted one; at
k > 0 its first k steps after the resume sample with fresher weights than the uninterrupted
run's (staleness 0, 1, ..., k - 1), and the two runs differ from there.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentgym_jax import multihost
from agentgym_jax.rl import schedule
from agentgym_jax.rollout import envs
from agentgym_jax.train import batches
from agentgym_jax.train import state as state_lib

# How often a blocked thread looks whether the run is closing (seconds).
_POLL_S = 0.1


@dataclasses.dataclass(frozen=True)
class AsyncSettings:
  """`rollout.max_staleness` (k), `rollout.devices` (the rollout group's device count) and
  `rollout.partial` (episodes in flight take newer weights between turns)."""

  max_staleness: int = 0
  rollout_devices: int = 0
  partial: bool = False

  @property
  def enabled(self) -> bool:
    """Whether a rollout thread samples the steps (else the synchronous loop does)."""
    return self.max_staleness > 0 or self.rollout_devices > 0

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> AsyncSettings:
    """The run's settings, checked against the rest of its config (one-line errors)."""
    k, n = config.rollout.max_staleness, config.rollout.devices
    if k < 0 or n < 0:
      raise ValueError(f"rollout.max_staleness={k} and rollout.devices={n} must be >= 0.")
    settings = cls(max_staleness=int(k), rollout_devices=int(n),
                   partial=bool(config.rollout.partial))
    if settings.partial and k == 0:
      raise ValueError("rollout.partial=True needs rollout.max_staleness > 0 (at 0 no newer "
                       "weights come out during a step's rollout).")
    if not settings.enabled:
      return settings
    if config.mode != "rl":
      raise ValueError(f"rollout.max_staleness / rollout.devices apply to mode='rl' only "
                       f"(mode={config.mode!r} samples nothing); set them to 0.")
    if k > 0 and config.algo.tis_cap <= 0:
      raise ValueError(f"rollout.max_staleness={k} trains on episodes sampled by weights up to "
                       f"{k} updates old: set algo.tis_cap > 0 (e.g. 2.0) so truncated "
                       "importance sampling corrects for them.")
    return settings


def device_groups(settings: AsyncSettings, devices: list[Any] | None = None
                  ) -> tuple[list[Any] | None, list[Any] | None]:
  """(the trainer's devices, the rollout's) of `devices` (default: the job's, `jax.devices()`;
  the plan passes a TPU slice's): the last `rollout_devices` devices of every process (host)
  roll out, the others train, processes in order; (None, None) when they share all devices.

  Raises:
    ValueError: a process would keep no device to train.
  """
  n = settings.rollout_devices
  if n == 0:
    return None, None
  by_process: dict[int, list[Any]] = {}
  for device in jax.devices() if devices is None else devices:
    by_process.setdefault(device.process_index, []).append(device)
  hosts = [by_process[p] for p in sorted(by_process)]
  if n >= min(map(len, hosts)):
    raise ValueError(f"rollout.devices={n} leaves none of the {min(map(len, hosts))} devices "
                     "of each process to train; use fewer (or 0 to share the trainer's "
                     "mesh).")
  return [d for host in hosts for d in host[:-n]], [d for host in hosts for d in host[-n:]]


class WeightBoard:
  """The policy weights published for the rollout, by version, on the rollout mesh.

  `mesh`: where this process samples (its rollout devices, laid out by `state.rollout_layout`
  in a run); `shardings`: the weights' shardings there (a run's, from the same layout), or None
  for each array's own partition spec on `mesh`. `publish` puts a version's weights there (a
  device-to-device copy); `take(v)` waits for version v and forgets the older ones (the
  rollout never goes back to them)."""

  def __init__(self, mesh: Mesh, shardings: Any = None):
    self.mesh, self.shardings = mesh, shardings
    self._weights: dict[int, Any] = {}
    self._changed = threading.Condition()
    self._closed = False

  def publish(self, version: int, params: Any) -> None:
    """Copies `params` (this process's copy, on its own devices: `batches.rollout_params`)
    to the board's `shardings` as `version`, or without them to its mesh with each array's
    partition spec (replicated where it has none: a single-device array).

    Always a copy (`may_alias=False`): the update donates the buffers of the state it reads."""
    spec = lambda x: getattr(x.sharding, "spec", P())
    shardings = self.shardings
    if shardings is None:
      shardings = jax.tree.map(lambda x: NamedSharding(self.mesh, spec(x)), params)
    moved = jax.device_put(params, shardings, may_alias=False)
    jax.block_until_ready(moved)
    with self._changed:
      self._weights[version] = moved
      self._changed.notify_all()

  def take(self, version: int, newest: bool = False) -> tuple[int, Any] | None:
    """(version, weights) once version `version` is published, or with `newest` the newest
    published from it on; None once the board is closed."""
    with self._changed:
      while version not in self._weights and not self._closed:
        self._changed.wait(_POLL_S)
      if self._closed:
        return None
      if newest:
        version = max(self._weights)
      for old in [v for v in self._weights if v < version]:
        del self._weights[old]
      return version, self._weights[version]

  def newer(self, version: int) -> tuple[int, Any] | None:
    """(version, weights) of the newest version published after `version`, else None."""
    with self._changed:
      newest = max(self._weights, default=-1)
      return (newest, self._weights[newest]) if newest > version else None

  def versions(self) -> list[int]:
    with self._changed:
      return sorted(self._weights)

  def close(self) -> None:
    with self._changed:
      self._closed = True
      self._weights.clear()
      self._changed.notify_all()


class RolloutFailed(RuntimeError):
  """The rollout thread stopped on an error (the cause is chained); the batches it finished
  before were trained."""


@dataclasses.dataclass(frozen=True)
class _Failure:
  error: BaseException


class RolloutThread:
  """A thread that samples steps `first_step` .. `total_steps - 1` in order, each with the
  weights `board.take(version_for(step))`, into a queue of at most max(k, 1) finished steps.

  `sample(step, params, version)` draws one step (`batches.sample_step` in a run); with
  `newest` it gets the newest weights published by then, not older than `version_for(step)`.
  `next()` hands the steps over in order; an error in `sample` reaches `next()` as
  `RolloutFailed` after the steps finished before it, so none of those is lost. On several
  processes `sample`'s gathers go through a `multihost.KeyValueChannel` of the thread's own."""

  def __init__(self, sample: Callable[[int, Any, int], Any], board: WeightBoard, *,
               first_step: int, total_steps: int, max_staleness: int, newest: bool = False):
    self.sample, self.board, self.newest = sample, board, newest
    self.first_step, self.total_steps, self.max_staleness = (first_step, total_steps,
                                                             max_staleness)
    self._queue: queue.Queue = queue.Queue(maxsize=max(max_staleness, 1))
    self._stop = threading.Event()
    self._channel = multihost.KeyValueChannel("rollout", self._stop)  # on the main thread
    self._thread = threading.Thread(target=self._run, name="rollout", daemon=True)
    self._thread.start()

  def version_for(self, step: int) -> int:
    """The policy version that samples step `step`: `max_staleness` updates before it, never
    before the run's first step."""
    return max(step - self.max_staleness, self.first_step)

  def _run(self) -> None:
    try:
      with multihost.gathers_through(self._channel):
        for step in range(self.first_step, self.total_steps):
          taken = self.board.take(self.version_for(step), newest=self.newest)
          if taken is None or not self._put(self.sample(step, taken[1], taken[0])):
            return  # the run is closing
    except BaseException as exc:  # pylint: disable=broad-except
      # Handed to the main thread, behind the steps finished before it.
      self._put(_Failure(exc))

  def _put(self, item: Any) -> bool:
    """Queues `item`, waiting for a free slot; False if the run closed meanwhile."""
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=_POLL_S)
        return True
      except queue.Full:
        continue
    return False

  def next(self) -> Any:
    """The next finished step, waiting for it."""
    while True:
      try:
        item = self._queue.get(timeout=_POLL_S)
        break
      except queue.Empty:
        if not self._thread.is_alive() and self._queue.empty():
          raise RolloutFailed("The rollout thread ended without the next step's batch "
                              "(the run asked for more than total_steps).") from None
    if isinstance(item, _Failure):
      raise RolloutFailed(f"The rollout thread stopped: {type(item.error).__name__}: "
                          f"{item.error}") from item.error
    return item

  def close(self) -> None:
    """Stops the thread; it finishes the episodes it is sampling (the environments' timeouts
    bound them), stops waiting for other processes' episodes and queues nothing more."""
    self._stop.set()
    self.board.close()
    self._thread.join()


class AsyncRollout:
  """A run's rollout thread and the main thread's side of it: `batch` (the loop's
  `make_batch`) takes the next finished step and scores it, `publish` hands the updated
  weights to the rollout, `close` stops the thread and its environments.

  `inputs` are the trainer's (`batches.StepInputs`); the thread samples with a copy of the
  weights on this process's devices of `rollout_mesh` (the trainer's mesh, or `config.mesh`'s
  axes over the devices of `device_groups`) and with its own environment pool, steps
  `first_step` to `config.total_steps - 1` from task `cursor` on."""

  def __init__(self, config: ml_collections.ConfigDict, settings: AsyncSettings,
               inputs: batches.StepInputs, state: state_lib.TrainState, *, first_step: int,
               cursor: int, rollout_mesh: Mesh):
    self.settings, self.inputs = settings, inputs
    share = multihost.process_share(rollout_mesh)
    # The synchronous loop's layout of the rollout's weights, on this process's rollout devices.
    self.board = WeightBoard(*state_lib.rollout_layout(inputs.policy_def, state.policy,
                                                       share.mesh))
    self.publish(state)
    rng = np.asarray(jax.device_get(state.rng))  # the state's buffers are donated
    self.pool = envs.make_pool(inputs.env)  # last: nothing after it can fail and leave it open
    rollout_inputs = dataclasses.replace(inputs, mesh=rollout_mesh, pool=self.pool,
                                         share=share)
    cursors = [cursor]  # the task stream's position, advanced by the thread only

    def sample(step: int, params: Any, version: int) -> batches.Sampled:
      sampled = batches.sample_step(rollout_inputs, params, rng=rng, step=step,
                                    cursor=cursors[0], version=version,
                                    max_turns=schedule.max_turns(inputs.schedule, step),
                                    weights=self.board.newer if settings.partial else None)
      cursors[0] = sampled.cursor
      return sampled

    self.thread = RolloutThread(sample, self.board, first_step=first_step,
                                total_steps=config.total_steps,
                                max_staleness=settings.max_staleness, newest=settings.partial)

  def publish(self, state: state_lib.TrainState) -> None:
    """The state's policy, in the rollout's compute dtype, as version `state.step` (on
    several processes a collective: the main thread's, on every process)."""
    self.board.publish(int(jax.device_get(state.step)),
                       batches.rollout_params(self.inputs, state.policy))

  def batch(self, inputs: batches.StepInputs, state: state_lib.TrainState, step: int,
            cursor: int, max_turns: int, saving: bool) -> batches.StepBatch:
    """Step `step`'s batch (the loop's `make_batch`): the thread's next finished step, scored
    by `state`. Adds async/ metrics: the version of the batch's first turns (its oldest), its
    staleness, the mean staleness of the turns (lower with partial rollouts) and the seconds
    the trainer waited for the batch."""
    start = time.perf_counter()
    sampled = self.thread.next()
    waited = time.perf_counter() - start
    trained_by = int(jax.device_get(state.step))
    staleness = trained_by - sampled.version
    first_task = sampled.cursor - sampled.drawn * inputs.config.data.batch_tasks
    if ((sampled.step, first_task, sampled.max_turns) != (step, cursor, max_turns)
        or not 0 <= staleness <= self.settings.max_staleness):
      raise RuntimeError(f"The rollout thread's batch is step {sampled.step} from task "
                         f"{first_task} with {sampled.max_turns} turns, sampled by version "
                         f"{sampled.version}; the trainer is at step {step} (version "
                         f"{trained_by}), task {cursor}, {max_turns} turns: a bug in "
                         "train/asynchronous.py.")
    got = batches.scored_batch(inputs, state, sampled, saving=saving)
    turns = [v for e in got.episodes for v in e.policy_versions] or [sampled.version]
    got.metrics.update({"async/policy_version": float(sampled.version),
                        "async/staleness": float(staleness),
                        "async/staleness_mean": trained_by - float(np.mean(turns)),
                        "time/rollout_wait": waited})
    return got

  def close(self) -> None:
    """Stops the thread, then its environment pool."""
    self.thread.close()
    self.pool.close()
