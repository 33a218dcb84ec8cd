r"""Regenerates saved training episodes and says whether they come out the same.

  python -m agentgym_jax.replay WORKDIR --step N [--episode K ...] [--mode=batch|episodes] \
      [--config=FILE[:arg] --config.a.b=v ...]

Step N's saved episodes (WORKDIR/trajectories/step_N.jsonl) were sampled by the policy after
N - 1 steps: checkpoint N - 1 of the workdir, or for N = 1 the initial policy, which is rebuilt
from the config. When that checkpoint is absent (`checkpoint.every_steps` and `keep` decide
which exist) the command says so and names the steps it has. Each record's "replay" field
(train/provenance.py) gives the rest: the step's tasks, group size, turn limit and sampler key,
the episode's row, the hash of the config that sampled it (whose copy the workdir keeps) and
a checksum of the sampling policy. `--episode` (repeatable) picks rows of the batch; default:
every saved one. `--config` replays under another config than the recorded one (a changed
environment, say); the report then lists the changed fields.

What is guaranteed. Episode e of a batch draws with its own key (split(key, B)[e], folded with
the turn number), so its random numbers do not depend on the other episodes; its logits do, in
the last bits: the batch's size, the width of each extend call (set by the longest new chunk)
and the KV cache's length (set by the longest row) change how XLA sums. On the keypad runlocal
run, replaying one episode alone gave the same tokens with log-probs up to 5e-7 away from the
run's. A token comes out otherwise only where the sampler's draw falls within that rounding of
the boundary between two tokens: rare, not excluded. Hence two modes:

  batch (default)  the whole batch of step N again, the same tasks in the same rows, compared on
                   the chosen episodes: bit for bit, the same tokens and the same float32
                   log-probs (checked against the recorded digest), given the same config,
                   checkpoint, environment, device layout (devices, processes,
                   rollout.replicas) and software. Costs a whole step's rollout.
  episodes         only the chosen episodes, in one batch: the same tokens but for such a
                   boundary; log-probs about 1e-6 away (reported against the file's 4-decimal
                   values).

The report: one line each on the config (against the one that sampled), the policy (its
checksum against the recorded one) and the device layout, then per episode "identical" or its
first difference: the first differing token (position, turn and role, both ids and texts),
else the first differing turn text (reply, parsed action, observation, reward; the final
observation is not among the tokens), else the outcome, else the log-probs. Exit status 0 when
every episode is reproduced to the mode's guarantee, 1 otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import app, flags

from agentgym_jax import cli
from agentgym_jax import multihost
from agentgym_jax import policies
from agentgym_jax import settings as settings_lib
from agentgym_jax import sharding as sharding_lib
from agentgym_jax.rollout import RolloutSettings, envs, run_episodes
from agentgym_jax.train import checkpoints, provenance, trajectories
from agentgym_jax.train import state as state_lib

MODES = ("batch", "episodes")
# Per-episode outcome fields of a record, compared after the tokens and the turns.
_OUTCOME = ("num_turns", "stop_reason", "success", "score", "reward", "terminated", "truncated")
_TURN_FIELDS = ("agent", "action", "observation", "reward")


class ReplayError(ValueError):
  """A replay that cannot run; the message says why and what to do, in one line."""


@dataclasses.dataclass(frozen=True)
class Verdict:
  """How one replayed episode compares with its record.

  difference: the first difference in tokens, turn texts or outcome (None: none).
  bitwise: the replayed log-probs are the recorded float32 values exactly (digest equal).
  logprob_gap: max |recorded - replayed| over sampled tokens, at the file's 4 decimals.
  """

  episode: int
  task_id: int
  num_tokens: int
  difference: str | None
  bitwise: bool
  logprob_gap: float

  def reproduced(self, mode: str) -> bool:
    return self.difference is None and (self.bitwise or mode == "episodes")

  def line(self) -> str:
    head = f"episode {self.episode} (task {self.task_id}):"
    if self.difference is not None:
      return f"{head} DIFFERS at {self.difference}"
    if self.bitwise:
      return f"{head} identical: {self.num_tokens} tokens, log-probs bit for bit"
    gap = ("equal at the file's 4 decimals" if self.logprob_gap == 0 else
           f"up to {self.logprob_gap:.4f} from the file's 4-decimal values")
    return f"{head} identical tokens ({self.num_tokens}); log-probs not bit for bit, {gap}"


# ----- the records ----------------------------------------------------------------------------

def saved_steps(workdir: str) -> list[int]:
  folder = os.path.join(workdir, trajectories.TRAJECTORY_DIR)
  names = os.listdir(folder) if os.path.isdir(folder) else []
  return sorted(int(m.group(1)) for m in map(re.compile(r"step_(\d+)\.jsonl$").match, names) if m)


def read_step(workdir: str, step: int) -> list[dict[str, Any]]:
  """The saved records of step `step`, each with its "replay" field."""
  path = trajectories.step_path(workdir, step)
  if not os.path.exists(path):
    raise ReplayError(f"{workdir} saved no episodes of step {step} (saved steps: "
                      f"{saved_steps(workdir)}; log.trajectories_every sets which are saved).")
  with open(path) as f:
    records = [json.loads(line) for line in f if line.strip()]
  if not records or any("replay" not in r for r in records):
    raise ReplayError(f"{path} has no replay records: it was written by behaviour cloning "
                      "(nothing was sampled) or by a trainer older than replay; train anew.")
  return records


def select(records: list[dict[str, Any]], episodes: Sequence[int] | None
           ) -> list[dict[str, Any]]:
  """The records of batch rows `episodes` (None: all saved ones), in row order."""
  by_row = {r["replay"]["episode"]: r for r in records}
  wanted = sorted(set(by_row if episodes is None else episodes))
  missing = [k for k in wanted if k not in by_row]
  if missing:
    raise ReplayError(f"episode(s) {missing} of step {records[0]['replay']['step']} were not "
                      f"saved (saved: {sorted(by_row)}; log.trajectories_episodes keeps the "
                      "batch's first rows).")
  return [by_row[k] for k in wanted]


# ----- what the replay runs with --------------------------------------------------------------

def recorded_config(workdir: str, info: dict[str, Any]) -> ml_collections.ConfigDict:
  path = provenance.config_path(workdir, info["config_hash"])
  if not os.path.exists(path):
    raise ReplayError(f"{path}, the config that sampled step {info['step']}, is missing; pass "
                      "the run's config with --config=FILE[:arg] (and its overrides).")
  return provenance.load_config(path)


def config_note(workdir: str, info: dict[str, Any], config: ml_collections.ConfigDict) -> str:
  digest = provenance.config_hash(config)
  if digest == info["config_hash"]:
    return f"config: the one that sampled step {info['step']} (hash {digest})"
  path = provenance.config_path(workdir, info["config_hash"])
  changes = (provenance.config_changes(provenance.rollout_fields(provenance.load_config(path)),
                                       provenance.rollout_fields(config))
             if os.path.exists(path) else ["the recorded config's copy is missing"])
  return (f"config: NOT the one that sampled step {info['step']} (hash {info['config_hash']}, "
          f"this one {digest}): {'; '.join(changes)}")


def checkpoint_steps(workdir: str) -> list[int]:
  directory = os.path.join(workdir, policies.CHECKPOINT_DIR)
  if not os.path.isdir(directory):
    return []
  ckpt = checkpoints.Checkpointer(directory, read_only=True)
  try:
    return sorted(ckpt.all_steps())
  finally:
    ckpt.close()


def sampling_policy(policy: policies.PolicySettings, env: envs.EnvSettings, workdir: str,
                    info: dict[str, Any], mesh: jax.sharding.Mesh
                    ) -> tuple[Any, Any, Any, str]:
  """(graphdef, params, tokenizer, where from) of the policy that sampled `info`'s step.

  Raises:
    ReplayError: its checkpoint is absent (the available steps named) or does not load.
  """
  wanted, available = info["policy_step"], checkpoint_steps(workdir)
  if wanted in available:
    try:
      graphdef, params, tok, _ = policies.load_policy(policy, env, workdir, mesh=mesh,
                                                      step=wanted)
    except (FileNotFoundError, ValueError) as e:  # restore_policy's one-line reasons
      raise ReplayError(f"checkpoint {wanted} of {workdir}: {e}") from e
    return graphdef, params, tok, f"checkpoint {wanted}"
  if wanted == 0:
    tok = policies.load_tokenizer(policy, env, workdir)
    graphdef, params = state_lib.split_params(policies.build_policy(policy, tok, mesh))
    return graphdef, params, tok, "the initial policy, rebuilt from the config"
  raise ReplayError(f"step {info['step']}'s episodes were sampled by the policy after step "
                    f"{wanted}, and {workdir} has no checkpoint {wanted} (it has {available}); "
                    "checkpoint.every_steps and checkpoint.keep decide which are kept.")


def policy_note(info: dict[str, Any], source: str, checksum: list[float]) -> str:
  if provenance.checksums_match(checksum, info["policy_checksum"]):
    return f"policy: {source}, checksum as recorded"
  return (f"policy: {source} is NOT the policy that sampled step {info['step']}: checksum "
          f"{checksum} vs recorded {info['policy_checksum']}")


def layout_note(info: dict[str, Any], devices: int) -> str:
  sampled = f"{info['devices']} device(s) in {info['processes']} process(es)"
  if (info["devices"], info["processes"]) == (devices, 1):
    return f"layout: {sampled}, as sampled"
  return (f"layout: sampled on {sampled}, replayed on {devices} in 1: bit-exactness needs the "
          "same layout")


# ----- comparison -----------------------------------------------------------------------------

def _tokens(record: dict[str, Any]) -> list[int]:
  return [t for seg in record["segments"] for t in seg["tokens"]]


def _logprobs(record: dict[str, Any]) -> list[float]:
  return [x for seg in record["segments"] if seg["loss_mask"] for x in seg["logprobs"]]


def _where(record: dict[str, Any], index: int) -> str:
  """"token i (turn t reply)": where token `index` of `record` lies."""
  for seg in record["segments"]:
    if seg["start"] <= index < seg["start"] + len(seg["tokens"]):
      part = ("opening prompt" if seg["role"] == "prompt" else
              f"turn {seg['turn']} {'reply' if seg['role'] == 'agent' else 'observation'}")
      return f"token {index} ({part})"
  return f"token {index} (past the end)"


def first_difference(recorded: dict[str, Any], replayed: dict[str, Any],
                     decode: Callable[[list[int]], str]) -> str | None:
  """The first difference in tokens, then turn texts, then outcome; None if there is none."""
  a, b = _tokens(recorded), _tokens(replayed)
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return (f"{_where(recorded, i)}: recorded {x} {decode([x])!r}, replayed {y} "
              f"{decode([y])!r}")
  if len(a) != len(b):
    shorter = recorded if len(a) < len(b) else replayed
    return (f"{_where(recorded if len(a) > len(b) else replayed, min(len(a), len(b)))}: "
            f"recorded {len(a)} tokens, replayed {len(b)}; the "
            f"{'recorded' if shorter is recorded else 'replayed'} episode ends there")
  for old, new in zip(recorded["turns"], replayed["turns"]):
    for field in _TURN_FIELDS:
      if old[field] != new[field]:
        return f"turn {old['turn']} {field}: recorded {old[field]!r}, replayed {new[field]!r}"
  for field in _OUTCOME:
    if recorded[field] != replayed[field]:
      return f"outcome {field}: recorded {recorded[field]!r}, replayed {replayed[field]!r}"
  return None


def compare(recorded: dict[str, Any], replayed: dict[str, Any], digest: str,
            decode: Callable[[list[int]], str]) -> Verdict:
  """`recorded` (a saved record) against `replayed` (`trajectories.step_records` of the
  replay), whose float32 log-probs have sha256 `digest`."""
  difference = first_difference(recorded, replayed, decode)
  old, new = _logprobs(recorded), _logprobs(replayed)
  gap = (float(np.max(np.abs(np.subtract(old, new)))) if difference is None and old else 0.0)
  return Verdict(episode=recorded["replay"]["episode"], task_id=recorded["task_id"],
                 num_tokens=recorded["num_tokens"], difference=difference,
                 bitwise=digest == recorded["replay"]["logprobs_sha256"], logprob_gap=gap)


# ----- replay ---------------------------------------------------------------------------------

def regenerate(env: envs.EnvSettings, rollout: RolloutSettings, graphdef: Any, params: Any,
               tok: Any, info: dict[str, Any], rows: np.ndarray | None,
               mesh: jax.sharding.Mesh) -> tuple[list[dict[str, Any]], list[str]]:
  """Samples step `info["step"]`'s batch again (only `rows`, if given) as the trainer did,
  with the run's environments and rollout settings; returns the records of the rows sampled
  and their log-prob digests."""
  key = jax.random.wrap_key_data(np.asarray(info["rollout_key"], np.uint32))
  with envs.make_pool(env) as pool:
    settings = dataclasses.replace(rollout, max_turns=info["max_turns"])
    traj, stats = run_episodes((graphdef, params), tok, pool, info["task_ids"], settings,
                               rng=key, mesh=mesh, rows=rows)
  host = jax.device_get(traj)
  records = trajectories.step_records(info["step"], host, stats["episodes"], tok.decode,
                                      host.batch_size)
  return records, [provenance.logprobs_digest(host, r) for r in range(host.batch_size)]


def replay(workdir: str, step: int, episodes: Sequence[int] | None = None,
           mode: str = "batch", config: ml_collections.ConfigDict | None = None
           ) -> tuple[list[str], list[Verdict]]:
  """Replays the saved episodes `episodes` (rows of the batch; None: all saved) of step `step`.

  Args:
    workdir: the training run's workdir.
    step: the step whose saved episodes to replay (N of trajectories/step_N.jsonl).
    episodes: rows of that step's batch.
    mode: "batch" or "episodes" (module docstring).
    config: replay under this config (default: the recorded one that sampled the step).
  Returns:
    (notes on config, policy and layout; one Verdict per episode, in row order).
  Raises:
    ReplayError: the step, an episode, the config copy or the checkpoint is missing.
  """
  if mode not in MODES:
    raise ReplayError(f"mode must be one of {MODES}, got {mode!r}.")
  chosen = select(read_step(workdir, step), episodes)
  info = chosen[0]["replay"]
  config = recorded_config(workdir, info) if config is None else config
  mesh = sharding_lib.make_mesh(config.mesh)
  env = multihost.process_env(settings_lib.env(config))
  graphdef, params, tok, source = sampling_policy(settings_lib.policy(config), env, workdir,
                                                  info, mesh)
  notes = [config_note(workdir, info, config),
           policy_note(info, source, provenance.policy_checksum(params)),
           layout_note(info, mesh.size)]
  rows = np.asarray([r["replay"]["episode"] for r in chosen])
  records, digests = regenerate(env, settings_lib.rollout(config), graphdef, params, tok, info,
                                None if mode == "batch" else rows, mesh)
  index = rows if mode == "batch" else np.arange(len(rows))
  verdicts = [compare(recorded, records[i], digests[i], tok.decode)
              for recorded, i in zip(chosen, index)]
  return notes, verdicts


# ----- command line ---------------------------------------------------------------------------

def main(argv: Sequence[str]) -> None:
  if len(argv) != 2:
    cli.fatal(f"pass one training workdir, e.g. python -m agentgym_jax.replay WORKDIR --step 2 "
              f"--episode 0; got {list(argv[1:])}")
  workdir, mode = argv[1], _MODE.value
  if not os.path.isdir(workdir):
    cli.fatal(f"{workdir} is not a directory; pass a training run's workdir.")
  cli.log_to(None)
  config = cli.config_from_flag() if flags.FLAGS["config"].present else None
  if config is not None:
    settings_lib.checked_env(config)
  try:
    notes, verdicts = replay(workdir, _STEP.value, _EPISODE.value, mode, config)
  except ReplayError as e:
    cli.fatal(e)
  print(f"Replay of step {_STEP.value} of {workdir} ({mode} mode):")
  for line in notes + [v.line() for v in verdicts]:
    print(f"  {line}")
  raise SystemExit(0 if all(v.reproduced(mode) for v in verdicts) else 1)


if __name__ == "__main__":
  cli.define_config_flag("Replay under this config file[:arg] instead of the recorded one.")
  _STEP = flags.DEFINE_integer("step", None, "The step whose saved episodes to replay.")
  _EPISODE = flags.DEFINE_multi_integer(
      "episode", None, "A row of the step's batch (repeatable; default: every saved one).")
  _MODE = flags.DEFINE_enum("mode", "batch", list(MODES),
                            "batch: the step's whole batch, bit for bit; episodes: only these.")
  flags.mark_flags_as_required(["step"])
  app.run(main, flags_parser=cli.parse_flags)
