"""Expert demonstrations for behaviour cloning, in the token layout the episode runner samples.

An environment's expert plays each task while this module writes the conversation exactly as
`episodes.run_episodes` would have: the same opening (system, instruction, acknowledgement,
first observation) encoded with `ChatTokenizer.encode_opening`, each agent turn as the reply's
ids plus the end-of-turn id (loss_mask 1), each observation as `encode_observation`'s chunk
(loss_mask 0), and the same stop rules (terminated, env_truncated, max_turns, context). The
cross-entropy of behaviour cloning therefore trains the very tokens RL later samples and
scores, and a BC checkpoint starts RL on familiar ground.

A weaker teacher leaves RL some headroom: with probability `noise` a turn's action is replaced
by a uniformly drawn valid one (`TextEnv.random_action`), and with probability `drop_thought`
the reply carries the action alone, without its "Thought:" text. The expert then continues
from wherever the noisy action led (experts that replan recover; open-loop ones such as
ScienceWorld's gold path may not).

Demonstrations are cached as JSONL: a header line with the settings that produced them, then
one episode per line with its token ids, masks, rewards and the conversation as text. The file
name hashes the settings (tokenizer included), so a run reuses exactly the demonstrations it
would have generated, and a changed setting generates a new file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import dataclasses
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from agentgym_jax.rollout import envs
from agentgym_jax.rollout.envs import DEFAULT_ACKNOWLEDGEMENT
from agentgym_jax.rollout.episodes import opening_messages
from agentgym_jax.rollout.trajectory import Episode
from agentgym_jax.tokenization import ChatTokenizer

CACHE_FORMAT = "agentgym_jax.demonstrations/1"
# Episode fields stored per line; together they rebuild the Episode exactly.
_FIELDS = ("task_id", "tokens", "loss_mask", "turn_index", "turn_rewards", "messages",
           "num_turns", "reward", "success", "score", "terminated", "truncated", "stop_reason")


def play_expert(env: Any, tok: ChatTokenizer, task_id: int, *, max_turns: int,
                max_context: int, max_reply_tokens: int, rng: random.Random,
                noise: float = 0.0, drop_thought: float = 0.0,
                system_prompt: str | None = None) -> tuple[Episode, list[str]]:
  """One expert-played episode of `task_id`, laid out as the episode runner lays out samples.

  Args:
    env: a `TextEnv` (in this process) with `expert_action` and `random_action`.
    tok: the policy's ChatTokenizer.
    task_id: the task to play.
    max_turns, max_context, max_reply_tokens: the runner's limits (a turn starts only if a
      reply of `max_reply_tokens` still fits in `max_context`).
    rng: draws the noise; the same seed gives the same episode.
    noise: probability of replacing a turn's expert action with a random valid one.
    drop_thought: probability of leaving the "Thought:" text out of a reply.
    system_prompt: the system message, as in the runner.
  Returns:
    (the finished Episode with group_id 0, the actions the expert would have taken, one per
    turn: equal to the actions played when noise is 0).
  """
  observation, info = env.reset(options={"task_id": task_id})
  episode = Episode(task_id=int(task_id), group_id=0)
  episode.messages = opening_messages(
      info, observation, system_prompt,
      getattr(env, "acknowledgement", DEFAULT_ACKNOWLEDGEMENT))
  episode.append(tok.encode_opening(episode.messages), turn=-1)
  expert_actions = []
  if len(episode.tokens) + max_reply_tokens > max_context:
    episode.finish("context", truncated=True)
    return episode, expert_actions
  for turn in range(max_turns):
    action = env.expert_action()
    expert_actions.append(action)
    if noise and rng.random() < noise:
      action = env.random_action(rng)
    reply = env.format_action(action, thought=not (drop_thought and rng.random() < drop_thought))
    ids = tok.encode_reply(reply)
    episode.append(ids, turn=turn, logprobs=[0.0] * len(ids))
    episode.messages.append({"role": "assistant", "content": reply})
    observation, reward, terminated, truncated, info = env.step(env.parse_action(reply))
    episode.record_step(reward, info)
    episode.messages.append({"role": "user", "content": observation})
    if terminated or truncated:
      episode.finish("terminated" if terminated else "env_truncated", terminated=terminated,
                     truncated=truncated)
      break
    if episode.num_turns >= max_turns:
      episode.finish("max_turns", truncated=True)
      break
    chunk = tok.encode_observation(observation)
    if len(episode.tokens) + len(chunk) + max_reply_tokens > max_context:
      episode.finish("context", truncated=True)
      break
    episode.append(chunk, turn=turn)
  return episode, expert_actions


def tokenizer_fingerprint(tok: ChatTokenizer) -> str:
  """A short hash of the vocabulary, merges and chat template: equal ids iff equal hash."""
  hf = tok.hf
  content = hf.backend_tokenizer.to_str() + str(getattr(hf, "chat_template", ""))
  return hashlib.sha256(content.encode()).hexdigest()[:16]


def _as_json(settings: dict[str, Any]) -> dict[str, Any]:
  """`settings` as a JSON file gives it back (tuples become lists), for comparisons."""
  return json.loads(json.dumps(settings))


def cache_path(cache_dir: str, env_name: str, settings: dict[str, Any]) -> str:
  """The JSONL file holding the demonstrations of `settings` (JSON-serialisable)."""
  digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
  return os.path.join(cache_dir, f"{env_name}-{digest}.jsonl")


def save(path: str, settings: dict[str, Any], episodes: Sequence[Episode]) -> None:
  """Writes the cache file atomically: a reader sees the old file or the whole new one."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".tmp")
  os.chmod(tmp, 0o644)  # a shared cache: readable by every user, as a normal file would be
  with os.fdopen(fd, "w") as f:
    f.write(json.dumps({"format": CACHE_FORMAT, "settings": settings}) + "\n")
    for e in episodes:
      f.write(json.dumps({k: getattr(e, k) for k in _FIELDS}) + "\n")
  os.replace(tmp, path)


