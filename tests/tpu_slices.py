"""TPU slices' devices for tests, from libtpu (`agentgym_jax.tpus.Slice`): no TPU needed.

Without libtpu the tests that need it skip, except under CI, where `.ci/run` installs it
(`pip install -e '.[tpu]'`) and its absence is a failure.
"""

import importlib.util
import os

import pytest

from agentgym_jax import tpus


def require_libtpu() -> None:
  """Fails (CI) or skips (elsewhere) the calling test when libtpu is not installed."""
  if importlib.util.find_spec("libtpu") is not None:
    return
  if os.environ.get("CI"):
    pytest.fail("libtpu is not installed; .ci/run installs it (pip install -e '.[tpu]').",
                pytrace=False)
  pytest.skip("libtpu is not installed (pip install -e '.[tpu]'): no TPU topologies.")


def devices(name: str, one_host: bool = False) -> list:
  """The devices of the slice `name` ("v5e-16", "v4-32", ...) or of one of its hosts."""
  require_libtpu()
  return tpus.Slice.parse(name).devices(one_host=one_host)
