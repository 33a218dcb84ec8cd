"""agentgym_jax: multi-turn reinforcement learning for LLM agents, in JAX.

Subpackages: `models` (decoder, value model, KV cache, checkpoint import/export), `rollout`
(sampler, episode runner, trajectories), `rl` (advantages, losses, horizon schedules), `train`
(train state, update, trainer loop, checkpoints). Environments live in the sibling package
`environments` and are reached only through the text-env interface.
"""
