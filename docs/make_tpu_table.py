r"""Compiles every paper config for its TPU slices and writes the table of docs/tpu.md.

    python docs/make_tpu_table.py --compile    # plans the configs without a result (hours)
    python docs/make_tpu_table.py              # rewrites the table from the saved results

Each (environment, schedule, model, slice) is one `python -m agentgym_jax.plan` run in a
process of its own (a 7B compile holds up to 12 GB of host memory, returned when it ends),
saved as JSON under docs/tpu_plans/; the table between the markers of docs/tpu.md is made
from those files only, so every number in it comes from a saved compile. `--only=SUBSTRING`
limits the runs to names containing it (e.g. `--only=searchqa_scaling_inter_7b`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
PLANS = os.path.join(DOCS, "tpu_plans")
PAGE = os.path.join(DOCS, "tpu.md")
BEGIN, END = "<!-- tpu table: begin -->", "<!-- tpu table: end -->"

ENVIRONMENTS = ("babyai", "sciworld", "searchqa", "textcraft", "webarena")
SCHEDULES = ("fixed", "scaling_inter")
# The slices each model size is planned for: the goal is 7B on v4-32 and v5e-64 and 3B on
# v5e-16; 7B on v5e-16 shows what the smallest 16-chip slice lacks; v5p-32 and v6e-16 are the
# 16-chip slices of the two newer generations (95 and 32 GiB of HBM a chip).
SLICES = {"7b": ("v4-32", "v5e-64", "v5e-16", "v5p-32", "v6e-16"), "3b": ("v5e-16",)}
# Where full fine-tuning cannot fit: the same configs with LoRA adapters of this rank too.
LORA_RANK, LORA_SLICES = 16, {"7b": ("v5e-16",)}
# Why a planned row does not fit, in one line (the table's last column).
WHY = {f"{env}_{schedule}_7b_v5e-16": "the float32 train state alone is 7.1 GiB a chip before "
       "any activation: the lora=16 row" for env in ENVIRONMENTS for schedule in SCHEDULES}
WHY.update({
    f"textcraft_{schedule}_7b_lora16_v5e-16": "rollout_decode needs 16.1 GiB of 15.75 at "
    "TextCraft's context, the longest of the five: a larger slice or a shorter "
    "rollout.max_context" for schedule in SCHEDULES})
WHY.update({
    f"webarena_{schedule}_7b_lora16_v5e-16": "update needs 15.96 GiB of 15.75 at WebArena's "
    "context: more algo.microbatches or a shorter rollout.max_context" for schedule in SCHEDULES})
PROGRAMS = ("rollout_extend", "rollout_decode", "score_logprobs", "score_values", "update")
GiB = 1 << 30


def runs() -> list[tuple[str, str, str]]:
  """(name, config argument, slice) of every planned run."""
  out = []
  for env in ENVIRONMENTS:
    for schedule in SCHEDULES:
      for model, slices in SLICES.items():
        for slice_ in slices:
          config = f"experiments/agentgym_rl/{env}.py:schedule={schedule},model={model}"
          if slice_ not in ("v5e-16", "v4-32"):  # the configs' default layout: 16 chips
            config += f",slice={slice_}"
          out.append((f"{env}_{schedule}_{model}_{slice_}", config, slice_))
          if slice_ in LORA_SLICES.get(model, ()):
            out.append((f"{env}_{schedule}_{model}_lora{LORA_RANK}_{slice_}",
                        f"{config},lora={LORA_RANK}", slice_))
  return out


def compile_missing(only: str) -> None:
  os.makedirs(PLANS, exist_ok=True)
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  for name, config, slice_ in runs():
    path = os.path.join(PLANS, f"{name}.json")
    if only not in name or os.path.exists(path):
      continue
    print(f"planning {name} ...", flush=True)
    result = subprocess.run([sys.executable, "-m", "agentgym_jax.plan", f"--config={config}",
                             f"--topology={slice_}", f"--json={path}"], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    print(result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "",
          result.stderr.strip().splitlines()[-1] if result.returncode else "", flush=True)


def table() -> str:
  """One row per saved plan: total GiB per chip of each program, whether all fit, FLOPs, and
  why not (WHY); then the runs not planned yet."""
  header = ("| config | slice | " + " | ".join(PROGRAMS) + " | fits | PFLOP/step | "
            "at peak | why not |")
  lines = [header, "|" + "---|" * (len(PROGRAMS) + 6)]
  missing = []
  for name, config, slice_ in runs():
    path = os.path.join(PLANS, f"{name}.json")
    if not os.path.exists(path):
      missing.append(f"`{config.split('/')[-1]}` on {slice_}")
      continue
    with open(path) as f:
      plan = json.load(f)
    programs = {p["name"]: p for p in plan["programs"]}
    cells = []
    for program in PROGRAMS:
      p = programs.get(program)
      if p is None:
        cells.append("")
        continue
      mark = ">" if p["needed"] is not None else ""
      cells.append(f"{mark}{p['total'] / GiB:.1f}" + ("" if p["fits"] else " ✗"))
    flops = sum(plan["flops"].values())
    fits = all(p["fits"] for p in programs.values())
    lines.append(f"| `{config.split('/')[-1]}` | {slice_} | " + " | ".join(cells) +
                 f" | {'yes' if fits else '**no**'} | {flops / 1e15:.1f} | "
                 f"{flops / plan['peak_flops']:.1f} s | {'' if fits else WHY.get(name, '')} |")
  if missing:
    lines.append(f"\nNot planned yet ({len(missing)}): " + ", ".join(missing) + ".")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--compile", action="store_true", help="plan the runs without a result")
  parser.add_argument("--only", default="", help="only runs whose name contains this")
  args = parser.parse_args()
  if args.compile:
    compile_missing(args.only)
  with open(PAGE) as f:
    page = f.read()
  start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
  text = table()  # before the page is opened for writing: an error leaves it as it was
  with open(PAGE, "w") as f:
    f.write(page[:start] + "\n" + text + "\n" + page[end:])
  print(f"Wrote {PAGE}")


if __name__ == "__main__":
  main()
