"""What the trainer records so that a saved episode can be regenerated: `python -m
agentgym_jax.replay` reads it (that module's docstring says what replay guarantees).

Each saved step (`trajectories.save_step`) gets one `step_provenance` dict and each of its
episodes `episode_provenance(...)`, as the record's "replay" field:

  step, policy_step   steps completed (the file's N) and the policy that sampled: the state
                      after `policy_step` = N - 1 steps (0: the initial policy).
  episode             the row in the step's batch: the global episode index that keys the
                      episode's random stream (`rollout.episodes`: split(rollout_key, B)[row]).
  task_ids, group_size, max_turns
                      the step's batch: its tasks (each `group_size` times) and turn limit.
                      An environment's instance is a function of its task id (reset gets
                      options={"task_id": id} and no seed), so the task id is the env seed.
  rollout_key         the step's sampler key as raw key data (fold_in(fold_in(seed key, step),
                      stream), train/loop.py).
  policy_checksum     [sum, sum of squares] of the sampling policy's parameters (float32
                      per array): tells a replaced checkpoint apart; not a cryptographic hash.
  config_hash         `config_hash` of the run's config; the whole config is kept as
                      WORKDIR/configs/<hash>.json (`save_config`), so a resumed run with
                      another config does not lose the one that sampled earlier steps.
  devices, processes  the device layout that sampled (bit-exactness needs the same one).
  logprobs_sha256     digest of the episode's sampled-token log-probs as float32 bytes (the
                      file rounds them to 4 decimals): checks a replay bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from agentgym_jax import multihost
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.train import config as base

CONFIG_DIR = "configs"
# The config sections that shape a step's episodes: task order and init (seed, mode,
# init_from), the policy's architecture and tokens, the environment, the batch, sampling, the
# turn limit and the device layout. Logging, evaluation, checkpoint cadence and the update's
# hyper-parameters do not: the update reaches later episodes through the checkpoint, which
# `policy_checksum` covers.
ROLLOUT_FIELDS = ("seed", "mode", "init_from", "model", "tokenizer", "env", "data", "rollout",
                  "schedule", "mesh")


def config_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The config as JSON data (tuples as lists), as config.json holds it."""
  return json.loads(config.to_json_best_effort(sort_keys=True))


def rollout_fields(config: ml_collections.ConfigDict) -> dict[str, Any]:
  data = config_dict(config)
  return {name: data[name] for name in ROLLOUT_FIELDS}


def config_hash(config: ml_collections.ConfigDict) -> str:
  """16 hex digits of sha256 over the config's ROLLOUT_FIELDS."""
  text = json.dumps(rollout_fields(config), sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_path(workdir: str, digest: str) -> str:
  return os.path.join(workdir, CONFIG_DIR, f"{digest}.json")


def save_config(workdir: str, config: ml_collections.ConfigDict) -> str:
  """Writes the whole config to `config_path(workdir, config_hash(config))`; returns the hash."""
  digest = config_hash(config)
  os.makedirs(os.path.join(workdir, CONFIG_DIR), exist_ok=True)
  with open(config_path(workdir, digest), "w") as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  return digest


def _tuples(value: Any) -> Any:
  # JSON has lists where the config had tuples (the config's only sequences: docs/design.md).
  if isinstance(value, list):
    return tuple(_tuples(v) for v in value)
  if isinstance(value, dict):
    return {k: _tuples(v) for k, v in value.items()}
  return value


def load_config(path: str) -> ml_collections.ConfigDict:
  """A config saved by `save_config` (or a run's config.json), locked as the trainer's is;
  one saved before the estimator's options became data is read in today's fields."""
  with open(path) as f:
    return base.lock(ml_collections.ConfigDict(_tuples(_estimator_as_data(json.load(f)))))


def _estimator_as_data(saved: dict[str, Any]) -> dict[str, Any]:
  """Runs saved before `algo.estimator` named the estimator and `algo.estimator_kwargs` held
  its options (2026-12-05) have `algo.advantage`, grpo's `norm_adv_by_std` (False: Dr.GRPO),
  gigpo's `step_weight` and `step_norm`, turn_gae's `turn_gamma`: the same run in today's
  fields, so such runs can still be replayed."""
  algo = saved.get("algo", {})
  if "advantage" not in algo:
    return saved
  algo = dict(algo)
  estimator = algo.pop("advantage")
  if estimator == "grpo" and not algo.pop("norm_adv_by_std", True):
    estimator = "drgrpo"
  own = {"gigpo": ("step_weight", "step_norm"), "turn_gae": ("turn_gamma",)}.get(estimator, ())
  options = {name: algo[name] for name in own if name in algo}
  for name in ("norm_adv_by_std", "step_weight", "step_norm", "turn_gamma"):
    algo.pop(name, None)
  algo.update(estimator=estimator, estimator_kwargs=options)
  return {**saved, "algo": algo}


def config_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
  """"a.b: old -> new" for every leaf that differs between two JSON config dicts."""
  changes = []
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
    if isinstance(a, dict) and isinstance(b, dict):
      changes.extend(config_changes(a, b, f"{prefix}{key}."))
    elif a != b:
      changes.append(f"{prefix}{key}: {a!r} -> {b!r}")
  return changes


@jax.jit
def _sums(params: Any) -> tuple[jax.Array, jax.Array]:
  leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(params)]
  return (jnp.stack([jnp.sum(x) for x in leaves]), jnp.stack([jnp.sum(x * x) for x in leaves]))


def policy_checksum(params: Any) -> list[float]:
  """[sum, sum of squares] of all parameters (per-array float32 sums, added in float64)."""
  sums, squares = multihost.fetch(_sums(params))
  return [float(np.sum(sums, dtype=np.float64)), float(np.sum(squares, dtype=np.float64))]


def checksums_match(a: list[float], b: list[float], rtol: float = 1e-6) -> bool:
  """Equal up to the rounding of sums over another device layout."""
  return bool(np.allclose(a, b, rtol=rtol, atol=0.0))


def step_provenance(config: ml_collections.ConfigDict, step: int, task_ids: list[int],
                    rollout_key: jax.Array, max_turns: int, checksum: list[float],
                    devices: int) -> dict[str, Any]:
  """The replay facts shared by the episodes of the step that ran after `step - 1` steps."""
  return {
      "step": step, "policy_step": step - 1, "task_ids": [int(t) for t in task_ids],
      "group_size": config.data.group_size, "max_turns": max_turns,
      "rollout_key": [int(x) for x in np.asarray(jax.random.key_data(rollout_key)).ravel()],
      "policy_checksum": checksum, "config_hash": config_hash(config), "devices": devices,
      "processes": jax.process_count(),
  }


def logprobs_digest(traj: Trajectory, row: int) -> str:
  """16 hex digits of sha256 over row `row`'s sampled-token log-probs (float32 bytes)."""
  mask = np.asarray(traj.loss_mask[row], bool)
  values = np.asarray(traj.sample_logprobs[row], np.float32)[mask]
  return hashlib.sha256(values.tobytes()).hexdigest()[:16]


def episode_provenance(step_info: dict[str, Any], traj: Trajectory, row: int
                       ) -> dict[str, Any]:
  return {**step_info, "episode": row, "logprobs_sha256": logprobs_digest(traj, row)}
