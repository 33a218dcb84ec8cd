r"""Evaluates a policy on an environment's task split: Avg@n / Pass@n per category, paper tables.

  python -m agentgym_jax.evaluate --config=experiments/agentgym_rl/babyai.py:model=7b \
      (--checkpoint=WORKDIR | --hf_model=DIR) [--split=test] [--num_samples=n] \
      [--max_turns=T] [--max_reply_tokens=N] [--temperature=t] --output=DIR

The config supplies the environment, the tokenizer and model shape (for a training
checkpoint), the sampler and the evaluation defaults (`config.eval`); flags override them.
Every task of the split (or the first `--num_tasks`) runs n times through the rollout engine;
`eval_metrics` turns the final scores into Avg@n, Pass@n and Pass@k per category and overall.

Writes into --output: `eval_<split>.json` (settings, metrics, per-task results),
`eval_<split>.md` (a table shaped like the paper's) and `episodes_<split>.jsonl` (every
episode's tokens and text).

Categories come from the environment's reset `info["category"]` (TextCraft's crafting depth,
SciWorld's task, BabyAI's level, SearchQA's source dataset) and are grouped into the paper's
columns by `PAPER_COLUMNS`; a category no rule matches is reported under its own name.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import json
import os
import re
import tempfile
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from agentgym_jax import eval_metrics
from agentgym_jax.rollout import SamplingConfig, run_episodes, save_jsonl
from agentgym_jax.tokenization import ChatTokenizer

# The paper's table columns per environment: (column, regex searched in the env's category).
# Order is the paper's; the first matching rule wins.
PAPER_COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "babyai": (("GoTo", r"GoTo"), ("Pickup", r"Pickup"), ("ActionObjDoor", r"ActionObjDoor"),
               ("FindObjS7", r"FindObj"), ("OneRoomS20", r"OneRoom"),
               ("SynthLoc", r"SynthLoc")),
    "textcraft": tuple((f"Depth {d}", rf"^depth ?{d}$") for d in range(1, 5)),
    "sciworld": (("Measure", r"^measure"), ("Test-Cond", r"^test-conductivity"),
                 ("Find", r"^find"), ("Chem-Mix", r"^chemistry-mix"),
                 ("Lifespan", r"^lifespan")),
    "searchqa": (("NQ", r"^nq"), ("TriviaQA", r"^triviaqa"), ("PopQA", r"^popqa"),
                 ("HotpotQA", r"^hotpotqa"), ("2Wiki", r"^2wiki"), ("MuSiQue", r"^musique"),
                 ("Bamboogle", r"^bamboogle")),
    "webarena": (("Shopping", r"^shopping$"), ("CMS", r"^shopping_admin|^cms"),
                 ("Maps", r"^map"), ("GitLab+Reddit", r"^gitlab|^reddit")),
}


def paper_column(env_name: str, category: str | None) -> str | None:
  """The paper's column for `category` of `env_name` (the category itself if none matches)."""
  if category is None:
    return None
  for column, pattern in PAPER_COLUMNS.get(env_name, ()):
    if re.search(pattern, str(category), re.IGNORECASE):
      return column
  return str(category)


class _RecordingPool:
  """Passes calls through to an env pool and keeps each task's reset `info["category"]`."""

  def __init__(self, pool: Any):
    self._pool = pool
    self.categories: dict[int, str | None] = {}

  def reset(self, task_ids: Sequence[int], *args, **kwargs):
    outcomes = self._pool.reset(task_ids, *args, **kwargs)
    for task_id, out in zip(task_ids, outcomes):
      if "error" not in out.info:
        self.categories.setdefault(int(task_id), out.info.get("category"))
    return outcomes

  def __getattr__(self, name: str) -> Any:  # step, env_cls, ... of the wrapped pool
    return getattr(self._pool, name)


@dataclasses.dataclass
class EvalResult:
  """Per-episode outcomes ([E] each, E = tasks x n, grouped by task) and their summary."""

  summary: dict[str, dict[str, float]]
  task_ids: list[int]
  rewards: np.ndarray  # final reward as trained on (normalised unless reward_mode="paper")
  scores: np.ndarray  # the environment's raw final score
  success: np.ndarray
  passed: np.ndarray
  num_turns: np.ndarray
  stop_reasons: list[str]
  categories: dict[int, str | None]


