"""The README's quickstart works as written: its fenced commands, parsed from README.md, run.

What "short" means is decided here, per kind of command (`kind_of`), so that the default suite
stays minutes long:
  install  not run: it would reinstall the environment this test runs in. `.ci/run` runs these
           very lines on a fresh clone (checked below), and the whole suite runs in what they
           installed.
  train    the main job (SmolLM2 on BabyAI) takes about 1.6 hours as written, so it runs with
           the shrinking the README gives, `,runlocal` appended to each --config (one step of
           each stage, a few minutes together).
  viewer   as written.
  test     with --collect-only: run as written, the suite would run itself.
Paths under /tmp/ in the commands move under the test's tmp dir, so a reader's own runs there
are never touched. A command of no known kind fails the test: whoever adds one to the
quickstart decides here how it is tested.
"""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
KINDS = ("install", "train", "viewer", "test")


def quickstart_section() -> str:
  """README.md's "## Quickstart" section, up to the next "## " heading."""
  text = (REPO / "README.md").read_text()
  section = re.search(r"^## Quickstart\n(.*?)(?=^## )", text, re.S | re.M)
  assert section, "README.md has no '## Quickstart' section (up to the next '## ' heading)"
  return section.group(1)


def quickstart_commands() -> list[list[str]]:
  """The argv of every command in the bash blocks of the quickstart."""
  commands = []
  for block in re.findall(r"^```bash\n(.*?)^```", quickstart_section(), re.S | re.M):
    for line in block.replace("\\\n", " ").splitlines():
      argv = shlex.split(line, comments=True)
      if argv:
        commands.append(argv)
  return commands


def kind_of(argv: list[str]) -> str | None:
  if argv[:3] == ["python3", "-m", "venv"] or argv[:2] == ["pip", "install"]:
    return "install"
  for kind in ("train", "viewer"):
    if argv[:3] == ["python", "-m", f"agentgym_jax.{kind}"]:
      return kind
  return "test" if argv[:1] == ["pytest"] else None


def _flag(argv: list[str], name: str) -> str:
  (value,) = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
  return value


def test_quickstart_has_install_the_main_job_its_viewer_and_the_tests():
  commands = quickstart_commands()
  kinds = [kind_of(argv) for argv in commands]
  assert None not in kinds, f"no kind for {commands[kinds.index(None)]}: add it to kind_of"
  # Every kind is there, each first appearing in the order of KINDS.
  assert [k for i, k in enumerate(kinds) if k not in kinds[:i]] == list(KINDS), kinds
  # The shrinking that test_quickstart_commands_run applies is the one the README offers.
  assert "append `,runlocal` to both `--config`" in " ".join(quickstart_section().split())
  # The main job: behaviour cloning, then RL from that run, then the viewer on the RL run.
  bc, rl = [argv for argv in commands if kind_of(argv) == "train"]
  assert ":stage=bc" in _flag(bc, "config")
  assert f"init={_flag(bc, 'workdir')}" in _flag(rl, "config").split(":", 1)[1].split(",")
  (viewer,) = [argv for argv in commands if kind_of(argv) == "viewer"]
  assert viewer[3:] == [_flag(rl, "workdir")]


def test_ci_runs_the_quickstart_install_and_test_commands():
  """.ci/run (CI on a fresh clone) runs every install part and the test command verbatim."""
  ci_lines = [shlex.join(shlex.split(line, comments=True))
              for line in (REPO / ".ci" / "run").read_text().splitlines()]
  for argv in quickstart_commands():
    if kind_of(argv) not in ("install", "test"):
      continue
    cuts = [-1] + [i for i, arg in enumerate(argv) if arg == "&&"] + [len(argv)]
    for start, end in zip(cuts, cuts[1:]):
      part = shlex.join(argv[start + 1:end])
      assert any(part in line for line in ci_lines), f".ci/run does not run: {part}"


def _localised(argv: list[str], tmp_path: pathlib.Path) -> list[str]:
  """`argv` with /tmp/ paths moved under tmp_path and the README's `python`/`pytest` run by
  this test's interpreter."""
  argv = [arg.replace("/tmp/", f"{tmp_path}/") for arg in argv]
  if argv[0] == "python":
    return [sys.executable, *argv[1:]]
  return [sys.executable, "-m", "pytest", *argv[1:]]


def _error_of(output: str) -> str:
  """The end of a failed command's output before the interpreter's shutdown noise (threads
  still writing, such as an interrupted checkpoint's, print tracebacks after the real one)."""
  return output.split("\nException ignored in")[0][-3000:]


@pytest.mark.timeout(1200)
def test_quickstart_commands_run(tmp_path):
  env = dict(os.environ)
  # One CPU device, as on the reader's laptop (not conftest's eight), and the BC demonstration
  # cache in the tmp dir instead of the user's ~/.cache.
  env.pop("XLA_FLAGS", None)
  env.update(JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(tmp_path / "cache"))
  for argv in quickstart_commands():
    kind = kind_of(argv)
    if kind == "install":
      continue
    argv = _localised(argv, tmp_path)
    if kind == "train":
      argv = [a + ",runlocal" if a.startswith("--config=") else a for a in argv]
    elif kind == "test":
      argv.append("--collect-only")
    result = subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=900)
    assert result.returncode == 0, f"{shlex.join(argv)}:\n{_error_of(result.stdout)}"
    last = result.stdout.strip().splitlines()[-1]
    if kind == "train":
      workdir = _flag(argv, "workdir")
      assert last.startswith("Held-out success") and workdir in last, last
    elif kind == "viewer":
      index = pathlib.Path(argv[-1]) / "viewer" / "index.html"
      assert last.startswith(f"Wrote {index};") and index.is_file(), last
    else:
      # The default suite, this test in it and the slow ones left out.
      assert re.search(r"\d+/\d+ tests collected \(\d+ deselected\)", last), last
      assert "tests/test_readme.py::test_quickstart_commands_run" in result.stdout
      assert "test_bc_then_grpo" not in result.stdout
  rl_config = json.loads((tmp_path / "babyai" / "grpo" / "config.json").read_text())
  assert rl_config["init_from"] == str(tmp_path / "babyai" / "bc")


def test_readme_links_and_images_point_at_files_in_the_repo():
  targets = re.findall(r"\]\(([^)#]+)\)", (REPO / "README.md").read_text())
  local = [t for t in targets if "://" not in t]
  assert "docs/viewer_run.png" in local  # the viewer screenshot
  assert [t for t in local if not (REPO / t).exists()] == []
