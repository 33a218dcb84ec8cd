"""The trainer's checkpoints of the train state with Orbax (keep-N, asynchronous saves, exact
resume) and the HF export of a finished run.

A checkpoint holds two items: `state` (the TrainState as a plain dict of arrays: parameters,
optimizer states, step, rng) and `meta` (JSON: the step, the task-order cursor and what a
resumed run must check, such as the tokenizer). Saves run in the background while training
goes on; `close()` waits for the last one, so a finished checkpoint is never lost when the
process exits, and Orbax writes each step to a temporary directory that is renamed only when
complete, so a crash mid-save leaves the previous checkpoints intact. The next start finds the
temporary directories of such interrupted saves (`interrupted`), says so and deletes them;
older checkpoints are deleted only once a newer one is complete. A save that the disk cannot
hold is refused before it starts (`NoSpaceForCheckpoint`), with the sizes in its message: a
full disk otherwise stops the run from Orbax's writer thread, mid-write, with an error that
names neither.

They are written under WORKDIR/`policies.CHECKPOINT_DIR`, where `policies.restore_policy` reads
a run's policy back (evaluation, replay, a warm start) without the train state around it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from agentgym_jax.models import save_hf
from agentgym_jax.train.state import TrainState

# The final policy as an HF checkpoint directory, inside a run's workdir.
HF_EXPORT_DIR = "hf"
_FIELDS = ("step", "rng", "policy", "opt_state", "ref", "critic", "critic_opt_state")
# The name Orbax gives a step's directory while it is being written: "<step>.orbax-checkpoint-
# tmp<suffix>" (renamed to "<step>" once complete).
_UNFINISHED = re.compile(r"^(\d+)" + re.escape(ocp.path.atomicity_types.TMP_DIR_SUFFIX))


def _to_tree(state: TrainState) -> dict[str, Any]:
  # None fields (no reference, no critic) are left out: they hold nothing to save.
  return {name: getattr(state, name) for name in _FIELDS if getattr(state, name) is not None}


def _abstract(tree: Any) -> Any:
  """Shape, dtype and sharding of every array: the restore target that places each shard."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class NoSpaceForCheckpoint(OSError):
  """The disk under a run's checkpoints cannot hold the next one."""


def bytes_written(tree: Any) -> int:
  """The bytes this process writes for `tree`'s arrays: its shards of replica 0."""
  def written(x: Any) -> int:
    if not isinstance(x, jax.Array):
      return np.asarray(x).nbytes
    return sum(shard.data.nbytes for shard in x.addressable_shards if shard.replica_id == 0)
  return sum(written(x) for x in jax.tree.leaves(tree))


def interrupted_saves(directory: str) -> list[int]:
  """The steps whose save under `directory` was started but never completed (the process was
  killed while writing them), in order."""
  if not os.path.isdir(directory):
    return []
  found = (_UNFINISHED.match(name) for name in os.listdir(directory))
  return sorted({int(m.group(1)) for m in found if m})


class Checkpointer:
  """Saves and restores (TrainState, meta) under `directory`.

  Args:
    directory: where step directories are written (created if missing).
    keep: checkpoints kept; older ones are deleted once a newer one is complete.
    async_save: write in a background thread (the arrays are copied first, so the update can
      donate and overwrite its buffers right away).
    read_only: open existing checkpoints for reading only (e.g. to list their steps).

  `interrupted` lists the steps whose save a killed process left incomplete (found when it was
  opened for writing; their temporary directories are then deleted).
  """

  def __init__(self, directory: str, keep: int = 1, async_save: bool = True,
               read_only: bool = False):
    if keep < 1:
      raise ValueError(f"checkpoint.keep must be >= 1, got {keep}.")
    self.directory = os.path.abspath(directory)
    # Read before the manager deletes them.
    self.interrupted = [] if read_only else interrupted_saves(self.directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                           enable_async_checkpointing=async_save,
                                           read_only=read_only,
                                           cleanup_tmp_directories=not read_only)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: TrainState, meta: dict[str, Any]) -> None:
    """Starts saving `state` and `meta` as checkpoint `step` (returns before it is written).

    Raises:
      NoSpaceForCheckpoint: the disk has less free space than the checkpoint needs (nothing is
        written; the older checkpoints stay).
    """
    self._manager.wait_until_finished()  # a save still being written takes its space first
    tree = _to_tree(state)
    needed, free = bytes_written(tree), shutil.disk_usage(self.directory).free
    if needed > free:
      raise NoSpaceForCheckpoint(
          f"Checkpoint {step} needs {needed / 2**30:.2f} GiB and {self.directory} has "
          f"{free / 2**30:.2f} GiB free: free disk space and rerun "
          f"with the same --workdir to resume from the last checkpoint.")
    args = ocp.args.Composite(state=ocp.args.StandardSave(tree),
                              meta=ocp.args.JsonSave(dict(meta, step=int(step))))
    self._manager.save(int(step), args=args, force=True)

  def restore(self, template: TrainState, step: int | None = None
              ) -> tuple[TrainState, dict[str, Any]]:
    """Loads checkpoint `step` (default: the latest) laid out like `template`.

    Args:
      template: a TrainState with the run's structure and shardings (e.g. the freshly
        initialised one); only shapes, dtypes and shardings are read from it.
    Returns:
      (state, meta).
    Raises:
      FileNotFoundError: there is no checkpoint.
      ValueError: the checkpoint's arrays do not match the template (another model or
        algorithm was configured for this workdir).
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}.")
    args = ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(_to_tree(template))),
                              meta=ocp.args.JsonRestore())
    try:
      restored = self._manager.restore(step, args=args)
    except (ValueError, KeyError) as e:
      raise ValueError(f"Checkpoint {step} in {self.directory} does not match the configured "
                       f"model/algorithm (was the config changed for this workdir?): {e}") from e
    fields = dict(restored["state"])
    state = template.replace(**fields)
    logging.info("Restored checkpoint %d from %s.", step, self.directory)
    return state, dict(restored["meta"])

  def wait(self) -> None:
    """Blocks until every started save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()


def export_hf(policy_def: nnx.GraphDef, params: Any, tok: Any, directory: str) -> None:
  """Writes the policy and its tokenizer as an HF checkpoint directory transformers loads."""
  save_hf(nnx.merge(policy_def, params), directory)
  tok.save_pretrained(directory)
  logging.info("Exported the policy to %s.", directory)
