"""Device mesh, logical-axis rules and sharded creation of model state.

Parameters carry logical axis names (`vocab`, `embed`, `qkv`, `heads`, `mlp`, ...) in their
`out_sharding` metadata; `LOGICAL_AXIS_RULES` maps each name to a mesh axis of the
`("data", "fsdp", "tensor")` mesh. Data parallelism splits the batch over `data` and `fsdp`;
FSDP additionally splits the `embed` axis of every weight over `fsdp`; tensor parallelism splits
heads, MLP units and the vocabulary over `tensor`. Meshes use Auto axis types, so XLA's GSPMD
partitioner inserts the collectives.

    mesh = make_mesh([("data", -1), ("fsdp", 1), ("tensor", 1)])
    model = sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh)
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

M = TypeVar("M", bound=nnx.Module)

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical axis -> mesh axis (or tuple of axes, or None = replicated).
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "vocab": "tensor",
    "embed": "fsdp",
    "qkv": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "norm": None,
    "length": None,
}


def data_parallel_size(mesh: Mesh | None) -> int:
  """How many ways a batch's rows split on `mesh` (its `BATCH_AXES`; 1 without a mesh)."""
  return 1 if mesh is None else math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES)


def make_mesh(axes: Sequence[tuple[str, int]], devices: Sequence[jax.Device] | None = None
              ) -> Mesh:
  """A mesh with Auto axis types from [(name, size), ...]; at most one size may be -1.

  -1 takes whatever devices the other axes leave. Example: [("data", -1), ("fsdp", 1),
  ("tensor", 1)] is pure data parallelism over all devices.

  On a TPU slice each axis goes to whole physical axes of the chips' torus where the sizes
  allow (what `jax.make_mesh` builds), and otherwise splits a physical axis between mesh
  axes: `jax.make_mesh` refuses v5p-128 (4x4x4 chips) as data=-1, fsdp=2, since no set of its
  sides multiplies to 2. Splitting a side shares its links between two mesh axes, as
  MaxText's `allow_split_physical_axes` does; any sizes that multiply to the device count work.
  TPU devices that fill no box of the torus (a device group of asynchronous rollout: some
  chips of every host, train/asynchronous.py) have no such layout and keep the order given.
  """
  devices = list(devices if devices is not None else jax.devices())
  names = tuple(name for name, _ in axes)
  sizes = [int(size) for _, size in axes]
  if sizes.count(-1) > 1:
    raise ValueError(f"At most one mesh axis may be -1, got {list(axes)}.")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"{len(devices)} devices do not divide into mesh axes {list(axes)}.")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(f"Mesh {dict(zip(names, sizes))} needs {math.prod(sizes)} devices, "
                     f"but {len(devices)} are available; use -1 for one axis.")
  if devices[0].platform == "tpu" and not _fill_a_box(devices):
    grid = np.array(devices).reshape(sizes)
  else:
    grid = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
  return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def _fill_a_box(devices: Sequence[jax.Device]) -> bool:
  """Whether TPU `devices` are every core of every chip in the box their coordinates span,
  which `mesh_utils.create_device_mesh` requires to lay axes along the torus."""
  coords = np.array([d.coords for d in devices])
  cores = len({d.core_on_chip for d in devices})
  return len(devices) == math.prod(coords.max(0) - coords.min(0) + 1) * cores


def rollout_mesh(mesh: Mesh | None, kv_heads: int) -> Mesh | None:
  """Where a process rolls out: its devices of the train mesh (`mesh`, its
  `multihost.ProcessShare.mesh`) with the chips that share FSDP shards put on `tensor`.

  Rolled out on an FSDP mesh, every decoded token needs whole weights, and XLA gathers them
  once, outside the decode loop: a whole copy of the policy per chip (docs/tpu.md). On
  `tensor` each chip keeps its share of every block's heads and MLP units and of the
  vocabulary, activations are whole per row (`embed` is on `fsdp`, size 1 here), and a
  token's forward exchanges activations, never weights. `tensor` takes as many of the
  `fsdp` x `tensor` chips as divide `kv_heads` (a kv group, its queries and its cache rows
  stay on one chip), `data` the rest. A mesh without FSDP (fsdp 1) is returned as it is.

  The devices keep their order (a reshape of the grid), so `tensor` groups are neighbours.
  """
  if mesh is None or mesh.shape.get("fsdp", 1) == 1:
    return mesh
  tensor = math.gcd(mesh.shape["fsdp"] * mesh.shape.get("tensor", 1), kv_heads)
  sizes = {"data": mesh.size // tensor, "fsdp": 1, "tensor": tensor}
  ours = [mesh.axis_names.index(a) for a in MESH_AXES if a in mesh.axis_names]
  grid = np.moveaxis(mesh.devices, ours, range(len(ours)))
  return Mesh(grid.reshape([sizes[a] for a in MESH_AXES]), MESH_AXES,
              axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_of(tree: Any) -> Mesh | None:
  """The mesh the arrays of `tree` are laid out on (that of its first leaf with a
  NamedSharding), or None when none has one."""
  for x in jax.tree.leaves(tree):
    if isinstance(getattr(x, "sharding", None), NamedSharding):
      return x.sharding.mesh
  return None


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None, rules: dict[str, Any] | None = None) -> P:
  """PartitionSpec for an array whose axes carry logical `names`.

  Mesh axes missing from `mesh`, of size 1, or that do not divide the array's dimension (given
  `shape`) are dropped, so that dimension stays replicated instead of failing.
  """
  rules = LOGICAL_AXIS_RULES if rules is None else rules
  spec = []
  for i, name in enumerate(names):
    if name is not None and name not in rules:
      raise KeyError(f"Logical axis {name!r} has no rule; known: {sorted(rules)}.")
    target = rules.get(name) if name is not None else None
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    if mesh is not None:
      axes = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)
      if shape is not None and shape[i] % math.prod(mesh.shape[a] for a in axes):
        axes = ()
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*spec)


