"""TPU slices as users name them ("v5e-16", "v4-32", "v5p-128", "v6e-8"): chips, hosts, the
chip's peak and HBM, and the slice's devices from libtpu (compiling for them needs no TPU).

Experiment configs size their micro-batches and mesh by a slice's chip count; the plan
(`agentgym_jax.plan`) compiles for its devices (a slice is one kind of `targets.Target`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation.

  Attributes:
    name: the name users write ("v5e").
    cores: TensorCores per chip; v4 and v5p slice names count cores, v5e and v6e chips.
    dims: 2 (a 2-D torus of chips) or 3.
    chip_config: libtpu's name of how the cores form one device ("megacore": one device per
      chip, as JAX runs v4 and v5p).
    bf16_tflops: peak dense bf16 matmul throughput per chip.
    hbm_gib: HBM per chip, as sold.
    usable_gib: what one program may use, as libtpu 0.0.42's compiler reports it.
  """

  name: str
  cores: int
  dims: int
  chip_config: str
  bf16_tflops: float
  hbm_gib: float
  usable_gib: float


# Peak and HBM: Google Cloud's TPU pages (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e,
# "System architecture"). Usable: the limit in libtpu's "exceeds available HBM" message.
CHIPS = {
    "v4": Chip("v4", cores=2, dims=3, chip_config="megacore", bf16_tflops=275.0,
               hbm_gib=32.0, usable_gib=30.75),
    "v5e": Chip("v5e", cores=1, dims=2, chip_config="default", bf16_tflops=197.0,
                hbm_gib=16.0, usable_gib=15.75),
    "v5p": Chip("v5p", cores=2, dims=3, chip_config="megacore", bf16_tflops=459.0,
                hbm_gib=95.0, usable_gib=95.74),
    "v6e": Chip("v6e", cores=1, dims=2, chip_config="default", bf16_tflops=918.0,
                hbm_gib=32.0, usable_gib=31.25),
}
# Chips per host: a 2x2 board, except the 8-chip single-host v5e and v6e machines (2x4).
HOST_BOUNDS = (2, 2, 1)
SINGLE_HOST_8 = (2, 4, 1)
# A slice name: generation, then TensorCores (v4, v5p) or chips (v5e, v6e).
SLICE_NAME = re.compile(r"(v\d+[a-z]?)-(\d+)")


def _grid(chips: int, dims: int) -> tuple[int, ...]:
  """The chip grid of a slice of `chips` chips: its sides powers of two, ascending with sides
  of 1 last (v4:2x2x1, v4:2x2x4, v5e:4x8), as Cloud TPU's slice shapes are."""
  if chips < 1 or chips & (chips - 1):
    raise ValueError(f"{chips} chips: slice names like v5e-16, v4-32 or v5p-128 give a "
                     "power-of-two chip count.")
  sides = [1] * dims
  i = 0
  while math.prod(sides) < chips:
    sides[i % dims] *= 2
    i += 1
  return tuple(sorted(sides, key=lambda side: (side == 1, side)))  # v4:2x2x1, v4:2x2x4


@dataclasses.dataclass(frozen=True)
class Slice:
  """A TPU slice as users name it ("v5e-16", "v4-32", "v5p-128", "v6e-8")."""

  name: str
  chip: Chip
  grid: tuple[int, ...]
  # As a `targets.Target`:
  platform = "tpu"
  unit = "chip"
  memory = "HBM"
  larger = "a larger slice"

  @classmethod
  def parse(cls, name: str) -> "Slice":
    """Raises ValueError naming the known generations on a name it cannot read."""
    match = SLICE_NAME.fullmatch(name.strip())
    if not match or match.group(1) not in CHIPS:
      raise ValueError(f"--topology={name!r} is not a slice name like v5e-16, v4-32, v5p-128 or "
                       f"v6e-8 (generations: {sorted(CHIPS)}).")
    chip = CHIPS[match.group(1)]
    count = int(match.group(2))
    if count % chip.cores:
      raise ValueError(f"{name}: {chip.name} slice names count TensorCores, {chip.cores} per "
                       "chip; the number must be a multiple of it.")
    return cls(name, chip, _grid(count // chip.cores, chip.dims))

  @property
  def chips(self) -> int:
    return math.prod(self.grid)

  @property
  def host_grid(self) -> tuple[int, int, int]:
    """The chips of one host, as libtpu's three bounds."""
    grid = self.grid + (1,) * (3 - len(self.grid))
    if self.chip.dims == 2 and grid == SINGLE_HOST_8:
      return SINGLE_HOST_8
    return tuple(min(g, b) for g, b in zip(grid, HOST_BOUNDS))

  @property
  def hosts(self) -> int:
    return self.chips // math.prod(self.host_grid)

  @property
  def usable_bytes(self) -> int:
    return int(self.chip.usable_gib * GiB)

  @property
  def peak_flops(self) -> float:
    """Dense bf16 matmul FLOP/s of all its chips."""
    return self.chips * self.chip.bf16_tflops * 1e12

  def describe(self) -> str:
    return (f"{self.name}: {self.chips} chips ({'x'.join(map(str, self.grid))}, {self.hosts} "
            f"host{'s' * (self.hosts > 1)}), {self.chip.usable_gib:g} GiB usable HBM and "
            f"{self.chip.bf16_tflops:g} bf16 TFLOP/s per chip")

  def devices(self, one_host: bool = False) -> list[Any]:
    """The slice's devices (or those of a one-host slice of its generation), from libtpu."""
    from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
    grid = self.host_grid[:self.chip.dims] if one_host else self.grid
    topology = topologies.get_topology_desc(
        platform="tpu", topology_name=f"{self.chip.name}:{'x'.join(map(str, grid))}",
        chip_config_name=self.chip.chip_config, chips_per_host_bounds=self.host_grid,
        num_slices=1)
    return list(topology.devices)
