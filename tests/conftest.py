"""Test-wide setup: eight fake CPU devices, so sharding is exercised without accelerators.

XLA reads the flag once, when jax is first imported, hence it is set here before any test
module imports jax.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
