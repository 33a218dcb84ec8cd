"""Evaluation: Avg@n / Pass@n of a policy on an environment's task split, per category, in
tables shaped like the paper's.

    env = agentgym_jax.settings.env(config)
    settings = agentgym_jax.settings.evaluation(config)  # config.eval; any field replaceable
    result = evaluate(env, settings, graphdef, state, tok, pool, rng=eval_key(config.seed))
    json_path, md_path = write_report(result, output_dir, label, settings.split)

The trainer's in-loop evaluation and the command line (`python -m agentgym_jax.evaluate`, in
`__main__`) both run `evaluate` and write `write_report`'s files, the trainer into
WORKDIR/eval/step_<N>/. Both draw their samples from `eval_key(seed)`, one key for every
evaluation of the run, so the command on a run's checkpoint of step N prints the table the
trainer wrote at step N.

Modules: `evaluation` (the episodes and their summary), `eval_metrics` (Avg@n, Pass@n and
Pass@k per category, pure NumPy), `columns` (each environment's paper columns), `report` (the
report files, their table and the result line) and `__main__` (the command line, whose policy
comes from `agentgym_jax.policies`).
"""

from agentgym_jax.evaluate import eval_metrics
from agentgym_jax.evaluate.columns import PAPER_COLUMNS, paper_column
from agentgym_jax.evaluate.evaluation import (EvalResult, EvalSettings, environment_metrics,
                                             eval_key, evaluate)
from agentgym_jax.evaluate.report import checkpoint_label, failed_line, result_line, write_report

__all__ = ["EvalResult", "EvalSettings", "PAPER_COLUMNS", "checkpoint_label",
           "environment_metrics", "eval_key", "eval_metrics", "evaluate", "failed_line",
           "paper_column", "result_line", "write_report"]