def load(path: str, settings: dict[str, Any]) -> list[Episode]:
  """The episodes of a cache file written by `save` with the same `settings`.

  Raises:
    ValueError: the file is not such a cache, was written with other settings, or is cut off
      or damaged (the message names the file).
  """
  settings = _as_json(settings)
  try:
    with open(path) as f:
      header = json.loads(f.readline())
      if header.get("format") != CACHE_FORMAT or header.get("settings") != settings:
        raise ValueError("its header does not match the requested settings")
      episodes = []
      for line in f:
        fields = json.loads(line)
        episode = Episode(task_id=int(fields["task_id"]), group_id=0)
        for key in _FIELDS:
          setattr(episode, key, fields[key])
        if not (len(episode.tokens) == len(episode.loss_mask) == len(episode.turn_index)
                == len(episode.turn_rewards)):
          raise ValueError(f"episode of task {episode.task_id} has arrays of unequal length")
        episode.logprobs = [0.0] * len(episode.tokens)
        episodes.append(episode)
  except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
    raise ValueError(f"Demonstration cache {path} is unreadable ({exc}).") from exc
  except ValueError as exc:
    raise ValueError(f"Demonstration cache {path} is unusable: {exc}.") from exc
  if len(episodes) != settings.get("num_tasks", len(episodes)):
    raise ValueError(f"Demonstration cache {path} holds {len(episodes)} episodes, expected "
                     f"{settings['num_tasks']}: it was cut off.")
  return episodes


def load_or_build(path: str, settings: dict[str, Any], build: Callable[[], list[Episode]]
                  ) -> list[Episode]:
  """The cached demonstrations at `path`, built (and cached) when missing or damaged."""
  if os.path.exists(path):
    try:
      episodes = load(path, settings)
      logging.info("Read %d demonstrations from %s.", len(episodes), path)
      return episodes
    except ValueError as exc:
      logging.warning("%s Rebuilding it.", exc)
  episodes = build()
  save(path, settings, episodes)
  logging.info("Wrote %d demonstrations to %s.", len(episodes), path)
  return episodes


@dataclasses.dataclass(frozen=True)
class ExpertSettings:
  """How the expert plays a run's demonstrations: the runner's limits (the schedule's longest
  horizon, `rollout.max_context` and `rollout.max_reply_tokens`), `config.bc`'s noise and the
  run's seed (each task's noise draws from "<seed>-<task id>")."""

  max_turns: int
  max_context: int
  max_reply_tokens: int
  noise: float = 0.0
  drop_thought: float = 0.0
  seed: int = 0


def expert_episodes(env: envs.EnvSettings, tok: ChatTokenizer, task_ids: Sequence[int],
                    settings: ExpertSettings) -> list[Episode]:
  """The expert's episode of each of `task_ids` (`play_expert`) with `settings`, played in
  this process on `envs.make_env`'s environment, with `env.system_prompt`."""
  played = envs.make_env(env)
  try:
    return [play_expert(
        played, tok, task_id, max_turns=settings.max_turns, max_context=settings.max_context,
        max_reply_tokens=settings.max_reply_tokens,
        rng=random.Random(f"{settings.seed}-{task_id}"), noise=settings.noise,
        drop_thought=settings.drop_thought,
        system_prompt=env.system_prompt or None)[0] for task_id in task_ids]
  finally:
    played.close()
