r"""AgentGym-RL on WebArena: Qwen2.5-Instruct + GRPO, fixed 15 turns or ScalingInter-RL [8, 12, 15].

WebArena runs as AgentGym's env server (its web sites in Docker, a browser per instance) at
`env.kwargs.url`; we reach it through `environments.client.RemoteEnv` (env name "remote").

Config arguments (`:k=v,...`, see common.py): schedule=fixed|scaling_inter, algo=grpo|ppo|
reinforce_pp|rloo, model=3b|7b|smollm2, runlocal. runlocal cannot start WebArena's sites, so it
exercises the same remote path against a local `environments.server` serving TextCraft:
  launch/env_server.sh start --env textcraft --port 36005
  launch/local.sh experiments/agentgym_rl/webarena.py
  launch/env_server.sh stop --env textcraft
SmolLM2-135M-Instruct on one CPU device in 24 GB (model=smollm2, common.smollm2_on_cpu: 4 tasks
x 4 samples, one row per micro-batch, remat, 2048-token context, lr 1e-5, greedy eval of the
first 20 test tasks); zero-shot evaluation of the model itself, no checkpoint:
  python -m agentgym_jax.evaluate --config=experiments/agentgym_rl/webarena.py:model=smollm2 \
    --split=test --num_tasks=20 --output=/tmp/smollm2/webarena_zero_shot

Train (16-chip slice; the WebArena server must be reachable from every host):
  python -m agentgym_jax.train \
    --config=experiments/agentgym_rl/webarena.py:schedule=scaling_inter,model=7b \
    --config.env.kwargs.url=http://WEBARENA_HOST:36005 \
    --workdir=gs://BUCKET/agentgym/webarena_si_7b
Evaluate (the paper's eval: 15 turns, 512 tokens per turn):
  python -m agentgym_jax.evaluate \
    --config=experiments/agentgym_rl/webarena.py:schedule=scaling_inter,model=7b \
    --config.env.kwargs.url=http://WEBARENA_HOST:36005 \
    --checkpoint=gs://BUCKET/agentgym/webarena_si_7b --split=test --num_samples=1 \
    --max_turns=15 --output=gs://BUCKET/agentgym/webarena_si_7b/eval

Expected (paper, arXiv 2509.08755 Table 1, WebArena subset of 50 tasks, Overall %):
  Qwen2.5-3B-Instruct untrained 10.00 | 7B untrained 9.76
  schedule=fixed,model=3b (AgentGym-RL-3B)          18.00
  schedule=fixed,model=7b (AgentGym-RL-7B)          22.00 (the paper's text says 16.00)
  schedule=scaling_inter,model=7b (ScalingInter-7B) 26.00
    (Shopping 33.33, CMS 26.67, Maps 20.00, GitLab+Reddit 20.00)
  PPO, REINFORCE++ and RLOO: not reported for WebArena.

Sweeps (`python launch/sweep.py --sweep=NAME --workdir=...
  --config=experiments/agentgym_rl/webarena.py:schedule=scaling_inter`):
  horizon   fixed 8, fixed 15 and the [8, 12, 15] schedule, all on the ScalingInter row.
  algo      GRPO, REINFORCE++, PPO and RLOO for 3B and 7B.
"""

from experiments.agentgym_rl import common
from agentgym_jax.train import config as base

# AgentGym-RL/webarena script: n=4, 32 tasks per step in 8 minibatches, 2 epochs, 512 tokens per
# turn, 750 + 14098 tokens, 15 turns. The paper's appendix gives lr 5e-7 for WebArena; the
# script (and this file) use 1e-6 (--config.optim.lr=5e-7 for the appendix's value).
FIXED = common.Setting(
    group_size=4, batch_tasks=32, minibatch_tasks=4, epochs=2, horizons=(15,),
    steps_per_phase=80, max_reply_tokens=512, max_prompt=750, max_response=14098,
    # 25 epochs x floor(372 train tasks / 32) = 275 steps, as upstream's script runs.
    total_steps=275)
# ScalingInter-RL/webarena script: the same row with turns 8 -> 12 -> 15 every 80 steps.
SCALING_INTER = common.Setting(
    group_size=4, batch_tasks=32, minibatch_tasks=4, epochs=2, horizons=(8, 12, 15),
    steps_per_phase=80, max_reply_tokens=512, max_prompt=750, max_response=14098,
    total_steps=275)


def get_config(arg=None):
  args = common.parse(arg)
  c = common.paper_config(args, FIXED if args.schedule == "fixed" else SCALING_INTER)
  c.env.name = "remote"
  c.env.kwargs = {
      # The AgentGym WebArena server (AgentGym-RL's scripts default to this address).
      "url": "http://127.0.0.1:36005",
      # Which protocol the server speaks: AgentGym's WebArena field names and its prompt.
      "env_name": "webarena",
      # WebArena's evaluator scores 0 or 1 at the end of an episode.
      "reward_mode": "normalized",
      # Upstream's agentgym.timeout: page loads and the evaluator can take minutes.
      "timeout_s": 600.0,
  }
  # Every in-flight episode holds a browser on the server; the workers only wait on HTTP.
  c.env.num_workers = 8
  # A bit above the HTTP timeout, so the client reports the server's silence first.
  c.env.timeout_s = 660.0
  if args.model == common.SMOLLM2:
    common.smollm2_on_cpu(c)
  if args.runlocal:
    common.shrink_for_cpu(c, args)
    c.env.kwargs.env_name = "textcraft"  # served by environments.server; see the docstring
    c.env.kwargs.timeout_s = 60.0
    c.env.timeout_s = 90.0
  return base.lock(c)


def get_sweep(arg=None):
  """"horizon" (run with :schedule=scaling_inter) or "algo" (any schedule)."""
  if arg == "horizon":
    return common.horizon_sweep(SCALING_INTER)
  if arg == "algo":
    return common.algo_sweep()
  raise ValueError(f"Unknown sweep {arg!r}; use 'horizon' or 'algo'.")
