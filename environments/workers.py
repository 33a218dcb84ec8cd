"""A pool of environment worker processes: batched, asynchronous, fault tolerant.

`EnvPool` hosts many environment instances ("slots") in a few worker processes. A batched
call sends one message to every worker that has work, then gathers the replies, so the
workers step their environments in parallel while the parent waits once. Slot `s` lives in
worker `s % num_workers` (round-robin), which spreads the members of a GRPO group, and the
episodes that finish early, evenly over the workers.

Simulators hold the GIL, can crash the interpreter and can hang, hence processes rather than
threads. A worker that dies, or does not answer within `timeout_s`, is killed with its whole
process group (ScienceWorld's JVMs included) and replaced; the episodes it was serving come
back as failed outcomes (`terminated=True`, reward 0, `info["error"]` says why,
`info["failure"]` names the kind of fault (one of `FAILURES`), `info["success"]=False`), and
every other worker's results of the same call are kept. Each replacement is logged once, as a
warning with its reason.

Workers are fresh interpreters (fork+exec), never plain forks: the parent may hold JAX's
threads, which a forked child would inherit half-locked. This module never imports JAX.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from multiprocessing import connection as mp_connection
from typing import Any, Sequence

import environments
from environments.base import TextEnv

EnvSpec = str | type[TextEnv]

# Seconds a closing worker gets to release its environments before it is killed.
_CLOSE_GRACE_S = 5.0
# Seconds a new worker gets to start Python and import its environment's module.
_BOOT_TIMEOUT_S = 120.0
# The kinds of fault a failed outcome's info["failure"] names: the reset failed (whatever the
# cause), the worker died (or could not be reached), it did not answer a step in time, or the
# environment (a local simulator or a remote env server) raised in a step.
FAILURES = ("reset_failed", "worker_crash", "step_timeout", "env_error")


@dataclasses.dataclass
class StepOutcome:
  """What one slot's reset or step produced."""

  observation: str
  reward: float
  terminated: bool
  truncated: bool
  info: dict[str, Any]

  @property
  def failed(self) -> bool:
    """True when the episode ended on an error rather than by the environment's rules."""
    return "error" in self.info


def failed_outcome(reason: str, failure: str, task_id: int | None = None,
                   action: str | None = None) -> StepOutcome:
  """The outcome of an episode that ended on an error: terminated, reward 0, the reason and
  the kind of fault (one of `FAILURES`) in info."""
  info: dict[str, Any] = {"error": reason, "failure": failure, "success": False, "score": 0.0}
  if task_id is not None:
    info["task_id"] = task_id
  if action is not None:
    info["action"] = action
  return StepOutcome("", 0.0, True, False, info)


# ----- worker process ------------------------------------------------------------------------


def _env_class(env_spec: EnvSpec, env_kwargs: dict[str, Any]) -> type[TextEnv]:
  """The class an EnvSpec names (for "remote", the served environment's, from its kwargs)."""
  if not isinstance(env_spec, str):
    return env_spec
  remote_name = env_kwargs.get("env_name") if env_spec == "remote" else None
  return environments.env_class(env_spec, env_name=remote_name)


def _build_env(env_spec: EnvSpec, env_kwargs: dict[str, Any]) -> TextEnv:
  if isinstance(env_spec, str):
    return environments.make(env_spec, **env_kwargs)
  return env_spec(**env_kwargs)


def _close_quietly(env: TextEnv) -> None:
  # A broken simulator may fail to close too; the worker must carry on regardless.
  with contextlib.suppress(Exception):
    env.close()


def _error_text(exc: BaseException) -> str:
  frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
  where = f" at {os.path.basename(frame.filename)}:{frame.lineno}" if frame else ""
  return f"{type(exc).__name__}: {exc}{where}"


