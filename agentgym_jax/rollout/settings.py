"""How episodes are rolled out, as one object: `RolloutSettings`, built once from the config.

Training, evaluation and replay all sample through `run_episodes(policy, tok, pool, task_ids,
settings, rng=...)`; each gets its settings from the config's one door
(agentgym_jax/settings.py:rollout) and changes what differs for it with `dataclasses.replace`
(the trainer: the turn limit of the step's ScalingInter phase; evaluation: its temperature,
reply cap, samples per task and turn limit), so a replay samples exactly as the run did and an evaluation as the run's rollouts do
in everything it does not set itself.
"""

from __future__ import annotations

import dataclasses

from agentgym_jax.rollout.sampler import SamplingConfig


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """Everything about a rollout but the policy, the environments and the tasks.

  Attributes:
    sampling: temperature / top-p / top-k / per-turn token cap.
    group_size: episodes per task (rows i*n .. i*n+n-1 share group id i).
    max_turns: agent turns per episode at most (the horizon).
    max_context: tokens per episode at most; a turn starts only if its reply fits.
    system_prompt: system message; None leaves it to the chat template (Qwen2.5 then inserts
      its default system line).
    replicas: independent batches the episodes are split into, each on its own slice of the
      mesh's data axis (rollout/episodes.py).
    history_turns: k, the turns a turn's context keeps after the opening (rollout/window.py);
      0 keeps them all. The trajectory still holds each episode whole.
    overlap_env: two cohorts per replica take turns, one decoding while the other's
      environments step; False runs every turn in lock-step.
    invalid_action_reward: added to the reward of each turn whose action the environment
      refused (`info["invalid_action"]`); success and score are the environment's.
    acknowledgement: the agent's canned reply to the instruction; None: the environment's
      (`info["acknowledgement"]`, else the pool's env class attribute, else AgentGym's).
    max_chunk: most tokens of a chunk appended in one extend call (longer ones are split).
    compact: shrink the batch when at most half the rows are still running.
    grow_cache: start the KV cache small and grow it as rows need; False allocates
      `max_context` slots at once (no copies as it grows). Either way attention reads only the
      power-of-two bucket the rows fill (`sampler.cache_bucket`), one program per bucket.
  """

  sampling: SamplingConfig = SamplingConfig()
  group_size: int = 1
  max_turns: int = 10
  max_context: int = 4096
  system_prompt: str | None = None
  replicas: int = 1
  history_turns: int = 0
  overlap_env: bool = False
  invalid_action_reward: float = 0.0
  acknowledgement: str | None = None
  max_chunk: int = 512
  compact: bool = True
  grow_cache: bool = True

  def __post_init__(self):
    if self.group_size < 1 or self.max_turns < 1:
      raise ValueError(f"group_size and max_turns must be >= 1, got {self.group_size}, "
                       f"{self.max_turns}.")
    if self.history_turns < 0:
      raise ValueError(f"history_turns must be >= 0 (0 keeps every turn), got "
                       f"{self.history_turns}.")