def evaluate_policy(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tok: ChatTokenizer,
    pool: Any,
    task_ids: Sequence[int],
    *,
    env_name: str,
    num_samples: int,
    max_turns: int,
    sampling: SamplingConfig,
    max_context: int,
    rng: jax.Array | int = 0,
    chunk_tasks: int = 0,
    system_prompt: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    pass_criterion: str = "score>0",
    ks: Sequence[int] = (1,),
    episodes_path: str | None = None,
) -> EvalResult:
  """Runs every task `num_samples` times and summarises the outcomes per paper column.

  Args:
    graphdef, state: `nnx.split(policy)`.
    tok: the policy's chat tokenizer.
    pool: an `environments.workers.EnvPool` (or anything with its reset/step interface).
    task_ids: tasks to evaluate.
    env_name: the environment's name, selecting the paper's column layout.
    num_samples: n, episodes per task.
    max_turns: agent turns per episode at most.
    sampling: decoding (temperature 0 = greedy).
    max_context: tokens per episode at most.
    rng: key or seed; chunk c uses fold_in(rng, c).
    chunk_tasks: tasks per rollout call (memory bound: rows = chunk_tasks * n); 0 = all.
    system_prompt: system message (None: the chat template's default).
    mesh: shard rollout rows over its data axes.
    pass_criterion: "score>0" (upstream) or "success".
    ks: Pass@k estimates to add (k > n are skipped).
    episodes_path: write every episode as JSONL here.
  """
  task_ids = [int(t) for t in task_ids]
  if not task_ids:
    raise ValueError("No tasks to evaluate: the split is empty or --num_tasks is 0.")
  recorder = _RecordingPool(pool)
  key = jax.random.key(rng) if isinstance(rng, int) else rng
  chunk = chunk_tasks or len(task_ids)
  episodes = []
  if episodes_path:
    open(episodes_path, "w").close()
  for c, start in enumerate(range(0, len(task_ids), chunk)):
    traj, stats = run_episodes(
        graphdef, state, tok, recorder, task_ids[start:start + chunk], group_size=num_samples,
        max_turns=max_turns, sampling=sampling, max_context=max_context,
        rng=jax.random.fold_in(key, c), system_prompt=system_prompt, mesh=mesh)
    episodes.extend(stats["episodes"])
    if episodes_path:
      _append_jsonl(episodes_path, traj, tok.decode, stats["episodes"])

  ids = [e.task_id for e in episodes]
  scores = np.array([e.score for e in episodes], np.float64)
  success = np.array([e.success for e in episodes], bool)
  passed = eval_metrics.passed_from(scores, success, pass_criterion)
  rewards = np.array([e.reward for e in episodes], np.float64)
  columns = {t: paper_column(env_name, cat) for t, cat in recorder.categories.items()}
  order = [column for column, _ in PAPER_COLUMNS.get(env_name, ())]
  summary = eval_metrics.summarize(ids, rewards, passed, columns, order,
                                   ks=[k for k in ks if k <= num_samples])
  # The raw-score mean too (SciWorld's 0..100 score, BabyAI's step-discounted reward).
  for column, metrics in eval_metrics.summarize(ids, scores, passed, columns, order).items():
    summary[column]["avg_raw"] = metrics["avg"]
  return EvalResult(summary=summary, task_ids=ids, rewards=rewards, scores=scores,
                    success=success, passed=passed,
                    num_turns=np.array([e.num_turns for e in episodes], np.int32),
                    stop_reasons=[e.stop_reason for e in episodes],
                    categories=recorder.categories)


def _append_jsonl(path: str, traj, decode, episodes) -> None:
  with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as tmp:
    save_jsonl(tmp.name, traj, decode, episodes)
    with open(path, "a") as out:
      out.write(tmp.read())


def write_report(result: EvalResult, output_dir: str, label: str, settings: dict[str, Any],
                 split: str) -> tuple[str, str]:
  """Writes eval_<split>.json and eval_<split>.md into `output_dir`; returns their paths."""
  os.makedirs(output_dir, exist_ok=True)
  per_task = {}
  for i, task_id in enumerate(result.task_ids):
    row = per_task.setdefault(task_id, {
        "task_id": task_id, "category": result.categories.get(task_id), "rewards": [],
        "scores": [], "success": [], "num_turns": [], "stop_reasons": []})
    row["rewards"].append(float(result.rewards[i]))
    row["scores"].append(float(result.scores[i]))
    row["success"].append(bool(result.success[i]))
    row["num_turns"].append(int(result.num_turns[i]))
    row["stop_reasons"].append(result.stop_reasons[i])
  report = {"label": label, "split": split, "settings": settings, "metrics": result.summary,
            "tasks": list(per_task.values())}
  json_path = os.path.join(output_dir, f"eval_{split}.json")
  with open(json_path, "w") as f:
    json.dump(report, f, indent=1)

  metrics = ["pass", "avg"] + [k for k in result.summary[eval_metrics.OVERALL]
                               if k.startswith("pass@")]
  rows = eval_metrics.summary_rows(label, result.summary, metrics)
  columns = list(result.summary)
  lines = [f"# {label}: {settings['env']} {split}", "",
           ", ".join(f"{k}={v}" for k, v in settings.items()), "",
           eval_metrics.markdown_table(rows, columns),
           f"Pass@n: % of tasks with a passing sample ({settings['pass_criterion']}). "
           "Avg@n: mean final reward x 100. Tasks per column: "
           + ", ".join(f"{c} {int(m['num_tasks'])}" for c, m in result.summary.items()) + "."]
  md_path = os.path.join(output_dir, f"eval_{split}.md")
  with open(md_path, "w") as f:
    f.write("\n".join(lines) + "\n")
  return json_path, md_path