class _Slots:
  """The environments of one worker process, keyed by pool slot."""

  def __init__(self, env_spec: EnvSpec, env_kwargs: dict[str, Any]):
    self.env_spec = env_spec
    self.env_kwargs = env_kwargs
    self.envs: dict[int, TextEnv] = {}

  def discard(self, slot: int) -> None:
    env = self.envs.pop(slot, None)
    if env is not None:
      _close_quietly(env)

  def reset(self, slot: int, task_id: int) -> StepOutcome:
    try:
      env = self.envs.get(slot)
      if env is None:
        # Instances are reused across resets: creating one can be costly (a JVM for SciWorld).
        env = self.envs[slot] = _build_env(self.env_spec, self.env_kwargs)
      observation, info = env.reset(options={"task_id": task_id})
    except Exception as exc:  # pylint: disable=broad-except
      self.discard(slot)
      return failed_outcome(f"reset of task {task_id} failed: {_error_text(exc)}",
                            "reset_failed", task_id)
    return StepOutcome(observation, 0.0, False, False, info)

  def step(self, slot: int, response: str) -> StepOutcome:
    env = self.envs.get(slot)
    if env is None or env.task_id is None:
      return failed_outcome(
          f"slot {slot} has no running episode; reset it first (its last episode failed, or "
          "its worker was replaced after a crash or timeout).", "env_error")
    action = None
    try:
      action = env.parse_action(response)
      observation, reward, terminated, truncated, info = env.step(action)
    except Exception as exc:  # pylint: disable=broad-except
      task_id = env.task_id
      # The instance may be left in any state: a fresh one is built at the next reset.
      self.discard(slot)
      return failed_outcome(f"step raised {_error_text(exc)}", "env_error", task_id, action)
    info["action"] = action
    return StepOutcome(observation, float(reward), bool(terminated), bool(truncated), info)

  def close(self) -> None:
    for slot in list(self.envs):
      self.discard(slot)


def _picklable(info: dict[str, Any]) -> dict[str, Any]:
  out = {}
  for key, value in info.items():
    try:
      pickle.dumps(value)
    except (pickle.PicklingError, TypeError, AttributeError):
      value = repr(value)
    out[key] = value
  return out


def _worker_main(conn: mp_connection.Connection, env_spec: EnvSpec, env_kwargs: dict[str, Any],
                 threads: int) -> None:
  """Serves (call id, "reset" | "step", [(slot, arg), ...]) calls until "close" or the parent
  leaves, answering each with (call id, outcomes).

  With `threads` > 1 the slots run concurrently, those of one call and those of calls sent
  while earlier ones are still running (each slot in one thread at a time), which overlaps
  environments that wait outside Python; a call is answered as soon as its own slots are done.
  """
  # Ctrl-C goes to the parent, which shuts the pool down in order.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  # The environment's module is imported before "ready", so that its import time counts
  # against booting rather than against the first reset's timeout.
  _env_class(env_spec, env_kwargs)
  conn.send("ready")
  slots = _Slots(env_spec, env_kwargs)
  executor = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None
  send_lock = threading.Lock()

  def answer(call_id: int, results: list[StepOutcome]) -> None:
    # Plain tuples pickle faster than the dataclass (benchmarks/README.md, Environment
    # workers): it matters for cheap envs.
    reply = [(r.observation, r.reward, r.terminated, r.truncated, r.info) for r in results]
    with send_lock, contextlib.suppress(OSError):  # the parent has gone: nothing to answer
      try:
        conn.send((call_id, reply))
      except (pickle.PicklingError, TypeError, AttributeError):
        # An env put an object that cannot cross processes into its info; send its repr.
        conn.send((call_id, [fields[:4] + (_picklable(fields[4]),) for fields in reply]))

  try:
    while True:
      try:
        call_id, command, batch = conn.recv()
      except (EOFError, OSError):
        break
      if command == "close":
        break
      if command not in ("reset", "step"):
        raise ValueError(f"Unknown pool command {command!r}.")
      run = slots.reset if command == "reset" else slots.step
      if executor is None:
        answer(call_id, [run(slot, arg) for slot, arg in batch])
      else:
        # Answered from a thread of its own: the next call is read while this one runs.
        threading.Thread(target=lambda c=call_id, r=run, b=batch: answer(
            c, list(executor.map(r, *zip(*b)))), daemon=True).start()
  finally:
    if executor is not None:
      executor.shutdown(wait=False, cancel_futures=True)
    slots.close()
    conn.close()


