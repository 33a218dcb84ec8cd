r"""Evaluates a policy on an environment's task split: Avg@n / Pass@n per category, paper tables.

  python -m agentgym_jax.evaluate --config=experiments/agentgym_rl/babyai.py:model=7b \
      [--checkpoint=WORKDIR | --hf_model=DIR] [--split=test] [--num_samples=n] \
      [--max_turns=T] [--max_reply_tokens=N] [--temperature=t] --output=DIR

With neither --checkpoint nor --hf_model it evaluates the config's own model (`config.model`,
e.g. `:model=smollm2` zero-shot) with the config's tokenizer.

The config supplies the environment, the tokenizer and model shape (for a training
checkpoint), the sampler and the evaluation defaults (`config.eval`); flags override them.
Every task of the split (or the first `--num_tasks`) runs n times through the rollout engine;
`eval_metrics` turns the final scores into Avg@n, Pass@n and Pass@k per category and overall.
On several hosts (the same command on each, as for training) every process runs a share of
the episodes and process 0 writes the report of all of them.

Writes into --output: `eval_<split>.json` (settings, metrics, per-task results),
`eval_<split>.md` (a table shaped like the paper's), `episodes_<split>.jsonl` (every
episode's tokens and text) and `evaluate.log` (the INFO log). The terminal shows a progress
bar over the episodes, the table and one line of the overall numbers.

The trainer's in-loop evaluation is this module's `evaluate` too, and writes the same report
into WORKDIR/eval/step_<N>/. Both draw their samples from `eval_key(seed)`, one key for every
evaluation of the run, so this command on a run's checkpoint of step N prints the table the
trainer wrote at step N.

Episodes that failed (an env worker crashed or hung, the env server answered an error) are
left out of Avg@n and Pass@n, which are computed over the healthy ones, and counted, by fault,
in the table's footer and the result line: a flaky env server does not look like a weak policy.

Categories come from the environment's reset `info["category"]` (TextCraft's crafting depth,
SciWorld's task, BabyAI's level, SearchQA's question source; a remote env's from its split
file) and are grouped into the paper's columns by `PAPER_COLUMNS`; a category no rule matches
is reported under its own name.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
import dataclasses
import itertools
import json
import os
import re
import time
from typing import Any

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_flags
import numpy as np
from flax import nnx
import tqdm

from agentgym_jax import cli
from agentgym_jax import eval_metrics
from agentgym_jax import multihost
from agentgym_jax import sharding
from agentgym_jax.models import load_hf
from agentgym_jax.rollout import SamplingConfig, envs, run_episodes, save_jsonl
from agentgym_jax.rollout.trajectory import build_trajectory
from agentgym_jax.train import checkpoints, sources
from agentgym_jax.tokenization import ChatTokenizer

# The paper's table columns per environment: (column, regex searched in the env's category).
# Order is the paper's; the first matching rule wins.
PAPER_COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "babyai": (("GoTo", r"GoTo"), ("Pickup", r"Pickup"), ("ActionObjDoor", r"ActionObjDoor"),
               ("FindObjS7", r"FindObj"), ("OneRoomS20", r"OneRoom"),
               ("SynthLoc", r"SynthLoc")),
    "textcraft": tuple((f"Depth {d}", rf"^depth ?{d}$") for d in range(1, 5)),
    # The paper does not say which of ScienceWorld's 30 tasks each of its five columns holds
    # (its test ids are unpublished; all 200 fall in the five). We group by ScienceWorld's
    # topics: matter and measurement, electricity, classification, chemistry, life cycles.
    "sciworld": (("Measure", r"^(measure|use-thermometer|melt|boil|freeze|change-the-state)"),
                 ("Test-Cond", r"^(test-conductivity|power-component)"),
                 ("Find", r"^find"), ("Chem-Mix", r"^chemistry-mix"),
                 ("Lifespan", r"^(lifespan|identify-life-stages)")),
    "searchqa": (("NQ", r"^nq"), ("TriviaQA", r"^triviaqa"), ("PopQA", r"^popqa"),
                 ("HotpotQA", r"^hotpotqa"), ("2Wiki", r"^2wiki"), ("MuSiQue", r"^musique"),
                 ("Bamboogle", r"^bamboogle")),
    # WebArena's sites, for a server that reports them as the category.
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


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """What an evaluation runs: `config.eval`'s defaults, each replaceable by a CLI flag."""

  split: str
  num_tasks: int  # the split's first N tasks; 0 = all
  num_samples: int  # n, episodes per task
  max_turns: int
  temperature: float  # 0 = greedy
  max_reply_tokens: int
  pass_criterion: str = "score>0"  # or "success"
  ks: tuple[int, ...] = (1,)  # Pass@k estimates to add (k > n are skipped)

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, **overrides: Any) -> "EvalSettings":
    """The config's settings, with the `overrides` that are not None (the CLI's flags).

    The turn limit defaults to the schedule's longest horizon: the turn budget the trained
    agent is meant for.
    """
    settings = cls(split=config.eval.split, num_tasks=config.eval.num_tasks,
                   num_samples=config.eval.group_size, max_turns=max(config.schedule.horizons),
                   temperature=config.eval.temperature,
                   max_reply_tokens=config.rollout.max_reply_tokens)
    return dataclasses.replace(settings,
                               **{k: v for k, v in overrides.items() if v is not None})


