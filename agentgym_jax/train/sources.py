"""The trainer's own sources beside the policy (`agentgym_jax.policies`): the order of the
steps' tasks, the demonstrations of behaviour cloning, cached on disk (the environment's
expert plays them through `rollout.envs`), and the critic, started from the policy's backbone.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from agentgym_jax import caches
from agentgym_jax import sharding as sharding_lib
from agentgym_jax.models import Decoder, ValueModel
from agentgym_jax.rollout import demonstrations as demos_lib
from agentgym_jax.rollout import envs
from agentgym_jax.rollout.trajectory import Episode
from agentgym_jax.tokenization import ChatTokenizer
from agentgym_jax.train import data


def task_stream(config: ml_collections.ConfigDict, demos: Sequence[Episode] = ()
                ) -> data.TaskStream | data.MixtureStream:
  """The order in which steps take their tasks (`envs.training_tasks`), or with `demos`
  (behaviour cloning) the indices of the demonstrations; a mixture's takes each environment's
  by its ratio (`data.MixtureStream`, a demonstration's environment read from its task id)."""
  if not envs.is_mixture(config):
    return data.TaskStream(envs.training_tasks(config) if not demos else range(len(demos)),
                           config.seed)
  members = envs.members(config)
  if demos:
    environment = [envs.environment_of(config, e.task_id) for e in demos]
    own = [[i for i, label in enumerate(environment) if label == m.label] for m in members]
  else:
    own = [[m.encode(t) for t in envs.training_tasks(m.config)] for m in members]
  return data.MixtureStream([data.TaskStream(ids, config.seed) for ids in own],
                            [m.ratio for m in members])


def demonstrations(config: ml_collections.ConfigDict, tok: ChatTokenizer) -> list[Episode]:
  """The expert's episodes of the first `bc.num_tasks` training tasks (`envs.training_tasks`;
  taken from each category in turn with `bc.balance_categories`), cached on disk.

  Played by `demonstrations.expert_episodes` with the runner's limits: the schedule's longest horizon,
  `rollout.max_context` and `rollout.max_reply_tokens`. A mixture's: each environment's
  `bc.num_tasks` demonstrations (its own limits, prompt and cache), task ids the mixed run's.
  """
  if envs.is_mixture(config):
    episodes = []
    for m in envs.members(config):
      for e in demonstrations(m.config, tok):
        e.task_id = m.encode(e.task_id)
        episodes.append(e)
    return episodes
  task_ids = envs.training_tasks(config)
  if config.bc.balance_categories:
    task_ids = envs.interleave_categories(config, task_ids)
  task_ids = task_ids[:config.bc.num_tasks] if config.bc.num_tasks else task_ids
  settings = {
      "env": config.env.name, "env_kwargs": config.env.kwargs.to_dict(),
      "num_tasks": len(task_ids), "task_ids": task_ids,
      "max_turns": max(config.schedule.horizons), "max_context": config.rollout.max_context,
      "max_reply_tokens": config.rollout.max_reply_tokens, "noise": config.bc.noise,
      "drop_thought": config.bc.drop_thought, "seed": config.seed,
      "system_prompt": config.env.system_prompt,
      "tokenizer": demos_lib.tokenizer_fingerprint(tok),
  }
  cache_dir = config.bc.cache_dir or caches.user_cache_dir("demonstrations")
  path = demos_lib.cache_path(cache_dir, config.env.name, settings)

  return demos_lib.load_or_build(path, settings,
                                 lambda: demos_lib.expert_episodes(config, tok, task_ids))


def build_critic(policy: Decoder, seed: int, mesh: Mesh) -> ValueModel:
  """A value model on `mesh` whose backbone starts as a copy of the policy's (head at zero).

  The value model is created sharded and then given copies of the policy's backbone arrays,
  so no full-size array is ever built on one device and the two never share buffers.
  """
  critic = sharding_lib.sharded_init(
      lambda: ValueModel(policy.cfg, rngs=nnx.Rngs(seed + 1)), mesh)
  nnx.update(critic.backbone, jax.tree.map(jnp.copy, nnx.state(policy.backbone, nnx.Param)))
  return critic
