"""Training: train state, jitted update, trainer loop, checkpoints, metrics.

  python -m agentgym_jax.train --config=experiments/keypad/learn.py:runlocal --workdir=/tmp/w

  from agentgym_jax.train import loop
  loop.train(config, workdir)                         # resumes if workdir has a checkpoint
  graphdef, params, tok, step = loop.load_policy(config, workdir)

Modules: `config` (base config, every field documented), `state` (TrainState, optimizers),
`update` (jitted update, scoring passes), `checkpoints` (Orbax), `metrics` (JSONL and
TensorBoard), `data` (task order), `sources` (model and tokenizer), `loop` (the trainer).
"""
