"""Multi-host runs: one JAX process per host, each rolling out its own share of every batch.

In JAX's multi-controller runtime every process runs the same Python program, and a jitted
function over a mesh that spans processes is one SPMD program that every process must call
in the same order with the same shapes. The scoring passes and the update are such programs.
The episode runner cannot be one: a process's episodes end at their own turns and its
environments answer at their own pace. So each process runs its share of the episodes on its
own devices, and the pieces meet as whole batches:

  share = process_share(mesh)
  traj, stats = run_episodes((graphdef, share.local(params)), tok, pool, task_ids, settings,
                             mesh=share.mesh, rows=share.rows(num_rows))
  host, episodes = gather_trajectory(traj, stats["episodes"], share.rows(num_rows), pad_id)
  tokens = sharding.put_global(host.tokens, rows_sharding)   # [B, L] over the whole mesh

Row r of a batch is rolled out by the process whose devices hold row r under the batch
sharding, with the random key and group id it has in the whole batch, so a run's samples do
not depend on how many processes share it. After `gather_trajectory` every process holds the
whole batch on the host (O(B * L) bytes, small next to a rollout), so the metrics are the
same numbers on every process and average over all episodes.

The mesh's devices may come in any order: on a TPU slice `jax.make_mesh` orders them by the
chips' physical rings, so a host's chips are spread through the mesh, not one block of it.
Which rows a process rolls out is read off the batch sharding itself. Its rollout mesh holds
its devices with the same axis names (`_local_grids`: the sub-grid of the mesh they form, else
its batch positions along `data`), and `ProcessShare.local` gathers the parameters over the
processes into that mesh's sharding with one jitted identity, whose output sharding keeps the
whole mesh's device order and permutes the devices (`ProcessShare.gather_sharding`); so the
training mesh keeps its physical order, which its collectives are laid out for. Requirements:
every process holds as many devices of the mesh, and the `tensor` axis lies within a process
(otherwise two processes would roll out the same rows; on a v5e slice `jax.make_mesh` lays
tensor=4 across two hosts, tensor=2 within one).

Start-up: `maybe_initialize_distributed`, called before anything touches a device, starts the
multi-controller runtime when the environment describes several hosts; from then on a lost
process stops the others within `heartbeat_timeout_s()` seconds.

Threads: a program that spans processes must be called by every process in the same order,
so only the main thread calls them. Another thread that gathers objects (the asynchronous
rollout's, train/asynchronous.py: its episodes, rolled out on its own devices of every process)
does it inside `gathers_through(KeyValueChannel(...))`: through the coordination service's
key-value store, a host path that never meets the main thread's collectives on a device.

Files are written once, by process 0, with `process_zero_first` or a `barrier` where the
others read what it wrote; the workdir must be a filesystem every host sees.

Preemption: `watch_sigterm` turns SIGTERM into a request to stop, and `preempted(step)`, called
by every process after every step, tells them all at the same step to save and stop, whichever
process got the notice (JAX's preemption sync point on a pod, where the coordination service
spreads the scheduler's notice).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import os
import pickle
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentgym_jax import sharding as sharding_lib
from agentgym_jax.rollout.envs import EnvSettings
from agentgym_jax.rollout.trajectory import Episode, Trajectory, build_trajectory

T = TypeVar("T")

# Set by the SIGTERM handler of `watch_sigterm`; read at step boundaries by `preempted`.
_SIGTERM = threading.Event()


def _identity(tree):
  return tree


def _owners(mesh: Mesh) -> np.ndarray:
  """[*mesh shape] int: the process of each device of `mesh`."""
  return np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)


def _batch_major(mesh: Mesh, x: np.ndarray) -> np.ndarray:
  """`x` [*mesh shape] as [batch positions, other positions]: rows in the order of the batch
  sharding P(BATCH_AXES) (data-major), the other axes in mesh order."""
  batch = [mesh.axis_names.index(a) for a in sharding_lib.BATCH_AXES if a in mesh.axis_names]
  rest = [i for i in range(x.ndim) if i not in batch]
  return x.transpose(batch + rest).reshape(sharding_lib.data_parallel_size(mesh), -1)


def _check_rows_unique(mesh: Mesh, owner: np.ndarray) -> None:
  """Raises unless every batch position's devices (along the non-batch axes) are one process's.

  Raises:
    ValueError: a non-batch axis such as `tensor` spans processes, so several processes would
      hold, and roll out, the same rows.
  """
  per_row = _batch_major(mesh, owner)
  if (per_row == per_row[:, :1]).all():
    return
  others = [a for a in mesh.axis_names if a not in sharding_lib.BATCH_AXES]
  duplicated = [a for a in others
                if (np.diff(owner, axis=mesh.axis_names.index(a)) != 0).any()] or others
  per_process = np.bincount(owner.reshape(-1)).max()
  raise ValueError(f"Mesh axes {duplicated} of {dict(mesh.shape)} span processes, so several "
                   f"processes would roll out the same rows; keep them within one host "
                   f"({per_process} devices) and give the processes to "
                   f"{sharding_lib.BATCH_AXES}.")


def _local_grids(mesh: Mesh) -> dict[int, np.ndarray]:
  """Every process's devices of `mesh` as a grid [*local shape], the same shape for all.

  A process whose devices are a sub-grid (one set of coordinates per axis, in any order and
  not necessarily contiguous: what TPU slices' physical device orders give) keeps it, in mesh
  order; so an axis within one host keeps its sharding. Otherwise (or when the processes'
  sub-grids differ in shape) each process's batch positions, in batch-sharding order, go on
  the first batch axis, its other batch axes get size 1 (so parameters are gathered whole over
  them), and the non-batch axes keep their full size. Either way local row block k of a
  process is the k-th of its global row blocks, so its devices hold the same rows in the local
  rollout as in the whole batch.

  Raises:
    ValueError: a non-batch axis spans processes (`_check_rows_unique`), or the processes hold
      different numbers of devices.
  """
  owner = _owners(mesh)
  _check_rows_unique(mesh, owner)
  processes = np.unique(owner).tolist()
  counts = {int(c) for c in np.bincount(owner.reshape(-1))[processes]}
  if len(counts) > 1:
    raise ValueError(f"The processes hold {sorted(counts)} devices each of mesh "
                     f"{dict(mesh.shape)}; give every host the same number of devices.")
  per_process = counts.pop()
  grids = {}
  for p in processes:
    coords = [np.unique(c) for c in np.nonzero(owner == p)]
    if math.prod(c.size for c in coords) == per_process:
      grids[p] = mesh.devices[np.ix_(*coords)]
  if len(grids) == len(processes) and len({g.shape for g in grids.values()}) == 1:
    return grids
  names = mesh.axis_names
  batch = [a for a in sharding_lib.BATCH_AXES if a in names]
  rest = [a for a in names if a not in batch]
  devices, per_row = _batch_major(mesh, mesh.devices), _batch_major(mesh, owner)[:, 0]
  grids = {}
  for p in processes:
    mine = devices[per_row == p]  # [batch positions, others], in batch-sharding order
    shape = [mine.shape[0]] + [1] * (len(batch) - 1) + [mesh.shape[a] for a in rest]
    order = [(batch + rest).index(a) for a in names]
    grids[p] = mine.reshape(shape).transpose(order)
  return grids


# The leading axis of `ProcessShare.gather`: one entry per process.
PROCESSES_AXIS = "@processes"


@dataclasses.dataclass(frozen=True)
class ProcessShare:
  """One process's part of a mesh: its rows of a batch, its devices, its copy of the params.

  Attributes:
    mesh: the process's devices of the whole mesh as a mesh with the same axis names
      (`_local_grids`; on one process the whole mesh, or None without one); rollouts run here.
    whole: the whole mesh.
    process: the process this share is for.
    multi_process: whether `whole` spans several processes.
    gather: None when the process's shards of every parameter already are its local copy
      (the process meshes differ from the whole mesh in `data` only, which no parameter is
      sharded over). Otherwise the whole mesh's devices in their own flat order, shaped
      [processes, *local shape] with axes (PROCESSES_AXIS, *axis names).
    gather_ids: [processes * local size]: for each position of every process's mesh, stacked
      in process order, the index of its device in the whole mesh's flat order.
  """

  mesh: Mesh | None
  whole: Mesh | None
  process: int = 0
  multi_process: bool = False
  gather: Mesh | None = None
  gather_ids: tuple[int, ...] | None = None

  def rows(self, num_rows: int) -> np.ndarray | None:
    """The rows [R] of a [num_rows] batch (split over the batch axes) on this process's devices,
    read off the batch sharding itself; None on a single process (all rows)."""
    if not self.multi_process:
      return None
    sharding = NamedSharding(self.whole, P(sharding_lib.BATCH_AXES))
    indices = [index for device, index in sharding.devices_indices_map((num_rows,)).items()
               if device.process_index == self.process]
    return np.unique(np.concatenate([np.arange(num_rows)[index] for index in indices]))

  def gather_sharding(self, spec: P) -> NamedSharding:
    """The sharding on the whole mesh's devices under which each device holds what it holds
    under `spec` on its process's mesh: `spec` within every process, replicated across them.

    Expressed on the whole mesh's flat device order (jit requires one device order for all
    shardings of a call), with the devices permuted into the stacked process meshes by
    NamedSharding's `_logical_device_ids` (what jax.device_put itself uses to reshard between
    device orders, jax/_src/dispatch.py `_different_device_order_reshard`).
    """
    return NamedSharding(self.gather, spec, _logical_device_ids=self.gather_ids)

  def local(self, params: Any) -> Any:
    """`params` (arrays on the whole mesh, as the train state holds them) on `self.mesh`.

    A collective where a parameter axis spans processes (every process must call it): one
    jitted identity gathers those arrays over the processes into `gather_sharding`, which keeps
    the sharding within a process. Otherwise a view, no copy.
    """
    if not self.multi_process:
      return params
    leaves, treedef = jax.tree.flatten(params)
    # Arrays already on this process's devices only (none in a train state) stay as they are.
    spread = [i for i, x in enumerate(leaves)
              if isinstance(x, jax.Array) and not x.is_fully_addressable]
    arrays = [leaves[i] for i in spread]
    if self.gather is not None:
      shardings = [self.gather_sharding(x.sharding.spec) for x in arrays]
      arrays = jax.jit(_identity, out_shardings=shardings)(arrays)
    for i, x in zip(spread, arrays):
      leaves[i] = jax.make_array_from_single_device_arrays(
          x.shape, NamedSharding(self.mesh, x.sharding.spec),
          [shard.data for shard in x.addressable_shards])
    return jax.tree.unflatten(treedef, leaves)


def process_share(mesh: Mesh | None, process: int | None = None) -> ProcessShare:
  """Process `process`'s (default: this process's) part of `mesh`, for any device order.

  Reads only the mesh (its devices' process indices), so every process's share can be worked
  out anywhere, e.g. for a TPU slice's devices from libtpu's topology description.

  Raises:
    ValueError: the mesh's `tensor` axis spans processes, the processes hold different numbers
      of devices, or `process` holds none of the mesh.
  """
  processes = set() if mesh is None else {d.process_index for d in mesh.devices.flat}
  if len(processes) < 2:
    return ProcessShare(mesh=mesh, whole=mesh)
  process = jax.process_index() if process is None else process
  grids = _local_grids(mesh)
  if process not in grids:
    raise ValueError(f"Process {process} holds none of the devices of mesh {dict(mesh.shape)}; "
                     "build the mesh on all devices (jax.devices()).")
  local = Mesh(grids[process], mesh.axis_names, axis_types=mesh.axis_types)
  share = ProcessShare(mesh=local, whole=mesh, process=process, multi_process=True)
  if all(local.shape[a] == mesh.shape[a] for a in mesh.axis_names if a != "data"):
    return share
  stacked = np.stack([grids[p] for p in sorted(grids)])  # [processes, *local shape]
  position = {d.id: i for i, d in enumerate(mesh.devices.flat)}
  gather = Mesh(mesh.devices.reshape(stacked.shape), (PROCESSES_AXIS, *mesh.axis_names),
                axis_types=(mesh.axis_types[0], *mesh.axis_types))
  return dataclasses.replace(share, gather=gather,
                             gather_ids=tuple(position[d.id] for d in stacked.flat))


def split_rows(num_rows: int) -> np.ndarray | None:
  """An even, contiguous share [R] of `num_rows` rows for this process (None on one process).

  For work whose rows are not tied to a sharding, such as evaluation; a process may get none.
  """
  if jax.process_count() == 1:
    return None
  return np.array_split(np.arange(num_rows), jax.process_count())[jax.process_index()]


class GatherCancelled(RuntimeError):
  """A gather through a `KeyValueChannel` stopped waiting: its thread is being closed."""


# Channels made so far in this process, by label: every process makes the same ones in the same
# order, so a channel's number names the same channel on all of them.
_CHANNELS: dict[str, int] = {}
_THREAD = threading.local()
# How long a channel's wait blocks before it looks at its stop event (milliseconds).
_CHANNEL_POLL_MS = 500


class KeyValueChannel:
  """`allgather_objects` for one thread other than the main one, through the coordination
  service's key-value store (the multi-controller runtime's, on process 0's host).

  Made on the main thread (every process makes the same channels in the same order, which names
  them alike) and used by one thread (`gathers_through`). Its n-th gather puts this process's
  pickled object at key `<channel>/<n>/<process>` and reads every process's; the last process
  to read them deletes them. Every byte goes through the coordinator, one host's gRPC server:
  fit for a step's episodes, not for parameters.

  `stop`: set, a waiting gather raises `GatherCancelled` (a peer that stopped sampling never
  puts its part).
  """

  def __init__(self, label: str, stop: threading.Event):
    number = _CHANNELS[label] = _CHANNELS.get(label, -1) + 1
    self.prefix, self.stop, self.calls = f"agentgym/{label}.{number}", stop, 0

  def allgather(self, obj: T) -> list[T]:
    """Every process's `obj`, in process order; every process's thread must call it."""
    # pylint: disable-next=import-outside-toplevel,protected-access
    from jax._src import distributed  # the runtime's client: JAX exposes no public handle
    client, count = distributed.global_state.client, jax.process_count()
    key = f"{self.prefix}/{self.calls}"
    self.calls += 1
    client.key_value_set_bytes(f"{key}/{jax.process_index()}", pickle.dumps(obj))
    parts = [pickle.loads(self._wait(client, f"{key}/{p}")) for p in range(count)]
    if client.key_value_increment(f"{key}/read", 1) == count:
      for name in [f"{key}/{p}" for p in range(count)] + [f"{key}/read"]:
        client.key_value_delete(name)
    return parts

  def _wait(self, client: Any, key: str) -> bytes:
    while True:
      try:
        return client.blocking_key_value_get_bytes(key, _CHANNEL_POLL_MS)
      except Exception:  # pylint: disable=broad-except  # XlaRuntimeError: deadline exceeded
        if self.stop.is_set():
          raise GatherCancelled(f"Stopped waiting for {key}: the thread is closing.") from None


@contextlib.contextmanager
def gathers_through(channel: KeyValueChannel):
  """Within it, this thread's `allgather_objects` (and so `gather_trajectory`) go through
  `channel` instead of a device collective."""
  _THREAD.channel = channel
  try:
    yield
  finally:
    _THREAD.channel = None


def allgather_objects(obj: T) -> list[T]:
  """Every process's `obj`, in process order (a collective: every process must call it).

  Objects travel pickled: the peers are this job's own processes. On the main thread a device
  collective; within `gathers_through` its channel's key-value store.
  """
  if jax.process_count() == 1:
    return [obj]
  channel = getattr(_THREAD, "channel", None)
  if channel is not None:
    return channel.allgather(obj)
  data = np.frombuffer(pickle.dumps(obj), np.uint8)
  sizes = multihost_utils.process_allgather(np.int32(data.size))
  # Padded to a power of two: one compiled gather per size class, not one per step.
  padded = np.zeros(1 << max(10, int(sizes.max() - 1).bit_length()), np.uint8)
  padded[:data.size] = data
  gathered = multihost_utils.process_allgather(padded)
  return [pickle.loads(gathered[p, :sizes[p]].tobytes()) for p in range(len(sizes))]


def gather_trajectory(traj: Trajectory, episodes: Sequence[Episode], rows: np.ndarray | None,
                      pad_id: int) -> tuple[Trajectory, list[Episode]]:
  """The whole batch on every process, from each process's rows (a collective).

  Args:
    traj: this process's rollout, rows `rows` of the batch.
    episodes: its host records (`run_episodes`' stats["episodes"]), one per row.
    rows: [R] the batch rows this process ran; None on a single process.
    pad_id: the tokenizer's pad id.
  Returns:
    (the batch as host arrays [B, L], L the bucket of the longest episode of all processes;
    its B episode records in row order).
  """
  if rows is None:
    return jax.device_get(traj), list(episodes)
  pairs = sorted(itertools.chain.from_iterable(
      allgather_objects(list(zip(rows.tolist(), episodes)))), key=lambda pair: pair[0])
  if [row for row, _ in pairs] != list(range(len(pairs))):
    raise RuntimeError(f"The processes rolled out rows {[row for row, _ in pairs]}, not each "
                       "row of the batch once: they disagree on the mesh.")
  ordered = [episode for _, episode in pairs]
  return build_trajectory(ordered, pad_id), ordered


def fetch(tree: Any) -> Any:
  """Host copies of the arrays of `tree`, whole on every process.

  Arrays sharded over several processes are gathered (a collective: every process must call
  it with the same tree); others are copied from this process's devices.
  """
  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))
  return jax.tree.map(one, tree)


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name` (no-op on one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def process_zero_first(fn: Callable[[], T], name: str) -> T:
  """`fn()` on process 0, then on the others once it returned (e.g. to read what it wrote)."""
  if jax.process_index() == 0:
    out = fn()
  barrier(name)
  if jax.process_index() != 0:
    out = fn()
  return out


@jax.jit
def _fingerprints(params: Any) -> jax.Array:
  """[leaves] uint32: a position-weighted sum of each array's bits (wrapping, so exact)."""
  def one(x):
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    weights = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) * np.uint32(2654435761)
    return jnp.sum(bits * (weights + np.uint32(1)), dtype=jnp.uint32)
  return jnp.stack([one(x) for x in jax.tree.leaves(params)])


def check_replicas_agree(share: ProcessShare, params: Any, what: str) -> None:
  """Checks that every process holds bit-identical parameters (a collective; no-op on one).

  The update is one SPMD program, so its outputs agree unless the processes diverged (fed the
  update different batches, or ran different code); a checkpoint of diverged processes would
  silently keep only some of them.

  Raises:
    RuntimeError: naming the processes and how many arrays differ from process 0's.
  """
  if not share.multi_process:
    return
  mine = np.asarray(_fingerprints(share.local(params)))
  every = multihost_utils.process_allgather(mine)
  differ = {p: int((every[p] != every[0]).sum()) for p in range(len(every))}
  differ = {p: n for p, n in differ.items() if n}
  if differ:
    raise RuntimeError(f"{what}: the parameters of processes {sorted(differ)} differ from "
                       f"process 0's in {max(differ.values())} of {every.shape[1]} arrays: the "
                       "processes diverged. Rerun to resume from the last checkpoint; if it "
                       "recurs, report it with every process's log.")
  logging.info("%s: parameters agree on all %d processes (fingerprint %08x).", what, len(every),
               int(np.bitwise_xor.reduce(mine)))


def process_env(env: EnvSettings) -> EnvSettings:
  """`env` as this process uses it: with `env.urls`, its own env service as kwargs["url"].

  Process i talks to env.urls[i % len(env.urls)], so each host can have its own replica of
  the env service (`launch/env_server.sh`).

  Raises:
    ValueError: env.urls is set for an environment other than "remote".
  """
  if not env.urls:
    return env
  if env.name != "remote":
    raise ValueError(f"env.urls is set but env.name is {env.name!r}; env service URLs "
                     "are for env.name='remote' (with env.kwargs.env_name).")
  url = env.urls[jax.process_index() % len(env.urls)]
  return dataclasses.replace(env, kwargs={**env.kwargs, "url": url})


# "1": start JAX's multi-controller runtime and let JAX detect the cluster (a Cloud TPU slice).
DISTRIBUTED_ENV = "AGENTGYM_DISTRIBUTED"
# Seconds a process may miss heartbeats before the job stops (JAX's own default is 100).
HEARTBEAT_TIMEOUT_ENV = "AGENTGYM_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_TIMEOUT_S = 100

_CLUSTER_ENV_VARS = (
    "JAX_COORDINATOR_ADDRESS",  # explicit: also set JAX_NUM_PROCESSES / JAX_PROCESS_ID
    "MEGASCALE_COORDINATOR_ADDRESS",  # multi-slice TPU
)


def _multi_host_env() -> bool:
  if os.environ.get(DISTRIBUTED_ENV) == "1":
    return True
  if any(os.environ.get(v) for v in _CLUSTER_ENV_VARS):
    return True
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  if len([h for h in hosts.split(",") if h]) > 1:
    return True
  for count_var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if int(os.environ.get(count_var, "1") or 1) > 1:
      return True
  return False


def heartbeat_timeout_s() -> int:
  """Seconds without a heartbeat after which a process counts as lost (HEARTBEAT_TIMEOUT_ENV)."""
  text = os.environ.get(HEARTBEAT_TIMEOUT_ENV, str(DEFAULT_HEARTBEAT_TIMEOUT_S))
  if not text.isdigit() or int(text) < 1:
    raise ValueError(f"{HEARTBEAT_TIMEOUT_ENV}={text!r} is not a whole number of seconds >= 1; "
                     f"unset it for the default {DEFAULT_HEARTBEAT_TIMEOUT_S}.")
  return int(text)


def maybe_initialize_distributed() -> bool:
  """Starts JAX's multi-controller runtime when the environment describes several hosts.

  Detects TPU pod slices (TPU_WORKER_HOSTNAMES), SLURM / Open MPI jobs with more than one task,
  and an explicit JAX_COORDINATOR_ADDRESS (with JAX_NUM_PROCESSES and JAX_PROCESS_ID).
  AGENTGYM_DISTRIBUTED=1 starts it in any case and lets JAX find the cluster itself: on a Cloud
  TPU VM slice, from the VM's metadata (worker 0 coordinates, each worker's number is its
  process id); launch/tpu.sh sets it. Must run before anything touches a device. Returns True
  when it initialised the runtime.

  A lost process stops the others: JAX's coordination service notices its missing heartbeats
  after `heartbeat_timeout_s()` seconds and terminates every other process with an error that
  names it ("The following tasks are unhealthy (stopped sending heartbeats): <process id>").
  A process that ends on an exception first waits as long for the others at shutdown, so the
  job stops within twice the timeout of the failure. Rerunning every process with the same
  workdir resumes from the last checkpoint.
  """
  if not _multi_host_env():
    return False
  timeout = heartbeat_timeout_s()
  # JAX's default shutdown wait (300 s) would hold a failed process, and with it the others,
  # far past the heartbeat timeout; the trainer ends all processes together, so a normal
  # shutdown never waits long.
  kwargs: dict[str, Any] = dict(heartbeat_timeout_seconds=timeout,
                                shutdown_timeout_seconds=timeout)
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    missing = [v for v in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if v not in os.environ]
    if missing:
      raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {missing} are not; set all three "
                       "on every host.")
    kwargs.update(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                  num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                  process_id=int(os.environ["JAX_PROCESS_ID"]))
  jax.distributed.initialize(**kwargs)
  logging.info("jax.distributed initialised: process %d of %d, %d global devices; a lost "
               "process stops the others within %d s (%s).", jax.process_index(),
               jax.process_count(), jax.device_count(), timeout, HEARTBEAT_TIMEOUT_ENV)
  return True


def watch_sigterm() -> None:
  """Makes SIGTERM (a scheduler's preemption notice) a request to stop at the next step
  boundary (`preempted`) instead of killing the process mid-step.

  Install it before `jax.distributed.initialize`: JAX's preemption service then takes SIGTERM
  over on a pod and announces it through its sync point instead.
  """
  signal.signal(signal.SIGTERM, lambda signum, frame: _SIGTERM.set())


def preempted(step: int) -> bool:
  """Whether every process should save a checkpoint after `step` and stop (on several
  processes a collective: call it on all of them after every step).

  True once this process got SIGTERM (`watch_sigterm`) or, on several processes, once any of
  them did or JAX's preemption sync point (`multihost_utils.reached_preemption_sync_point`) is
  reached, on every process at the same step.
  """
  if jax.process_count() == 1:
    return _SIGTERM.is_set()
  try:
    synced = multihost_utils.reached_preemption_sync_point(step)
  except RuntimeError:  # the preemption service is off (jax_enable_preemption_service)
    synced = False
  noticed = multihost_utils.process_allgather(np.asarray(_SIGTERM.is_set()))
  return bool(synced or np.any(noticed))
