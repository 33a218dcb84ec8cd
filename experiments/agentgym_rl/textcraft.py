r"""AgentGym-RL on TextCraft: Qwen2.5-Instruct + GRPO, fixed 30 turns or ScalingInter [10, 20, 30].

Config arguments (`:k=v,...`, see common.py): schedule=fixed|scaling_inter, algo=grpo|ppo|
reinforce_pp|rloo, model=3b|7b|smollm2, runlocal.

Train (16-chip slice; re-running the same line resumes):
  python -m agentgym_jax.train \
    --config=experiments/agentgym_rl/textcraft.py:schedule=scaling_inter,model=7b \
    --workdir=gs://BUCKET/agentgym/textcraft_si_7b
Evaluate (the paper's eval: 30 turns, 512 tokens per turn):
  python -m agentgym_jax.evaluate \
    --config=experiments/agentgym_rl/textcraft.py:schedule=scaling_inter,model=7b \
    --checkpoint=gs://BUCKET/agentgym/textcraft_si_7b --split=test --num_samples=1 \
    --max_turns=30 --max_reply_tokens=512 --output=gs://BUCKET/agentgym/textcraft_si_7b/eval
CPU smoke run: launch/local.sh experiments/agentgym_rl/textcraft.py
SmolLM2-135M-Instruct on one CPU device in 24 GB (model=smollm2, common.smollm2_on_cpu: 4 tasks
x 4 samples, one row per micro-batch, remat, 2048-token context, lr 1e-5, greedy eval of the
first 20 test tasks); zero-shot evaluation of the model itself, no checkpoint:
  python -m agentgym_jax.evaluate --config=experiments/agentgym_rl/textcraft.py:model=smollm2 \
    --split=test --num_tasks=20 --output=/tmp/smollm2/textcraft_zero_shot

Expected (paper, arXiv 2509.08755 Table 3, TextCraft test set of 100 goals, Overall %):
  Qwen2.5-3B-Instruct untrained 14.00 | 7B untrained 42.00
  schedule=fixed,model=3b (AgentGym-RL-3B)          75.00
  schedule=fixed,model=7b (AgentGym-RL-7B)          89.00 (83.00 in the paper's Table 6)
  schedule=scaling_inter,model=7b (ScalingInter-7B) 91.00
    (per crafting depth: 1: 100, 2: 97.56, 3: 76.00, 4: 33.33)
  algo=reinforce_pp (paper Table 6): 3B 28.00, 7B 73.00. PPO and RLOO: not reported.

Sweeps (`python launch/sweep.py --sweep=NAME --workdir=...
  --config=experiments/agentgym_rl/textcraft.py:schedule=scaling_inter`):
  horizon   fixed 10, fixed 30 and the [10, 20, 30] schedule, all on the ScalingInter row.
  algo      GRPO, REINFORCE++, PPO and RLOO for 3B and 7B.
"""

from experiments.agentgym_rl import common
from agentgym_jax.train import config as base

# AgentGym-RL/textcraft script: n=8, 32 tasks per step in 4 minibatches, 2 epochs, 512 tokens
# per turn, 512 + 10240 tokens, 30 turns (the paper's appendix says 20).
FIXED = common.Setting(
    group_size=8, batch_tasks=32, minibatch_tasks=8, epochs=2, horizons=(30,),
    steps_per_phase=100, max_reply_tokens=512, max_prompt=512, max_response=10240,
    # 30 epochs x floor(374 train goals / 32) = 330 steps, as upstream's script runs.
    total_steps=330)
# ScalingInter-RL/textcraft script: the same row with turns 10 -> 20 -> 30 every 100 steps.
SCALING_INTER = common.Setting(
    group_size=8, batch_tasks=32, minibatch_tasks=8, epochs=2, horizons=(10, 20, 30),
    steps_per_phase=100, max_reply_tokens=512, max_prompt=512, max_response=10240,
    total_steps=330)


def get_config(arg=None):
  args = common.parse(arg)
  c = common.paper_config(args, FIXED if args.schedule == "fixed" else SCALING_INTER)
  c.env.name = "textcraft"
  # TextCraft rewards 1 when the goal item is crafted, else 0, in both reward modes.
  c.env.kwargs = {"reward_mode": "normalized"}
  # 256 episodes per step; a crafting step is a dictionary lookup.
  c.env.num_workers = 8
  # A step that takes longer than this has hung; its episode ends as failed.
  c.env.timeout_s = 60.0
  if args.model == common.SMOLLM2:
    common.smollm2_on_cpu(c)
  if args.runlocal:
    common.shrink_for_cpu(c, args)
  return base.lock(c)


def get_sweep(arg=None):
  """"horizon" (run with :schedule=scaling_inter) or "algo" (any schedule)."""
  if arg == "horizon":
    return common.horizon_sweep(SCALING_INTER)
  if arg == "algo":
    return common.algo_sweep()
  raise ValueError(f"Unknown sweep {arg!r}; use 'horizon' or 'algo'.")