def eval_key(seed: int) -> jax.Array:
  """The sampling key of a run's evaluations, the trainer's in-loop ones and the command
  line's alike.

  One key for every evaluation of a run, so checkpoints are compared on the same sampling
  noise and a change between them is the policy's. The training streams fold the step and
  their stream id into this key, so none of them draws with this key itself.
  """
  return jax.random.key(seed)


@dataclasses.dataclass
class EvalResult:
  """Per-episode outcomes ([E] each, E = tasks x n, grouped by task) and their summary."""

  summary: dict[str, dict[str, float]]
  settings: dict[str, Any]  # what ran, as written at the head of the report
  task_ids: list[int]
  rewards: np.ndarray  # final reward as trained on (normalised unless reward_mode="paper")
  scores: np.ndarray  # the environment's raw final score
  success: np.ndarray
  passed: np.ndarray
  num_turns: np.ndarray
  failed: np.ndarray  # the episodes that ended on a fault, left out of the summary
  stop_reasons: list[str]
  categories: dict[int, str | None]
  seconds: float  # wall time of the episodes

  @property
  def success_rate(self) -> float | None:
    """Success per healthy episode (None when every episode failed)."""
    return float(self.success[~self.failed].mean()) if not self.failed.all() else None


def evaluate(config: ml_collections.ConfigDict, settings: EvalSettings, graphdef: nnx.GraphDef,
             state: nnx.State, tok: ChatTokenizer, pool: Any, *, rng: jax.Array,
             mesh: jax.sharding.Mesh | None = None, episodes_path: str | None = None,
             progress_bar: bool = False) -> EvalResult:
  """Runs every task of the settings' split n times and summarises per paper column.

  The trainer's in-loop evaluation and `python -m agentgym_jax.evaluate` both call this, so
  they sample alike (the rollout's top-p/top-k at `settings.temperature`), name the
  environment alike (a remote env by the one it serves), and run the same chunks: as many
  tasks at a time as fill the rows of one training step, which are known to fit in memory.

  Args:
    config: the run's config (environment, rollout limits, data layout).
    settings: see `EvalSettings`.
    graphdef, state: `nnx.split(policy)`.
    tok: the policy's chat tokenizer.
    pool: an `environments.workers.EnvPool` from `envs.make_pool(config)` (or anything with
      its reset/step interface).
    rng: the sampling key (`eval_key`); chunk c uses fold_in(rng, c).
    mesh: shard rollout rows over its data axes. On a mesh over several processes every
      process must call this (with the same arguments): each runs an even share of the
      episodes on its own devices and every process gets the result of all of them.
    episodes_path: write every episode as JSONL here (from one process only).
    progress_bar: show a tqdm bar over this process's episodes as they end (the command
      line's; the trainer's console has its own bar over steps).
  Raises:
    ValueError: an unknown split, or no task to evaluate.
  """
  splits = envs.task_splits(config)
  if settings.split not in splits:
    raise ValueError(f"Split {settings.split!r} not in {config.env.name}'s splits "
                     f"{sorted(splits)}.")
  task_ids = splits[settings.split]
  task_ids = [int(t) for t in (task_ids[:settings.num_tasks] if settings.num_tasks else task_ids)]
  if not task_ids:
    raise ValueError("No tasks to evaluate: the split is empty or --num_tasks is 0.")
  env_name = envs.served_name(config)
  sampling = SamplingConfig(temperature=settings.temperature, top_p=config.rollout.top_p,
                            top_k=config.rollout.top_k,
                            max_reply_tokens=settings.max_reply_tokens)
  n = settings.num_samples
  start_time = time.perf_counter()
  chunk = max(1, config.data.batch_tasks * config.data.group_size // n)
  # On several hosts each process runs an even share of every chunk's episodes on its own
  # devices (keys and group ids of the whole chunk, so the samples are those of one process).
  share = multihost.process_share(mesh)
  local_state = share.local(state)
  plan = []  # (chunk, its task ids, this process's rows of it or None for all)
  for c, start in enumerate(range(0, len(task_ids), chunk)):
    chunk_ids = task_ids[start:start + chunk]
    rows = multihost.split_rows(len(chunk_ids) * n)
    if rows is None or rows.size:
      plan.append((c, chunk_ids, rows))
  total = sum(len(ids) * n if rows is None else rows.size for _, ids, rows in plan)
  mine = []  # (chunk, row, Episode) run by this process
  with tqdm.tqdm(total=total, desc="evaluate", unit="episode", disable=not progress_bar,
                 dynamic_ncols=True) as progress:
    for c, chunk_ids, rows in plan:
      _, stats = run_episodes(
          graphdef, local_state, tok, pool, chunk_ids, group_size=n,
          max_turns=settings.max_turns, sampling=sampling,
          max_context=config.rollout.max_context, rng=jax.random.fold_in(rng, c),
          system_prompt=config.env.system_prompt or None, mesh=share.mesh,
          replicas=config.rollout.replicas, rows=rows, on_ended=progress.update,
          history_turns=config.rollout.history_turns, overlap_env=config.rollout.overlap_env)
      ran = range(len(stats["episodes"])) if rows is None else rows.tolist()
      mine += [(c, row, e) for row, e in zip(ran, stats["episodes"])]
  gathered = sorted(itertools.chain.from_iterable(multihost.allgather_objects(mine)),
                    key=lambda item: item[:2])
  episodes = [e for _, _, e in gathered]
  if episodes_path:
    open(episodes_path, "w").close()
    for _, items in itertools.groupby(gathered, key=lambda item: item[0]):
      chunk_episodes = [e for _, _, e in items]
      save_jsonl(episodes_path, build_trajectory(chunk_episodes, tok.pad_id), tok.decode,
                 chunk_episodes, append=True)

  ids = [e.task_id for e in episodes]
  categories: dict[int, str | None] = {}
  for e in episodes:  # an episode whose reset failed has no category; its task's others may
    if e.category is not None or e.task_id not in categories:
      categories[e.task_id] = e.category
  scores = np.array([e.score for e in episodes], np.float64)
  success = np.array([e.success for e in episodes], bool)
  passed = eval_metrics.passed_from(scores, success, settings.pass_criterion)
  rewards = np.array([e.reward for e in episodes], np.float64)
  failed = np.array([e.failed for e in episodes], bool)
  columns = {t: paper_column(env_name, cat) for t, cat in categories.items()}
  order = [column for column, _ in PAPER_COLUMNS.get(env_name, ())]
  summary = eval_metrics.summarize(ids, rewards, passed, columns, order,
                                   ks=[k for k in settings.ks if k <= n], failed=failed)
  # The raw-score mean too (SciWorld's 0..100 score, BabyAI's step-discounted reward).
  for column, metrics in eval_metrics.summarize(ids, scores, passed, columns, order,
                                                failed=failed).items():
    summary[column]["avg_raw"] = metrics["avg"]
  report_settings = {
      "env": env_name, "num_tasks": len(task_ids), "num_samples": n,
      "max_turns": settings.max_turns, "max_reply_tokens": settings.max_reply_tokens,
      "temperature": settings.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
      "max_context": config.rollout.max_context,
      "history_turns": config.rollout.history_turns, "pass_criterion": settings.pass_criterion,
      "seed": config.seed}
  return EvalResult(summary=summary, settings=report_settings, task_ids=ids, rewards=rewards,
                    scores=scores, success=success, passed=passed,
                    num_turns=np.array([e.num_turns for e in episodes], np.int32),
                    failed=failed, stop_reasons=[e.stop_reason for e in episodes],
                    categories=categories, seconds=time.perf_counter() - start_time)


def write_report(result: EvalResult, output_dir: str, label: str, split: str
                 ) -> tuple[str, str]:
  """Writes eval_<split>.json and eval_<split>.md into `output_dir`; returns their paths.

  The markdown holds what the run was and its table, nothing that varies between two runs of
  the same evaluation (the JSON adds the seconds it took).
  """
  os.makedirs(output_dir, exist_ok=True)
  per_task = {}
  for i, task_id in enumerate(result.task_ids):
    row = per_task.setdefault(task_id, {
        "task_id": task_id, "category": result.categories.get(task_id), "rewards": [],
        "scores": [], "success": [], "num_turns": [], "stop_reasons": [], "failed": []})
    row["rewards"].append(float(result.rewards[i]))
    row["scores"].append(float(result.scores[i]))
    row["success"].append(bool(result.success[i]))
    row["num_turns"].append(int(result.num_turns[i]))
    row["stop_reasons"].append(result.stop_reasons[i])
    row["failed"].append(bool(result.failed[i]))
  report = {"label": label, "split": split, "settings": result.settings,
            "seconds": round(result.seconds, 1), "metrics": result.summary,
            "tasks": list(per_task.values())}
  json_path = os.path.join(output_dir, f"eval_{split}.json")
  with open(json_path, "w") as f:
    json.dump(report, f, indent=1)

  n = result.summary[eval_metrics.OVERALL]["n"]
  # Pass@k rows, except k = n: that one is the Pass@n row.
  metrics = ["pass", "avg"] + [k for k in result.summary[eval_metrics.OVERALL]
                               if k.startswith("pass@") and k != f"pass@{n}"]
  rows = eval_metrics.summary_rows(label, result.summary, metrics)
  columns = list(result.summary)
  settings = result.settings
  lines = [f"# {label}: {settings['env']} {split}", "",
           ", ".join(f"{k}={v}" for k, v in settings.items()), "",
           eval_metrics.markdown_table(rows, columns),
           f"Pass@n: % of tasks with a passing sample ({settings['pass_criterion']}). "
           "Avg@n: mean final reward x 100. Tasks per column: "
           + ", ".join(f"{c} {int(m['num_tasks'])}" for c, m in result.summary.items()) + ".",
           "", failed_line(result)]
  md_path = os.path.join(output_dir, f"eval_{split}.md")
  with open(md_path, "w") as f:
    f.write("\n".join(lines) + "\n")
  return json_path, md_path


# ----- command line ------------------------------------------------------------------------------

LOG_FILE = "evaluate.log"  # INFO logging, in --output (cli.log_to)


def failed_line(result: EvalResult) -> str:
  """The table's footer on failed episodes: how many, of which fault, left out of the table."""
  count = int(result.failed.sum())
  if not count:
    return f"Failed episodes: none of {result.failed.size}."
  kinds = collections.Counter(r for r, f in zip(result.stop_reasons, result.failed) if f)
  return (f"Failed episodes: {count} of {result.failed.size} ("
          + ", ".join(f"{kind} {n}" for kind, n in kinds.most_common())
          + "), left out of Avg@n and Pass@n (see the episodes' stop reasons and errors).")


def result_line(result: EvalResult, label: str, split: str, output: str) -> str:
  """The one line that ends an evaluation: the overall numbers and where the files are."""
  overall = result.summary[eval_metrics.OVERALL]
  n = overall["n"]
  settings = result.settings
  # None: every episode failed, so there is nothing to measure (see `failed_line`).
  percent = lambda value: "-" if value is None else f"{100 * value:.2f}"
  return (f"{label} on {settings['env']} {split}: "
          f"Pass@{n} {percent(overall['pass'])}, Avg@{n} {percent(overall['avg'])}, "
          f"success {'-' if result.success_rate is None else f'{result.success_rate:.3f}'} "
          "per episode "
          f"({settings['num_tasks']} tasks x {n}, {int(result.failed.sum())} episodes failed, "
          f"{result.seconds:.0f} s); "
          f"report and episodes in {output}")


def check_policy_flags(checkpoint: str | None, hf_model: str | None) -> None:
  """Exits with one line, before anything is read or written, when the policy flags cannot
  name a policy (e.g. a tokenizer would otherwise be written into a wrong --checkpoint)."""
  if checkpoint and hf_model:
    cli.fatal("Pass at most one of --checkpoint=WORKDIR (a training run) or --hf_model=DIR (an "
              "HF checkpoint directory); neither evaluates the config's model.")
  if checkpoint and not os.path.isdir(os.path.join(checkpoint, checkpoints.CHECKPOINT_DIR)):
    cli.fatal(f"--checkpoint={checkpoint} has no {checkpoints.CHECKPOINT_DIR}/ directory; pass "
              "the --workdir of a training run.")
  if hf_model and not os.path.isdir(hf_model):
    cli.fatal(f"--hf_model={hf_model} is not a directory; pass an HF checkpoint directory "
              "(config.json, *.safetensors and the tokenizer files).")


def checkpoint_label(workdir: str, step: int) -> str:
  """The table's row label for a training run's policy after `step` steps."""
  return f"{os.path.basename(workdir.rstrip('/'))} step {step}"


def _load_policy(config, checkpoint: str | None, hf_model: str | None, step: int | None, mesh):
  """(graphdef, state, tokenizer, label) from a training workdir, an HF directory or, given
  neither, the config's own model source (`check_policy_flags` passed)."""
  if not checkpoint and not hf_model:
    tok = sources.load_tokenizer(config, None)
    graphdef, state = nnx.split(sources.build_policy(config, tok, mesh))
    label = os.path.basename(config.model.path.rstrip("/")) or config.model.source
    return graphdef, state, tok, label
  if checkpoint:
    graphdef, params, tok, step = sources.load_policy(config, checkpoint, step)
    return graphdef, params, tok, checkpoint_label(checkpoint, step)
  tok = ChatTokenizer.from_pretrained(hf_model)
  _, model = load_hf(hf_model, mesh=mesh, dtype=jnp.dtype(config.model.dtype))
  graphdef, state = nnx.split(model)
  return graphdef, state, tok, os.path.basename(hf_model.rstrip("/"))


def main(argv: Sequence[str]) -> None:
  """Evaluates per the flags below; only process 0 writes files."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {list(argv[1:])}")
  config = cli.config_from_flag()
  cli.check_env(config)
  check_policy_flags(_FLAGS["checkpoint"].value, _FLAGS["hf_model"].value)
  multihost.maybe_initialize_distributed()
  output = _FLAGS["output"].value
  writer = jax.process_index() == 0
  if writer:
    os.makedirs(output, exist_ok=True)
  cli.log_to(os.path.join(output, LOG_FILE) if writer else None)
  config = multihost.process_config(config)
  mesh = sharding.make_mesh(config.mesh)
  graphdef, state, tok, label = _load_policy(
      config, _FLAGS["checkpoint"].value, _FLAGS["hf_model"].value, _FLAGS["step"].value, mesh)
  label = _FLAGS["label"].value or label
  settings = EvalSettings.from_config(
      config, **{name: _FLAGS[name].value for name in (
          "split", "num_tasks", "num_samples", "max_turns", "temperature", "max_reply_tokens",
          "pass_criterion")}, ks=tuple(int(k) for k in _FLAGS["pass_k"].value))
  with envs.make_pool(config) as pool:
    result = evaluate(
        config, settings, graphdef, state, tok, pool, rng=eval_key(config.seed), mesh=mesh,
        episodes_path=os.path.join(output, f"episodes_{settings.split}.jsonl") if writer else None,
        progress_bar=writer)
  if writer:
    json_path, md_path = write_report(result, output, label, settings.split)
    with open(md_path) as f:
      print(f.read())
    logging.info("Wrote %s and %s.", json_path, md_path)
    print(result_line(result, label, settings.split, output), flush=True)
  # The others wait for process 0's files: at shutdown a process waits only as long as the
  # heartbeat timeout (multihost.maybe_initialize_distributed).
  multihost.barrier("report written")


def _define_flags() -> dict[str, Any]:
  """The command line's flags (defined only when run as a program: the trainer, which has
  its own --config, imports this module)."""
  return {
      "config": cli.define_config_flag("Experiment config file[:arg], as for training."),
      "checkpoint": flags.DEFINE_string("checkpoint", None, "Training workdir to evaluate."),
      "step": flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest)."),
      "hf_model": flags.DEFINE_string(
          "hf_model", None, "HF checkpoint directory to evaluate (neither this nor "
          "--checkpoint: the config's own model)."),
      "split": flags.DEFINE_string("split", None, "Task split (default: config.eval.split)."),
      "num_samples": flags.DEFINE_integer(
          "num_samples", None, "n: samples per task (default: config.eval.group_size)."),
      "num_tasks": flags.DEFINE_integer(
          "num_tasks", None, "First N tasks of the split; 0 = all (default: config)."),
      "max_turns": flags.DEFINE_integer(
          "max_turns", None, "Turn limit (default: the schedule's longest horizon)."),
      "max_reply_tokens": flags.DEFINE_integer(
          "max_reply_tokens", None, "Tokens per turn (default: config.rollout.max_reply_tokens)."),
      "temperature": flags.DEFINE_float(
          "temperature", None, "0 = greedy (default: config.eval.temperature)."),
      "pass_criterion": flags.DEFINE_enum(
          "pass_criterion", "score>0", ["score>0", "success"], "What counts as a pass."),
      "pass_k": flags.DEFINE_list("pass_k", ["1"], "Pass@k estimates to report (k <= n)."),
      "label": flags.DEFINE_string("label", None, "Row label in the table."),
      "output": flags.DEFINE_string("output", None, "Directory for the report files."),
  }


_FLAGS: dict[str, Any] = {}

if __name__ == "__main__":
  _FLAGS.update(_define_flags())
  flags.mark_flags_as_required(["config", "output"])
  app.run(main, flags_parser=cli.parse_flags)
