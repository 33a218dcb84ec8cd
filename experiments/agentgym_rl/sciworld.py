r"""AgentGym-RL on SciWorld: Qwen2.5-Instruct + GRPO, fixed 20 turns or ScalingInter [10, 20, 30].

Config arguments (`:k=v,...`, see common.py): schedule=fixed|scaling_inter, algo=grpo|ppo|
reinforce_pp|rloo, model=3b|7b|smollm2, runlocal. Needs Java >= 1.8 on every host (ScienceWorld).

Train (16-chip slice; re-running the same line resumes):
  python -m agentgym_jax.train \
    --config=experiments/agentgym_rl/sciworld.py:schedule=scaling_inter,model=7b \
    --workdir=gs://BUCKET/agentgym/sciworld_si_7b
Evaluate (the paper's eval: 30 turns, 200 tokens per turn):
  python -m agentgym_jax.evaluate \
    --config=experiments/agentgym_rl/sciworld.py:schedule=scaling_inter,model=7b \
    --checkpoint=gs://BUCKET/agentgym/sciworld_si_7b --split=test --num_samples=1 \
    --max_turns=30 --max_reply_tokens=200 --output=gs://BUCKET/agentgym/sciworld_si_7b/eval
CPU smoke run: launch/local.sh experiments/agentgym_rl/sciworld.py
SmolLM2-135M-Instruct on one CPU device in 24 GB (model=smollm2, common.smollm2_on_cpu: 4 tasks
x 4 samples, one row per micro-batch, remat, 2048-token context, lr 1e-5, greedy eval of the
first 20 test tasks); zero-shot evaluation of the model itself, no checkpoint:
  python -m agentgym_jax.evaluate --config=experiments/agentgym_rl/sciworld.py:model=smollm2 \
    --split=test --num_tasks=20 --output=/tmp/smollm2/sciworld_zero_shot

Expected (paper, arXiv 2509.08755 Table 5, SciWorld test set of 200 games, Overall %; the
paper's numbers are fractions of games, i.e. Pass@1 with "score > 0", the evaluator's default):
  Qwen2.5-3B-Instruct untrained 1.00 | 7B untrained 1.50
  schedule=fixed,model=3b (AgentGym-RL-3B)          22.50
  schedule=fixed,model=7b (AgentGym-RL-7B)          50.50
  schedule=scaling_inter,model=7b (ScalingInter-7B) 57.00
    (Measure 33.96, Test-Conductivity 55.42, Find 88.64, Chem-Mix 0, Lifespan 73.33)
  PPO, REINFORCE++ and RLOO: not reported for SciWorld.

Sweeps (`python launch/sweep.py --sweep=NAME --workdir=...
  --config=experiments/agentgym_rl/sciworld.py:schedule=scaling_inter`):
  horizon   fixed 10, fixed 30 and the [10, 20, 30] schedule, all on the ScalingInter row.
  algo      GRPO, REINFORCE++, PPO and RLOO for 3B and 7B.
"""

from experiments.agentgym_rl import common
from agentgym_jax.train import config as base

# AgentGym-RL/sciworld script: n=8, 16 tasks per step in 2 minibatches, 1 epoch, 200 tokens
# per turn, 1024 + 4096 tokens, 20 turns.
FIXED = common.Setting(
    group_size=8, batch_tasks=16, minibatch_tasks=8, epochs=1, horizons=(20,),
    steps_per_phase=100, max_reply_tokens=200, max_prompt=1024, max_response=4096,
    # Upstream trains 10 epochs over its train ids (count unpublished; its eval scripts load
    # step 150); 300 steps matches the ScalingInter run's compute.
    total_steps=300)
# ScalingInter-RL/sciworld script: as above with 1024 + 8192 tokens and turns 10 -> 20 -> 30
# every 100 steps.
SCALING_INTER = common.Setting(
    group_size=8, batch_tasks=16, minibatch_tasks=8, epochs=1, horizons=(10, 20, 30),
    steps_per_phase=100, max_reply_tokens=200, max_prompt=1024, max_response=8192,
    # Three phases of 100 steps: the last horizon gets a full phase.
    total_steps=300)


def get_config(arg=None):
  args = common.parse(arg)
  c = common.paper_config(args, FIXED if args.schedule == "fixed" else SCALING_INTER)
  c.env.name = "sciworld"
  # Normalised reward: ScienceWorld's 0..100 score / 100, failures (-100) clipped to 0. GRPO
  # is scale-free, so this trains like upstream's raw score; PPO's critic prefers [0, 1].
  c.env.kwargs = {"reward_mode": "normalized"}
  # 128 episodes per step, one JVM each; 16 workers keep a TPU host's CPUs busy.
  c.env.num_workers = 16
  # JVM start and ScienceWorld's first step can take seconds under load.
  c.env.timeout_s = 120.0
  if args.model == common.SMOLLM2:
    common.smollm2_on_cpu(c)
  if args.runlocal:
    common.shrink_for_cpu(c, args, max_context=3072)
    c.env.timeout_s = 300.0  # two JVMs starting on a busy laptop
  return base.lock(c)


def get_sweep(arg=None):
  """"horizon" (run with :schedule=scaling_inter) or "algo" (any schedule)."""
  if arg == "horizon":
    return common.horizon_sweep(SCALING_INTER)
  if arg == "algo":
    return common.algo_sweep()
  raise ValueError(f"Unknown sweep {arg!r}; use 'horizon' or 'algo'.")
