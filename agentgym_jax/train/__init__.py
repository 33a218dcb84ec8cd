"""Training: train state, jitted update, trainer loop, checkpoints, metrics.

  python -m agentgym_jax.train --config=experiments/keypad/learn.py:runlocal --workdir=/tmp/w

  from agentgym_jax import policies, settings, sharding
  from agentgym_jax.train import loop
  loop.train(config, workdir)                         # resumes if workdir has a checkpoint
  graphdef, params, tok, step = policies.load_policy(
      settings.policy(config), settings.env(config), workdir,
      mesh=sharding.make_mesh(config.mesh))

Modules: `config` (base config, every field documented), `state` (TrainState, optimizers),
`update` (jitted update, its typed batch, scoring passes), `checkpoints` (Orbax, HF export),
`metrics` (episode statistics, JSONL and TensorBoard), `data` (task order), `sources`
(demonstrations, the critic), `loop` (the trainer). The policy and its tokenizer come from
`agentgym_jax.policies`, the algorithm is `rl.algorithm.AlgorithmSpec`, and environments
through `rollout.envs`, each taking the typed settings `agentgym_jax.settings` makes of the
config once.
"""
