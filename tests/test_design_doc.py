"""docs/design.md is the map of the repository, so what it names must exist, and every pointer
to a design document in the code and docs must lead to it."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"

# `path` or `path:name` in backticks: a file or folder of the repository, and a name it defines.
_REFERENCE = re.compile(r"`((?:[\w.-]+/)+(?:[\w.-]+\.\w+)?|[\w.-]+\.(?:py|md|json|sh))"
                        r"(?::([A-Za-z_]\w*))?`")
_SOURCE_SUFFIXES = {".py", ".md", ".sh"}
_SKIPPED_DIRS = {".git", ".venv", "node_modules", "__pycache__", "build", "dist"}


def _references(text: str) -> list[tuple[str, str | None]]:
  return [(path, name) for path, name in _REFERENCE.findall(text) if "<" not in path]


def _defines(path: pathlib.Path, name: str) -> bool:
  """Whether `path` defines `name`: a def, a class, an assignment or a test of that name."""
  pattern = rf"^\s*(?:def|class)\s+{name}\b|^\s*{name}\s*(?::[^=\n]*)?=|^\s*{name}\s*:"
  return re.search(pattern, path.read_text(), re.MULTILINE) is not None


def test_every_path_and_name_the_design_names_exists():
  references = _references(DESIGN.read_text())
  assert len(references) > 50, "docs/design.md names the modules it describes"
  missing = []
  for path, name in references:
    target = ROOT / path
    if not target.exists():
      missing.append(f"{path} (no such file or folder)")
    elif name and not _defines(target, name):
      missing.append(f"{path}:{name} (not defined there)")
  assert not missing, "docs/design.md names what the repository lacks:\n" + "\n".join(missing)


def test_reference_finder_reads_paths_and_names():
  found = _references("see `agentgym_jax/rl/advantages.py:ESTIMATORS`, `environments/babyai/` "
                      "and `environments/<name>/env.py`, not `gamma` or `config.env.name`")
  assert found == [("agentgym_jax/rl/advantages.py", "ESTIMATORS"), ("environments/babyai/", "")]
  assert _defines(ROOT / "tests" / "test_layout.py", "FLOORS")
  assert not _defines(ROOT / "tests" / "test_layout.py", "CEILINGS")


def _project_files():
  for path in ROOT.rglob("*"):
    if (path.suffix in _SOURCE_SUFFIXES and path.is_file() and path != pathlib.Path(__file__)
        and not _SKIPPED_DIRS & set(path.relative_to(ROOT).parts)):
      yield path


def _wrong_design_pointers(text: str, where: pathlib.Path) -> list[str]:
  """The names of design documents in `text` (of the file `where`) that do not lead to
  docs/design.md, from the repository's root or from the file's own folder."""
  names = [m.group(0) for m in re.finditer(r"[\w./-]*design\.md", text, re.IGNORECASE)]
  return [name for name in names
          if DESIGN not in ((ROOT / name).resolve(), (where.parent / name).resolve())]


def test_every_pointer_to_a_design_document_leads_to_docs_design_md():
  """A design document cited by name resolves to docs/design.md: a DESIGN.md outside the
  repository is a map that a clone of it does not have."""
  wrong = [f"{path.relative_to(ROOT)}: {name}" for path in _project_files()
           for name in _wrong_design_pointers(path.read_text(errors="replace"), path)]
  assert not wrong, "Cite the design as docs/design.md:\n" + "\n".join(wrong)


def test_design_pointers_that_lead_elsewhere_are_found():
  module = ROOT / "agentgym_jax" / "rollout" / "envs.py"
  assert _wrong_design_pointers("The rule of docs/design.md: ...", module) == []
  assert _wrong_design_pointers("DESIGN.md's rule; ../shared/DESIGN.md", module) == [
      "DESIGN.md", "../shared/DESIGN.md"]
  assert _wrong_design_pointers("[the map](design.md)", ROOT / "docs" / "tpu.md") == []
