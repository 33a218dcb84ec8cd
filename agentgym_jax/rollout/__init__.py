"""Rollout: jitted sampler, multi-turn episode runner, Trajectory batch, and `envs`, the one
module that meets the environments (pools, task splits, expert play, all from `EnvSettings`).

    settings = agentgym_jax.settings.rollout(config)   # or RolloutSettings(group_size=n, ...)
    traj, stats = run_episodes((graphdef, state), tok, pool, task_ids, settings, rng=key)
"""

from agentgym_jax.rollout import envs
from agentgym_jax.rollout.episodes import run_episodes
from agentgym_jax.rollout.records import save_jsonl
from agentgym_jax.rollout.sampler import SamplingConfig
from agentgym_jax.rollout.settings import RolloutSettings
from agentgym_jax.rollout.trajectory import Trajectory, build_trajectory

__all__ = ["RolloutSettings", "SamplingConfig", "Trajectory", "build_trajectory", "envs",
           "run_episodes", "save_jsonl"]
