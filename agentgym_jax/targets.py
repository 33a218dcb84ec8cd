"""What the plan (`agentgym_jax.plan`) compiles a training step for: a TPU slice
(`tpus.Slice`: "v5e-16", compiled ahead of time with libtpu on any machine) or this machine's
own devices (`Local`: "cpu", "gpu"). Both are a `Target`, so the plan asks them the same
questions: their devices, how many hosts roll out, the bytes a program may hold on a device,
and the platform the model's "auto" settings resolve for.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Protocol

import jax

from agentgym_jax import tpus

GiB = tpus.GiB
LOCAL = ("cpu", "gpu")


class Target(Protocol):
  """Where a run is planned for.

  Attributes:
    name: as the user wrote it ("v5e-16", "cpu").
    platform: its devices' platform ("tpu", "cpu", "gpu"), which the model's "auto" attention
      and layer loop resolve for.
    hosts: processes of the run; each rolls out its own rows on its own devices.
    unit: what one device is called in the report ("chip", "device").
    memory: what its bytes are called ("HBM", "RAM", "GPU memory").
    larger: what to use instead when a program does not fit ("a larger slice").
    usable_bytes: what one program may hold on one device.
    peak_flops: of all its devices together; None where not known (no time is then given).
  """

  name: str
  platform: str
  hosts: int
  unit: str
  memory: str
  larger: str

  @property
  def usable_bytes(self) -> int: ...

  @property
  def peak_flops(self) -> float | None: ...

  def devices(self, one_host: bool = False) -> list[Any]:
    """Its devices, or those of one of its hosts."""

  def describe(self) -> str:
    """The report's header: name, devices and memory."""


@dataclasses.dataclass(frozen=True)
class Local:
  """This machine's devices of one platform, as this process's JAX sees them.

  Attributes:
    platform: "cpu" or "gpu".
    memory_bytes: for "cpu" the host's RAM, which its CPU devices share
      (`--xla_force_host_platform_device_count` makes several); for "gpu" one device's.
    source: where `memory_bytes` came from, for the header.
  """

  platform: str
  memory_bytes: int
  source: str
  hosts = 1
  unit = "device"

  @classmethod
  def detect(cls, platform: str, memory_gib: float | None = None) -> "Local":
    """The local `platform`'s devices and memory; `memory_gib` replaces the memory found.

    Raises:
      ValueError: no device of `platform` in this process, or a GPU without memory stats.
    """
    devices = _local_devices(platform)
    if memory_gib is not None:
      return cls(platform, int(memory_gib * GiB), "--memory_gib")
    if platform == "cpu":
      return cls(platform, *_host_ram())
    stats = devices[0].memory_stats() or {}
    if "bytes_limit" not in stats:
      raise ValueError(f"--topology={platform}: {devices[0].device_kind} reports no memory "
                       "limit; give it with --memory_gib.")
    # bytes_limit is what XLA's allocator may hand out (XLA_PYTHON_CLIENT_MEM_FRACTION of the
    # device), so what one program may hold.
    return cls(platform, stats["bytes_limit"], "the allocator's bytes_limit")

  @property
  def name(self) -> str:
    return self.platform

  @property
  def memory(self) -> str:
    return "RAM" if self.platform == "cpu" else "GPU memory"

  @property
  def larger(self) -> str:
    return "a machine with more RAM" if self.platform == "cpu" else "a GPU with more memory"

  @property
  def usable_bytes(self) -> int:
    # CPU devices are parts of one process: their programs run side by side in one RAM.
    shared = len(self.devices()) if self.platform == "cpu" else 1
    return self.memory_bytes // shared

  @property
  def peak_flops(self) -> float | None:
    return None  # a CPU's or GPU's peak depends on its model and dtype; not tabulated here

  def devices(self, one_host: bool = False) -> list[Any]:
    del one_host  # one host: all of them
    return _local_devices(self.platform)

  def describe(self) -> str:
    count = len(self.devices())
    kind = "" if self.platform == "cpu" else f" ({self.devices()[0].device_kind})"
    shared = self.platform == "cpu" and count > 1
    return (f"{self.name}: {count} device{'s' * (count > 1)}{kind}, "
            f"{self.memory_bytes / GiB:.3g} GiB {self.memory}"
            f"{'' if self.platform == 'cpu' else ' per device'} ({self.source}"
            f"{f', {self.usable_bytes / GiB:.3g} GiB a device' if shared else ''})")


def _local_devices(platform: str) -> list[Any]:
  try:
    return jax.devices(platform)
  except RuntimeError:
    platforms = os.environ.get("JAX_PLATFORMS")
    raise ValueError(f"--topology={platform}: JAX finds no {platform} device in this process"
                     + (f" (JAX_PLATFORMS={platforms})" if platforms else "") + "; plan for "
                     "a device it has, or for a TPU slice like v5e-16.") from None


def _host_ram() -> tuple[int, str]:
  """(bytes, where from): MemTotal of /proc/meminfo (psutil where there is none), or a
  container's cgroup limit where that is lower: what the process may fill before it is
  killed."""
  try:
    with open("/proc/meminfo") as f:
      total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    found = (total, "MemTotal")
  except (OSError, StopIteration):
    import psutil  # pylint: disable=import-outside-toplevel
    found = (psutil.virtual_memory().total, "psutil")
  for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
      with open(path) as f:
        limit = f.read().strip()
    except OSError:
      continue
    if limit.isdigit() and int(limit) < found[0]:
      found = (int(limit), "the cgroup's limit")
  return found


def parse(name: str, memory_gib: float | None = None) -> Target:
  """The target `--topology=name` names: "cpu" or "gpu" (this machine's), or a TPU slice.

  `memory_gib` replaces the memory the target has: the host's RAM for "cpu", one device's
  for a GPU or a TPU chip.

  Raises:
    ValueError: a name that is neither (naming the forms), a slice of an unknown generation,
      or a local platform this process has no device of.
  """
  if name.strip() in LOCAL:
    return Local.detect(name.strip(), memory_gib)
  if not tpus.SLICE_NAME.fullmatch(name.strip()):
    raise ValueError(f"--topology={name!r} is neither cpu, gpu (this machine's devices) nor a "
                     "TPU slice name like v5e-16, v4-32, v5p-128 or v6e-8.")
  slice_ = tpus.Slice.parse(name)
  if memory_gib is None:
    return slice_
  chip = dataclasses.replace(slice_.chip, usable_gib=memory_gib)
  return dataclasses.replace(slice_, chip=chip)