def _logical_names(variable: nnx.Variable) -> tuple[str | None, ...]:
  names = variable.get_metadata().get("out_sharding")
  return tuple(names) if names else (None,) * len(variable.shape)


def state_shardings(state: Any, mesh: Mesh, rules: dict[str, Any] | None = None) -> Any:
  """A tree like `state` (nnx.State, concrete or abstract) holding each leaf's NamedSharding."""
  def one(variable):
    spec = logical_to_spec(_logical_names(variable), variable.shape, mesh, rules)
    return variable.replace(NamedSharding(mesh, spec))
  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def sharded_init(factory: Callable[[], M], mesh: Mesh,
                 rules: dict[str, Any] | None = None) -> M:
  """Creates `factory()` with every parameter born sharded on `mesh`.

  The module is traced abstractly (`nnx.eval_shape`), its shardings derived from the logical
  names, and the initialiser jitted with those `out_shardings`, so no parameter is ever whole
  on one device.
  """
  graphdef, abstract = nnx.split(nnx.eval_shape(factory))
  shardings = state_shardings(abstract, mesh, rules)
  state = jax.jit(lambda: nnx.split(factory())[1], out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def put_global(x: Any, sharding: jax.sharding.Sharding | None) -> jax.Array:
  """The host array `x`, whole and the same on every process, as a jax.Array on `sharding`.

  On one process this is `jax.device_put`. A sharding that spans several processes holds
  devices that device_put cannot reach, so each process fills only the shards of its own
  devices (`jax.make_array_from_callback`).
  """
  if sharding is None or sharding.is_fully_addressable:
    return jax.device_put(x, sharding)
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def batch_sharding(shape: Sequence[int], mesh: Mesh, batch_axis: int = 0) -> NamedSharding:
  """Where `shard_batch` puts an array of `shape`: its `batch_axis` over (data, fsdp), less
  the axes of size 1 or that do not divide it (the plan gives its abstract rows the same)."""
  names = [None] * batch_axis + ["batch"] + [None] * (len(shape) - batch_axis - 1)
  return NamedSharding(mesh, logical_to_spec(names, shape, mesh))


def shard_batch(tree: Any, mesh: Mesh, batch_axis: int = 0) -> Any:
  """Puts every array of `tree` on `mesh` with its `batch_axis` split over (data, fsdp).

  Arrays whose batch dimension does not divide the data-parallel size are replicated. On a
  mesh that spans processes the leaves must be host arrays, whole on every process.
  """
  tree = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else np.asarray(x), tree)
  shardings = jax.tree.map(lambda x: batch_sharding(x.shape, mesh, batch_axis), tree)
  if mesh.is_multi_process:
    return jax.tree.map(put_global, tree, shardings)
  # One device_put for the whole tree: one transfer call instead of one per array.
  return jax.device_put(tree, shardings)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Pins activation x's sharding to its logical `names` under the current mesh.

  A no-op unless a mesh is set (`with jax.set_mesh(mesh):` around the jitted call), so models
  stay usable without any mesh. Pinning the batch axis at block boundaries keeps GSPMD on the
  data/FSDP plan instead of letting it shard activations along the hidden axis.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh))


def traced_under(mesh: Mesh, fn: Callable) -> Callable:
  """`fn`, traced with `mesh` as the current mesh, so every `constrain` inside it pins.

  A jitted step must carry its activation pins whoever calls or lowers it (the trainer, an
  evaluation, the TPU plan), not only when the caller remembered `jax.set_mesh`; the abstract
  mesh is all tracing needs, and it is the same on every process.
  """
  def under_mesh(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)
  return under_mesh
