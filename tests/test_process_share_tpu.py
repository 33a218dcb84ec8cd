"""Each process's share of a TPU pod slice, on the real device orders of the slices (libtpu).

`jax.make_mesh` orders a TPU slice's devices physically (rings through the chips), so a host's
chips are spread through the mesh instead of forming one block, unlike the fake CPU devices of
tests/test_multihost.py. libtpu describes a slice's devices without a TPU
(`topologies.get_topology_desc`), each with its `process_index`, so the share of every process
of v5e-16, v4-32, v5e-64 and v5p-128 is checked here, and the parameter gather for one slice is
compiled for its TPU (a compile for a subset of a slice's devices fails inside libtpu, hence
the whole slice's mesh).
"""

import os

import pytest

# Two test processes (pytest-xdist) may load libtpu at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# pylint: disable=wrong-import-position
import jax
import tpu_slices
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentgym_jax import multihost, sharding

# Every host holds 2x2 chips (agentgym_jax/tpus.py).
SLICES = ("v5e-16", "v4-32", "v5e-64", "v5p-128")
PAPER = (("data", 1), ("fsdp", -1), ("tensor", 1))  # experiments/agentgym_rl/common.py
DATA = (("data", -1), ("fsdp", 1), ("tensor", 1))
# tensor=2 lies within a host where jax.make_mesh can lay it; data=2 splits the batch over
# two axes.
MESHES = {"paper": PAPER, "data": DATA, "tensor2": (("data", 1), ("fsdp", -1), ("tensor", 2)),
          "data2": (("data", 2), ("fsdp", -1), ("tensor", 1))}
# Parameter specs as logical_to_spec gives them (embed on fsdp, heads/mlp/vocab on tensor).
SPECS = (P("fsdp", "tensor"), P("tensor", "fsdp"), P(None, "fsdp"), P("tensor"), P())
SHAPE = (256, 512)
ROWS = 256


def _devices(name: str) -> list:
  return tpu_slices.devices(name)


def _shares(mesh: Mesh) -> list[multihost.ProcessShare]:
  processes = sorted({d.process_index for d in mesh.devices.flat})
  return [multihost.process_share(mesh, p) for p in processes]


def _check(mesh: Mesh) -> None:
  """The share of every process of `mesh` is right: see the test below."""
  shares = _shares(mesh)
  rows = [share.rows(ROWS) for share in shares]
  counts = np.bincount(np.concatenate(rows), minlength=ROWS)
  assert (counts == 1).all(), f"rows owned {sorted(set(counts.tolist()))} times"
  batch = NamedSharding(mesh, P(sharding.BATCH_AXES)).devices_indices_map((ROWS,))
  for p, (share, mine) in enumerate(zip(shares, rows)):
    assert share.multi_process and share.process == p
    assert share.mesh.axis_names == mesh.axis_names
    assert {d.id for d in share.mesh.devices.flat} == {
        d.id for d in mesh.devices.flat if d.process_index == p}
    # A local device holds the same rows in the process's rollout as in the whole batch.
    local = NamedSharding(share.mesh, P(sharding.BATCH_AXES)).devices_indices_map((mine.size,))
    for device, index in local.items():
      np.testing.assert_array_equal(mine[index], np.arange(ROWS)[batch[device]])
    # What each device holds after the gather (or, without one, already) is its shard of the
    # parameter on the process's mesh, so the local copy is those shards.
    for spec in SPECS:
      wanted = NamedSharding(share.mesh, spec).devices_indices_map(SHAPE)
      held = (NamedSharding(mesh, spec) if share.gather is None
              else share.gather_sharding(spec)).devices_indices_map(SHAPE)
      assert all(held[d] == index for d, index in wanted.items()), (p, spec)


# jax.make_mesh cannot lay an axis of 32 (or 2 x 32) on v5p-128's 4x4x4 torus.
CASES = [(s, m) for s in sorted(SLICES) for m in sorted(MESHES)
         if not (s == "v5p-128" and m in ("tensor2", "data2"))]


@pytest.mark.parametrize("slice_name,mesh_name", CASES)
def test_every_process_gets_its_own_rows_devices_and_params(slice_name, mesh_name):
  devices = _devices(slice_name)
  mesh = sharding.make_mesh(MESHES[mesh_name], devices)
  if mesh_name in ("paper", "data"):  # one axis over all chips, in physical ring order,
    owner = np.vectorize(lambda d: d.process_index)(mesh.devices).reshape(-1)
    assert (np.diff(owner) < 0).any()  # so no host's chips are one block of it
  _check(mesh)


def test_any_device_order_works():
  # Shuffled slices: a process's devices are no sub-grid of the mesh (`_local_grids` then puts
  # its batch positions on `data`) or are one.
  devices = np.array(_devices("v5e-16"))
  rng = np.random.default_rng(0)
  for shape in [(16, 1, 1), (1, 16, 1), (2, 8, 1), (4, 4, 1)]:
    for _ in range(4):
      order = rng.permutation(devices.size)
      _check(Mesh(devices[order].reshape(shape), sharding.MESH_AXES))
  # tensor pairs within a host, in shuffled order.
  pairs = np.array(sorted(devices, key=lambda d: d.process_index)).reshape(8, 2)
  _check(Mesh(pairs[rng.permutation(8)].reshape(2, 4, 2), sharding.MESH_AXES))


def test_a_tensor_axis_across_hosts_is_refused():
  # jax.make_mesh lays a 4-chip tensor axis of a v5e slice on a 1x4 ring of two hosts.
  mesh = sharding.make_mesh((("data", 1), ("fsdp", -1), ("tensor", 4)), _devices("v5e-16"))
  with pytest.raises(ValueError, match=r"Mesh axes \['tensor'\] of .* span processes"):
    multihost.process_share(mesh, 0)


def test_the_parameter_gather_compiles_for_the_slice():
  # The program `ProcessShare.local` runs, for every parameter spec at once, AOT on v5e-16
  # (FSDP over the 16 chips, 4 per host): it compiles, and its outputs are sharded as planned.
  mesh = sharding.make_mesh(PAPER, _devices("v5e-16"))
  share = multihost.process_share(mesh, 0)
  assert share.gather is not None
  args = [jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=NamedSharding(mesh, spec))
          for spec in SPECS]
  out = [share.gather_sharding(spec) for spec in SPECS]
  gather = jax.jit(multihost._identity, out_shardings=out)  # pylint: disable=protected-access
  compiled = gather.lower(args).compile()
  for got, want in zip(compiled.output_shardings, out):
    assert got.devices_indices_map(SHAPE) == want.devices_indices_map(SHAPE)
  # Per chip: a quarter (the host's FSDP shard) of each array sharded over fsdp, the others
  # whole; and no temporary as large as that quarter, so no array is ever whole on a chip.
  whole = np.prod(SHAPE) * 4
  memory = compiled.memory_analysis()
  assert 0 <= memory.output_size_in_bytes - (3 * whole // 4 + 2 * whole) < whole // 64
  assert memory.temp_size_in_bytes < whole // 4
