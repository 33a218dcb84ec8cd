"""Test-wide setup: eight fake CPU devices, so sharding is exercised without accelerators, and
the trainer's malloc settings (`agentgym_jax.host_memory`).

XLA reads the flag once, when jax is first imported, and JAX's threads pick their malloc arena
when they first allocate; hence both are set here, before any test module imports jax.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from agentgym_jax import host_memory  # pylint: disable=wrong-import-position

host_memory.keep_freed_memory()
