"""Test-wide setup: eight fake CPU devices, so sharding is exercised without accelerators.

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
