r"""AgentGym-RL on BabyAI: Qwen2.5-Instruct + GRPO, fixed 20 turns or ScalingInter-RL [6, 13, 20].

Train on a 16-chip slice (re-running the same line resumes):
  python -m agentgym_jax.train \
    --config=experiments/agentgym_rl/babyai.py:schedule=scaling_inter,model=7b \
    --workdir=gs://BUCKET/agentgym/babyai_si_7b
The paper evaluates with 20 turns of 512 tokens; common.py has that command, the config
arguments, the CPU smoke run, SmolLM2's and the sweeps.

Expected, from Table 4 of the paper (arXiv 2509.08755; test set of 90 tasks, Overall %):
  Qwen2.5-3B-Instruct untrained 52.22 | 7B untrained 66.67
  schedule=fixed,model=3b (AgentGym-RL-3B)          93.33
  schedule=fixed,model=7b (AgentGym-RL-7B)          92.22
  schedule=scaling_inter,model=7b (ScalingInter-7B) 96.67
    (per level: GoTo 100, Pickup 93.33, ActionObjDoor 100, FindObjS7 80, OneRoomS20 80,
    SynthLoc 100)
  algo=reinforce_pp (paper Table 6): 3B 70.00, 7B 84.44. PPO and RLOO: not reported.
"""

from experiments.agentgym_rl import common

EXPERIMENT = common.Experiment(
    # AgentGym-RL/babyai script: n=8, 16 tasks per step in 2 minibatches, 1 epoch, 200 tokens
    # per turn, 1024 + 4096 tokens, 20 turns. Upstream trains 10 epochs over its train ids
    # (count unpublished); 300 steps is as long as the ScalingInter run, so the two compare at
    # equal compute.
    fixed=common.Setting(
        group_size=8, batch_tasks=16, minibatch_tasks=8, epochs=1, horizons=(20,),
        steps_per_phase=100, max_reply_tokens=200, max_prompt=1024, max_response=4096,
        total_steps=300),
    # ScalingInter-RL/babyai script: n=4, 32 tasks in 4 minibatches, 2 epochs, 512 tokens per
    # turn, 512 + 8192 tokens, turns 6 -> 13 -> 20 every 100 steps; three phases of 100 steps,
    # so the last horizon gets a full phase.
    scaling_inter=common.Setting(
        group_size=4, batch_tasks=32, minibatch_tasks=8, epochs=2, horizons=(6, 13, 20),
        steps_per_phase=100, max_reply_tokens=512, max_prompt=512, max_response=8192,
        total_steps=300),
    # The normalised reward (common.ENV_DEFAULTS): BabyAI's score (1 - 0.9 * steps /
    # max_steps on success, else 0) is already in [0, 1], so it equals upstream's training
    # signal. 128 episodes per step: minigrid steps take microseconds, 8 workers keep up.
    env={"name": "babyai"})

get_config, get_sweep = common.getters(EXPERIMENT)
