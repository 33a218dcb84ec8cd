"""Test-wide setup: eight fake CPU devices, so sharding is exercised without accelerators, and
one persistent compilation cache for every test process.

XLA reads the flag once, when jax is first imported, hence it is set here before any test
module imports jax.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# libtpu (the `tpu` extra) compiles for TPU topologies on this CPU host; pytest-xdist's two
# processes both load it, which libtpu refuses unless told that is intended.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# Every test process saves and loads XLA executables in one persistent cache, the one a run's
# config defaults to (JAX_COMPILATION_CACHE_DIR, else ~/.cache/agentgym_jax/jax_compile): the
# two pytest-xdist processes, the command lines tests start, and the next session all reuse
# what any of them compiled. Tests that need their own cache set JAX_COMPILATION_CACHE_DIR or
# --config.compile.cache_dir in the processes they start. Imported after XLA_FLAGS is set.
from agentgym_jax import caches  # pylint: disable=wrong-import-position

caches.use_compilation_cache(caches.default_compilation_cache_dir())
