r"""AgentGym-RL on SciWorld: Qwen2.5-Instruct + GRPO, fixed 20 turns or ScalingInter [10, 20, 30].

Needs Java >= 1.8 on every host (ScienceWorld runs in a JVM). Train (16-chip slice; the same
line again resumes):
  python -m agentgym_jax.train \
    --config=experiments/agentgym_rl/sciworld.py:schedule=scaling_inter,model=7b \
    --workdir=gs://BUCKET/agentgym/sciworld_si_7b
and evaluate as the paper does, 30 turns of at most 200 tokens, with the command in common.py.

The paper's numbers (arXiv 2509.08755 Table 5, 200 test games, Overall %) are fractions of
games, i.e. Pass@1 with "score > 0", the evaluator's default:
  Qwen2.5-3B-Instruct untrained 1.00 | 7B untrained 1.50
  schedule=fixed,model=3b (AgentGym-RL-3B)          22.50
  schedule=fixed,model=7b (AgentGym-RL-7B)          50.50
  schedule=scaling_inter,model=7b (ScalingInter-7B) 57.00
    (Measure 33.96, Test-Conductivity 55.42, Find 88.64, Chem-Mix 0, Lifespan 73.33)
The paper reports no PPO, REINFORCE++ or RLOO run on SciWorld.
"""

import dataclasses

from experiments.agentgym_rl import common

# AgentGym-RL/sciworld script: n=8, 16 tasks per step in 2 minibatches, 1 epoch, 200 tokens
# per turn, 1024 + 4096 tokens, 20 turns. Upstream trains 10 epochs over its train ids (count
# unpublished; its eval scripts load step 150); 300 steps matches the ScalingInter run's
# compute.
FIXED = common.Setting(
    group_size=8, batch_tasks=16, minibatch_tasks=8, epochs=1, horizons=(20,),
    steps_per_phase=100, max_reply_tokens=200, max_prompt=1024, max_response=4096,
    total_steps=300)

EXPERIMENT = common.Experiment(
    fixed=FIXED,
    # ScalingInter-RL/sciworld script: as above with 1024 + 8192 tokens and turns 10 -> 20 ->
    # 30 every 100 steps; three phases of 100 steps: the last horizon gets a full phase.
    scaling_inter=dataclasses.replace(FIXED, horizons=(10, 20, 30), max_response=8192),
    # The normalised reward (common.ENV_DEFAULTS): ScienceWorld's 0..100 score / 100, failures
    # (-100) clipped to 0. GRPO is scale-free, so this trains like upstream's raw score; PPO's
    # critic prefers [0, 1].
    env={
        "name": "sciworld",
        # 128 episodes per step, one JVM each; 16 workers keep a TPU host's CPUs busy.
        "num_workers": 16,
        # JVM start and ScienceWorld's first step can take seconds under load.
        "timeout_s": 120.0,
    },
    runlocal_context=3072,
    # Two JVMs starting on a busy laptop.
    runlocal={"env.timeout_s": 300.0})

get_config, get_sweep = common.getters(EXPERIMENT)