# ----- parent side ---------------------------------------------------------------------------

# The worker's bootstrap: it takes the parent's sys.path first, so that `environments` and any
# env class passed by reference import exactly as they do in the parent.
_BOOTSTRAP = ("import sys; from multiprocessing.connection import Connection; "
              "conn = Connection({fd}); sys.path[:] = conn.recv(); "
              "from environments.workers import _worker_main; _worker_main(conn, *conn.recv())")


def _describe_exit(returncode: int | None) -> str:
  if returncode is None:
    return "was still running"
  if returncode < 0:
    try:
      return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
      return f"killed by signal {-returncode}"
  return f"exit code {returncode}"


class _Worker:
  """One worker process and the parent's end of its socket.

  Started as a fresh interpreter (fork+exec, safe in a threaded parent) rather than through
  multiprocessing: 'spawn' and 'forkserver' re-import the parent's __main__ in the child, which
  for `python -m agentgym_jax.train` would import JAX into every environment worker.
  """

  def __init__(self, index: int, env_spec: EnvSpec, env_kwargs: dict[str, Any], threads: int):
    self.index = index
    parent_sock, child_sock = socket.socketpair()
    try:
      # A new process group: the pool kills the worker together with any simulator it starts.
      self.process = subprocess.Popen(
          [sys.executable, "-c", _BOOTSTRAP.format(fd=child_sock.fileno())],
          pass_fds=(child_sock.fileno(),), process_group=0, stdin=subprocess.DEVNULL)
    finally:
      # The child holds the only other end, so its death shows up here as EOF.
      child_sock.close()
    self.conn = mp_connection.Connection(parent_sock.detach())
    self.conn.send(list(sys.path))
    self.conn.send((env_spec, env_kwargs, threads))

  @property
  def pid(self) -> int:
    return self.process.pid

  def wait_ready(self) -> None:
    """Blocks until the worker has booted; raises if it died or hung on the way."""
    try:
      if self.conn.poll(_BOOT_TIMEOUT_S) and self.conn.recv() == "ready":
        return
      problem = f"did not start within {_BOOT_TIMEOUT_S:g} s"
    except (EOFError, OSError):
      problem = "exited at startup (its traceback is above)"
    self.kill()
    raise RuntimeError(f"Env worker {self.index} {problem}; check that the environment "
                       "imports and builds in a fresh Python process.")

  def kill(self) -> str:
    """Kills the worker and its process group; returns how the worker had ended."""
    returncode = self.process.poll()
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
      os.killpg(self.process.pid, signal.SIGKILL)
    self.process.wait()
    self.conn.close()
    return _describe_exit(returncode if returncode is not None else self.process.returncode)

  def close(self) -> None:
    # A worker that is already dead or does not exit in time is killed below either way.
    with contextlib.suppress(OSError, ValueError, subprocess.TimeoutExpired):
      self.conn.send((-1, "close", None))
      self.process.wait(_CLOSE_GRACE_S)
    self.kill()


@dataclasses.dataclass
class _Call:
  """A batch of requests sent to one worker, awaiting its answer."""

  command: str
  requests: list[tuple[int, Any]]
  deadline: float  # time.monotonic() by which the answer must have come
  limit: float  # the seconds the call was given


def _shutdown(workers: list[_Worker]) -> None:
  for worker in workers:
    worker.close()
  workers.clear()


