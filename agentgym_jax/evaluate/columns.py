"""The paper's table columns of each environment, from the categories its tasks report.

Categories come from the environment's reset `info["category"]` (TextCraft's crafting depth,
SciWorld's task, BabyAI's level, SearchQA's question source; a remote env's from its split
file) and are grouped into the paper's columns by `PAPER_COLUMNS`; a category no rule matches
is reported under its own name.
"""

from __future__ import annotations

import re

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
