"""Pure RL math: advantage estimators, losses and their aggregation, horizon schedules.

  from agentgym_jax.rl import advantages, losses, schedule
  adv, ret = advantages.ESTIMATORS["grpo"](rewards, mask, group_ids=group_ids)
  pg, metrics = losses.POLICY_LOSSES["ppo_clip"](log_prob, old_log_prob, adv, mask)
  loss = losses.aggregate(pg, mask, "token-mean", losses.aggregation_denominator(full_mask, ...))
  turns = schedule.max_turns(schedule.Schedule("scaling_inter", (8, 12), 80), step)
"""

from agentgym_jax.rl import advantages, losses, schedule

__all__ = ["advantages", "losses", "schedule"]