class EnvPool:
  """Many environment instances in `num_workers` processes, reset and stepped in batches.

  Args:
    env_name: a name in `environments.REGISTRY` (e.g. "babyai", "remote"), or a `TextEnv`
      subclass that the workers can import.
    num_workers: worker processes.
    env_kwargs: keyword arguments for every environment instance.
    timeout_s: limit on each `reset`/`step` call: a worker that has not answered by then is
      killed and its episodes come back failed. Choose it above the slowest batch one worker
      serves.
    create_timeout_s: added to a reset's limit for each environment instance the busiest
      worker must build first (instances are built on a slot's first reset and reused; a
      SciWorld instance starts a JVM, 1-5 s), so that a pool's first reset is not cut short.
    threads_per_worker: slots a worker steps at once. Environments that wait outside Python
      (SciWorld's JVMs, `RemoteEnv`'s HTTP calls) overlap those waits with 4-8; pure-Python
      environments (BabyAI, TextCraft) gain nothing, the GIL serialises them.
  """

  def __init__(self, env_name: EnvSpec, num_workers: int = 2,
               env_kwargs: dict[str, Any] | None = None, timeout_s: float = 60.0,
               create_timeout_s: float = 60.0, threads_per_worker: int = 1):
    if num_workers < 1 or threads_per_worker < 1:
      raise ValueError(f"num_workers and threads_per_worker must be >= 1, got {num_workers} "
                       f"and {threads_per_worker}.")
    if timeout_s <= 0 or create_timeout_s < 0:
      raise ValueError(f"Need timeout_s > 0 and create_timeout_s >= 0, got {timeout_s} and "
                       f"{create_timeout_s}.")
    self.env_kwargs = dict(env_kwargs or {})
    # The class gives the caller the env's instruction and parser without a round trip.
    self.env_cls = _env_class(env_name, self.env_kwargs)
    self.env_spec = env_name
    self.num_workers = num_workers
    self.threads_per_worker = threads_per_worker
    self.timeout_s = float(timeout_s)
    self.create_timeout_s = float(create_timeout_s)
    self._task_ids: dict[int, int] = {}
    self._built: set[int] = set()  # slots whose worker holds a built environment
    self._workers: list[_Worker] = []
    # Per worker, the calls it has not answered yet, by call id (oldest first).
    self._calls: dict[int, dict[int, _Call]] = collections.defaultdict(dict)
    self._call_ids = itertools.count()
    self._done: list[tuple[int, StepOutcome]] = []  # answered, not yet returned
    # Runs at close(), at garbage collection and at interpreter exit, whichever comes first.
    self._finalizer = weakref.finalize(self, _shutdown, self._workers)
    for index in range(num_workers):
      self._workers.append(self._new_worker(index))
    try:
      # Boot in parallel, then wait: call timeouts then measure environment work only.
      for worker in self._workers:
        worker.wait_ready()
    except RuntimeError:
      self.close()
      raise

  def _new_worker(self, index: int) -> _Worker:
    return _Worker(index, self.env_spec, self.env_kwargs, self.threads_per_worker)

  # ----- public API --------------------------------------------------------------------------

  def reset(self, task_ids: Sequence[int],
            slots: Sequence[int] | None = None) -> list[StepOutcome]:
    """Starts task `task_ids[i]` in slot `slots[i]` (default: slot i); outcome per slot.

    `info["instruction"]` and `info["task_id"]` are set. A reset that fails comes back as a
    failed outcome (see the module docstring); the slot can be reset again.
    """
    slots = list(range(len(task_ids))) if slots is None else list(slots)
    if len(slots) != len(task_ids):
      raise ValueError(f"reset got {len(task_ids)} task ids for {len(slots)} slots.")
    requests = [(int(slot), int(task_id)) for slot, task_id in zip(slots, task_ids)]
    for slot, task_id in requests:
      self._task_ids[slot] = task_id
    return self._run("reset", requests)

  def step(self, slots: Sequence[int], responses: Sequence[str]) -> list[StepOutcome]:
    """Steps slot `slots[i]` with the agent's raw `responses[i]`; outcome per slot.

    The worker applies the environment's `parse_action`; `info["action"]` is the parsed
    action. Stepping a slot without a running episode gives a failed outcome.
    """
    return self._run("step", self._step_requests(slots, responses))

  def submit(self, slots: Sequence[int], responses: Sequence[str]) -> None:
    """Starts stepping slot `slots[i]` with `responses[i]` and returns at once.

    `collect` returns the outcomes as the workers answer, so the caller can keep working
    (e.g. decoding other episodes) while the environments step. A slot can have one step in
    flight at a time.
    """
    self._send("step", self._step_requests(slots, responses), self.timeout_s)

  def collect(self, timeout_s: float | None = None) -> list[tuple[int, StepOutcome]]:
    """(slot, outcome) of submitted steps that have been answered, in arrival order.

    Waits up to `timeout_s` seconds for a first answer (0: only what has arrived; None: until
    one arrives, or nothing is in flight). A worker past its call's limit is replaced and
    its slots come back failed, as in `step`.
    """
    answered = self._receive(timeout_s)
    while timeout_s is None and not answered and self.in_flight:
      answered = self._receive(None)
    return answered

  @property
  def in_flight(self) -> int:
    """Slots submitted whose outcome `collect` has not returned yet."""
    return len(self._done) + sum(len(call.requests) for calls in self._calls.values()
                                 for call in calls.values())

  def worker_pid(self, slot: int) -> int:
    """The process id of the worker that hosts `slot` (for monitoring and tests)."""
    return self._workers[slot % self.num_workers].pid

  def close(self) -> None:
    """Stops every worker and its environments; safe to call twice."""
    self._finalizer()

  def __enter__(self) -> EnvPool:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  # ----- calls to the workers ----------------------------------------------------------------
  # A worker answers each call with its id (in any order when it runs calls concurrently);
  # `_calls[w]` holds the calls worker w still owes.

  @staticmethod
  def _step_requests(slots: Sequence[int], responses: Sequence[str]) -> list[tuple[int, str]]:
    if len(slots) != len(responses):
      raise ValueError(f"step got {len(responses)} responses for {len(slots)} slots.")
    return [(int(slot), str(response)) for slot, response in zip(slots, responses)]

  def _run(self, command: str, requests: list[tuple[int, Any]]) -> list[StepOutcome]:
    """A blocking call: sends `requests` and waits for every one of them."""
    if self.in_flight:
      raise RuntimeError(f"EnvPool.{command} was called while {self.in_flight} submitted "
                         "steps are in flight; collect them first.")
    limit = self.timeout_s
    if command == "reset":
      # Instances are built on a slot's first reset; the busiest worker builds the most.
      to_build = collections.Counter(slot % self.num_workers for slot, _ in requests
                                     if slot not in self._built)
      limit += self.create_timeout_s * max(to_build.values(), default=0)
    answers: dict[int, StepOutcome] = {}
    try:
      self._send(command, requests, limit)
      while self.in_flight:
        answers.update(self._receive(None))
    finally:
      # Interrupted mid-call (e.g. Ctrl-C): the workers still owing an answer are replaced,
      # so that the pool is usable again.
      for index in [i for i, calls in self._calls.items() if calls]:
        self._fail_worker(index, f"the pool call {command} was interrupted", "worker_crash")
      self._done.clear()
    return [answers[slot] for slot, _ in requests]

  def _send(self, command: str, requests: list[tuple[int, Any]], limit: float) -> None:
    if not self._finalizer.alive:
      raise RuntimeError("EnvPool is closed; create a new one.")
    busy = {slot for calls in self._calls.values() for call in calls.values()
            for slot, _ in call.requests} | {slot for slot, _ in self._done}
    seen: set[int] = set()
    for slot, _ in requests:
      if slot < 0 or slot in seen or slot in busy:
        raise ValueError(f"Slots must be distinct, >= 0 and not in flight; got slot {slot} in "
                         f"{command}.")
      seen.add(slot)
    batches: dict[int, list[tuple[int, Any]]] = {}
    for slot, arg in requests:
      batches.setdefault(slot % self.num_workers, []).append((slot, arg))
    now = time.monotonic()
    for index, batch in batches.items():
      calls = self._calls[index]
      # At the latest, a call starts when the worker has answered the ones before it.
      deadline = max([now] + [call.deadline for call in calls.values()]) + limit
      call_id = next(self._call_ids)
      calls[call_id] = _Call(command, batch, deadline, limit)
      try:
        self._workers[index].conn.send((call_id, command, batch))
      except (OSError, ValueError):
        self._fail_worker(index, f"could not send {command} to it", "worker_crash")

  def _receive(self, timeout_s: float | None) -> list[tuple[int, StepOutcome]]:
    """Reads the answers that arrive within `timeout_s` (None: the earliest call deadline)."""
    owing = {self._workers[index].conn: index
             for index, calls in self._calls.items() if calls}
    if owing and not self._done:
      wait = min(call.deadline for calls in self._calls.values() for call in calls.values())
      wait -= time.monotonic()
      if timeout_s is not None:
        wait = min(wait, timeout_s)
      for conn in mp_connection.wait(list(owing), max(0.0, wait)):
        index = owing[conn]
        try:
          call_id, results = conn.recv()
        except (EOFError, OSError):
          command = next(iter(self._calls[index].values())).command
          self._fail_worker(index, f"it died during {command}", "worker_crash")
          continue
        call = self._calls[index].pop(call_id)
        for (slot, arg), fields in zip(call.requests, results):
          outcome = StepOutcome(*fields)
          if outcome.failed:
            # The worker drops the environment of a failed episode.
            self._built.discard(slot)
            outcome = self._labelled(outcome, call.command, (slot, arg))
          elif call.command == "reset":
            self._built.add(slot)
          self._done.append((slot, outcome))
      now = time.monotonic()
      for index, calls in self._calls.items():
        late = [call for call in calls.values() if call.deadline <= now]
        if late:
          self._fail_worker(index, f"it did not answer {late[0].command} within "
                                   f"{late[0].limit:g} s (timeout_s={self.timeout_s:g})",
                            "step_timeout")
    done, self._done = self._done, []
    return done

  def _fail_worker(self, index: int, why: str, failure: str) -> None:
    """Replaces worker `index`; every call it owed comes back as failed outcomes."""
    reason = self._replace(index, why)
    calls = self._calls[index]
    while calls:
      call = calls.pop(next(iter(calls)))
      # A reset that did not happen is a failed reset, whatever stopped the worker.
      kind = "reset_failed" if call.command == "reset" else failure
      self._done.extend(
          (slot, self._labelled(failed_outcome(reason, kind), call.command, (slot, arg)))
          for slot, arg in call.requests)

  def _labelled(self, outcome: StepOutcome, command: str, request: tuple[int, Any]) -> StepOutcome:
    """A failed outcome with the slot's task id and, for a step, the parsed action."""
    slot, arg = request
    if slot in self._task_ids:
      outcome.info.setdefault("task_id", self._task_ids[slot])
    if command == "step":
      outcome.info.setdefault("action", self.env_cls.parse_action(arg))
    return outcome

  def _replace(self, index: int, why: str) -> str:
    """Kills worker `index`, starts a fresh one, logs why, and returns the failure reason to
    report."""
    old = self._workers[index]
    how = old.kill()
    self._built = {slot for slot in self._built if slot % self.num_workers != index}
    self._workers[index] = self._new_worker(index)
    try:
      self._workers[index].wait_ready()
      reason = f"env worker {index} (pid {old.pid}) was replaced: {why} ({how})"
    except RuntimeError as exc:
      # The episodes still come back failed; the next call to this worker finds its closed
      # connection and replaces it again.
      reason = f"env worker {index} (pid {old.pid}) died: {why} ({how}); its replacement: {exc}"
    logging.warning("%s.", reason)
    return reason
