r"""Evaluates a policy on an environment's task split: Avg@n / Pass@n per category, paper tables.

  python -m agentgym_jax.evaluate --config=experiments/agentgym_rl/babyai.py:model=7b \
      [--checkpoint=WORKDIR | --hf_model=DIR] [--split=test] [--num_samples=n] \
      [--max_turns=T] [--max_reply_tokens=N] [--temperature=t] --output=DIR

With neither --checkpoint nor --hf_model it evaluates the config's own model (`config.model`,
e.g. `:model=smollm2` zero-shot) with the config's tokenizer.

The config supplies the environment, the tokenizer and model shape (for a training
checkpoint), the sampler and the evaluation defaults (`config.eval`); flags override them.
Every task of the split (or the first `--num_tasks`) runs n times through the rollout engine
(`evaluation.evaluate`, as the trainer's in-loop evaluation does). On several hosts (the same
command on each, as for training) every process runs a share of the episodes and process 0
writes the report of all of them.

Writes into --output: `eval_<split>.json` (settings, metrics, per-task results),
`eval_<split>.md` (a table shaped like the paper's), `episodes_<split>.jsonl` (every
episode's tokens and text) and `evaluate.log` (the INFO log). The terminal shows a progress
bar over the episodes, the table and one line of the overall numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
import os
from typing import Any

from absl import app, flags, logging
import jax
import jax.numpy as jnp
from flax import nnx

from agentgym_jax import caches
from agentgym_jax import cli
from agentgym_jax import freed_memory
from agentgym_jax import multihost
from agentgym_jax import policies
from agentgym_jax import settings as settings_lib
from agentgym_jax import sharding
from agentgym_jax.evaluate import checkpoint_label, eval_key, evaluate, result_line, write_report
from agentgym_jax.models import load_hf
from agentgym_jax.rollout import envs
from agentgym_jax.tokenization import ChatTokenizer

LOG_FILE = "evaluate.log"  # INFO logging, in --output (cli.log_to)


def check_policy_flags(checkpoint: str | None, hf_model: str | None) -> None:
  """Exits with one line, before anything is read or written, when the policy flags cannot
  name a policy (e.g. a tokenizer would otherwise be written into a wrong --checkpoint)."""
  if checkpoint and hf_model:
    cli.fatal("Pass at most one of --checkpoint=WORKDIR (a training run) or --hf_model=DIR (an "
              "HF checkpoint directory); neither evaluates the config's model.")
  if checkpoint and not os.path.isdir(os.path.join(checkpoint, policies.CHECKPOINT_DIR)):
    cli.fatal(f"--checkpoint={checkpoint} has no {policies.CHECKPOINT_DIR}/ directory; pass "
              "the --workdir of a training run.")
  if hf_model and not os.path.isdir(hf_model):
    cli.fatal(f"--hf_model={hf_model} is not a directory; pass an HF checkpoint directory "
              "(config.json, *.safetensors and the tokenizer files).")


def _load_policy(policy: policies.PolicySettings, env: envs.EnvSettings, checkpoint: str | None,
                 hf_model: str | None, step: int | None, mesh):
  """(graphdef, state, tokenizer, label) from a training workdir, an HF directory or, given
  neither, the config's own model source (`check_policy_flags` passed)."""
  if not checkpoint and not hf_model:
    tok = policies.load_tokenizer(policy, env, None)
    graphdef, state = nnx.split(policies.build_policy(policy, tok, mesh))
    label = os.path.basename(policy.path.rstrip("/")) or policy.source
    return graphdef, state, tok, label
  if checkpoint:
    graphdef, params, tok, step = policies.load_policy(policy, env, checkpoint, mesh=mesh,
                                                       step=step)
    return graphdef, params, tok, checkpoint_label(checkpoint, step)
  tok = ChatTokenizer.from_pretrained(hf_model)
  _, model = load_hf(hf_model, mesh=mesh, dtype=jnp.dtype(policy.dtype))
  graphdef, state = nnx.split(model)
  return graphdef, state, tok, os.path.basename(hf_model.rstrip("/"))


def main(argv: Sequence[str]) -> None:
  """Evaluates per the flags below; only process 0 writes files."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {list(argv[1:])}")
  # The config, read here once: every part below takes its typed settings.
  config = cli.config_from_flag()
  env = settings_lib.checked_env(config)
  check_policy_flags(_FLAGS["checkpoint"].value, _FLAGS["hf_model"].value)
  freed_memory.return_freed_memory()
  cli.use_compilation_cache(config.compile.cache_dir)
  # As the trainer: programs dropped between turns past compile.max_resident_gib resident.
  freed_memory.set_program_budget(freed_memory.budget_of(
      config.compile.max_resident_gib, caches.CompileCounter().built))
  multihost.maybe_initialize_distributed()
  output = _FLAGS["output"].value
  writer = jax.process_index() == 0
  if writer:
    os.makedirs(output, exist_ok=True)
  cli.log_to(os.path.join(output, LOG_FILE) if writer else None)
  env = multihost.process_env(env)
  mesh = sharding.make_mesh(config.mesh)
  graphdef, state, tok, label = _load_policy(
      settings_lib.policy(config), env, _FLAGS["checkpoint"].value, _FLAGS["hf_model"].value,
      _FLAGS["step"].value, mesh)
  label = _FLAGS["label"].value or label
  settings = settings_lib.evaluation(
      config, **{name: _FLAGS[name].value for name in (
          "split", "num_tasks", "num_samples", "max_turns", "temperature", "max_reply_tokens",
          "pass_criterion")}, ks=tuple(int(k) for k in _FLAGS["pass_k"].value))
  with envs.make_pool(env) as pool:
    result = evaluate(
        env, settings, graphdef, state, tok, pool, rng=eval_key(config.seed), mesh=mesh,
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
  """The command line's flags (defined only when run as a program, so that importing this
  module, as a test does, defines none)."""
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
          "num_tasks", None, "First N tasks of the split (of each environment's in a "
          "mixture); 0 = all (default: config)."),
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
