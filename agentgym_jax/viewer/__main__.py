r"""Command line of the viewer: writes the static site of a run and prints where it is.

  python -m agentgym_jax.viewer WORKDIR [--out DIR]
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from agentgym_jax import viewer

_OUT = flags.DEFINE_string("out", None, "Output directory (default: WORKDIR/viewer).")


def main(argv: list[str]) -> None:
  if len(argv) != 2:
    sys.exit("Usage: python -m agentgym_jax.viewer WORKDIR [--out DIR]")
  try:
    index = viewer.build(argv[1], _OUT.value)
  except FileNotFoundError as e:
    sys.exit(f"FATAL: {e}")
  index = os.path.abspath(index)
  print(f"Wrote {index}; open it in a browser (file://{index}).")


if __name__ == "__main__":
  app.run(main)
