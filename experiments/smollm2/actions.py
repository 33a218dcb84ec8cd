r"""Which actions a checkpoint's agent takes, per BabyAI level group, from evaluation episodes.

  python -m experiments.smollm2.actions bc=/tmp/smollm2/bc/eval_all/step_8 \
      seed0=/tmp/smollm2/seeds/seed=0/eval_all/step_24 ...

Each argument is LABEL=DIR, DIR holding an `evaluate` report's episodes_test.jsonl. Levels are
grouped into the paper's columns as the report groups them (`evaluate.columns.paper_column`:
GoTo, Pickup, ...). Printed, per label and group: episodes, successes, how many episodes open with each action verb (the first word
of the first turn's action: "go", "pickup", "turn", ...), and how many use the verb the group
is named after at any turn ("pickup" in Pickup levels, "go" in GoTo levels), in Markdown.
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
from collections.abc import Iterable, Sequence

from agentgym_jax.evaluate import columns

_ACTION = re.compile(r"Action:\s*(.+)")
# The verb each level group is about (BabyAI's action words).
_GROUP_VERB = {"GoTo": "go", "Pickup": "pickup", "Open": "toggle", "PutNext": "drop"}


def actions(episode: dict) -> list[str]:
  """The actions of an episode's turns, in order ("" for a reply without one). AgentGym's
  prompt opens with a scripted exchange whose reply ("OK. I'll follow ...") is no turn."""
  replies = [m["content"] for m in episode["messages"] if m["role"] == "assistant"]
  if replies and not _ACTION.search(replies[0]):
    replies = replies[1:]
  return [found.group(1).strip() if (found := _ACTION.search(r)) else "" for r in replies]


def verb(action: str) -> str:
  """An action's first word ("go to red ball 1" -> "go"); "none" for no action."""
  return action.split()[0].lower() if action.split() else "none"


def summarize(episodes: Iterable[dict]) -> dict[str, dict]:
  """Per level group: {"episodes", "successes", "first": Counter of first verbs, "uses_verb":
  episodes using the group's own verb at any turn (0 when the group has no such verb)}."""
  groups: dict[str, dict] = {}
  for episode in episodes:
    group = columns.paper_column("babyai", episode["category"])
    row = groups.setdefault(group, {"episodes": 0, "successes": 0,
                                    "first": collections.Counter(), "uses_verb": 0})
    taken = [a for a in actions(episode) if a]
    row["episodes"] += 1
    row["successes"] += int(bool(episode["success"]))
    row["first"][verb(taken[0]) if taken else "none"] += 1
    own = _GROUP_VERB.get(group)
    row["uses_verb"] += int(own is not None and any(verb(a) == own for a in taken))
  return groups


def table(summaries: dict[str, dict[str, dict]]) -> str:
  """Markdown: one row per (label, group)."""
  lines = ["| checkpoint | levels | episodes | successes | first action (episodes) | "
           "use the levels' verb |", "|---|---|---:|---:|---|---:|"]
  for label, groups in summaries.items():
    for group in sorted(groups):
      row = groups[group]
      first = ", ".join(f"{v} {n}" for v, n in row["first"].most_common())
      own = _GROUP_VERB.get(group)
      uses = f'{row["uses_verb"]} ("{own}")' if own else ""
      lines.append(f"| {label} | {group} | {row['episodes']} | {row['successes']} | {first} | "
                   f"{uses} |")
  return "\n".join(lines)


def read(directory: str) -> list[dict]:
  path = os.path.join(directory, "episodes_test.jsonl")
  if not os.path.exists(path):
    raise SystemExit(f"No {path}: pass LABEL=DIR with DIR an `evaluate --output` directory.")
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def main(argv: Sequence[str]) -> None:
  if not argv or any("=" not in a for a in argv):
    raise SystemExit("usage: python -m experiments.smollm2.actions LABEL=DIR [LABEL=DIR ...]")
  summaries = {label: summarize(read(directory))
               for label, directory in (a.split("=", 1) for a in argv)}
  print(table(summaries))


if __name__ == "__main__":
  main(sys.argv[1:])
