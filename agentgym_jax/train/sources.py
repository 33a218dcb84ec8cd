"""The trainer's own sources beside the policy (`agentgym_jax.policies`): the order of the
steps' tasks, the demonstrations of behaviour cloning, cached on disk (the environment's
expert plays them through `rollout.envs`), and the critic, started from the policy's backbone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from agentgym_jax import caches
from agentgym_jax import settings as settings_lib
from agentgym_jax import sharding as sharding_lib
from agentgym_jax.models import Decoder, ValueModel
from agentgym_jax.rollout import demonstrations as demos_lib
from agentgym_jax.rollout import envs
from agentgym_jax.rollout.trajectory import Episode
from agentgym_jax.tokenization import ChatTokenizer
from agentgym_jax.train import data


def task_stream(env: envs.EnvSettings, seed: int, demos: Sequence[Episode] = ()
                ) -> data.TaskStream | data.MixtureStream:
  """The order in which steps take their tasks (`envs.training_tasks`), or with `demos`
  (behaviour cloning) the indices of the demonstrations; a mixture's takes each environment's
  by its ratio (`data.MixtureStream`, a demonstration's environment read from its task id)."""
  if not env.is_mixture:
    return data.TaskStream(envs.training_tasks(env) if not demos else range(len(demos)), seed)
  if demos:
    environment = [envs.environment_of(env, e.task_id) for e in demos]
    own = [[i for i, label in enumerate(environment) if label == m.label] for m in env.mix]
  else:
    own = [[m.encode(t) for t in envs.training_tasks(m.env)] for m in env.mix]
  return data.MixtureStream([data.TaskStream(ids, seed) for ids in own],
                            [m.ratio for m in env.mix])


def demonstrations(config: ml_collections.ConfigDict, env: envs.EnvSettings,
                   tok: ChatTokenizer) -> list[Episode]:
  """The expert's episodes of the first `bc.num_tasks` training tasks of `env` (this
  process's environments; `envs.training_tasks`, taken from each category in turn with
  `bc.balance_categories`), cached on disk.

  Played by `demonstrations.expert_episodes` with `settings.expert(config)`: the runner's
  limits and the noise of `config.bc`. A mixture's: each environment's `bc.num_tasks`
  demonstrations (its own turn cap, prompt and cache), task ids the mixed run's.
  """
  expert = settings_lib.expert(config)
  if not env.is_mixture:
    return _demonstrations(config.bc, env, expert, tok)
  episodes = []
  for m in env.mix:
    capped = expert.max_turns if not m.max_turns else min(expert.max_turns, m.max_turns)
    for e in _demonstrations(config.bc, m.env, dataclasses.replace(expert, max_turns=capped),
                             tok):
      e.task_id = m.encode(e.task_id)
      episodes.append(e)
  return episodes


def _demonstrations(bc: ml_collections.ConfigDict, env: envs.EnvSettings,
                    expert: demos_lib.ExpertSettings, tok: ChatTokenizer) -> list[Episode]:
  """One environment's demonstrations (`demonstrations`), read from or written to the cache."""
  task_ids = envs.training_tasks(env)
  if bc.balance_categories:
    task_ids = envs.interleave_categories(env, task_ids)
  task_ids = task_ids[:bc.num_tasks] if bc.num_tasks else task_ids
  settings = {
      "env": env.name, "env_kwargs": dict(env.kwargs),
      "num_tasks": len(task_ids), "task_ids": task_ids,
      "max_turns": expert.max_turns, "max_context": expert.max_context,
      "max_reply_tokens": expert.max_reply_tokens, "noise": expert.noise,
      "drop_thought": expert.drop_thought, "seed": expert.seed,
      "system_prompt": env.system_prompt,
      "tokenizer": demos_lib.tokenizer_fingerprint(tok),
  }
  cache_dir = bc.cache_dir or caches.user_cache_dir("demonstrations")
  path = demos_lib.cache_path(cache_dir, env.name, settings)
  return demos_lib.load_or_build(path, settings,
                                 lambda: demos_lib.expert_episodes(env, tok, task_ids, expert))


def build_critic(policy: Decoder, seed: int, mesh: Mesh) -> ValueModel:
  """A value model on `mesh` whose backbone starts as a copy of the policy's (head at zero).

  The value model is created sharded and then given copies of the policy's backbone arrays,
  so no full-size array is ever built on one device and the two never share buffers.
  """
  critic = sharding_lib.sharded_init(
      lambda: ValueModel(policy.cfg, rngs=nnx.Rngs(seed + 1)), mesh)
  nnx.update(critic.backbone, jax.tree.map(jnp.copy, nnx.state(policy.backbone, nnx.Param)))
  return critic
