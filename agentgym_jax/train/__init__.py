"""Training: train state, jitted update, trainer loop, checkpoints, metrics.

  python -m agentgym_jax.train --config=experiments/keypad/learn.py:runlocal --workdir=/tmp/w

  from agentgym_jax.train import loop, sources
  loop.train(config, workdir)                         # resumes if workdir has a checkpoint
  graphdef, params, tok, step = sources.load_policy(config, workdir)

Modules: `config` (base config, every field documented), `state` (TrainState, optimizers),
`update` (jitted update, its typed batch, scoring passes), `checkpoints` (Orbax, the restored
policy, HF export), `metrics` (episode statistics, JSONL and TensorBoard), `data` (task
order), `sources` (model, tokenizer, a checkpoint's policy, demonstrations), `loop` (the
trainer). The algorithm is `rl.algorithm.AlgorithmSpec`; environments come through
`rollout.envs`.
"""
