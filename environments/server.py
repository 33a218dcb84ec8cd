"""An HTTP server that speaks AgentGym's env-server protocol for one of our environments.

    python -m environments.server --env babyai --port 36005 [--host 127.0.0.1] [--strict]

AgentGym's clients (and AgentGym-RL's rollout) work against it unchanged: `/create`, `/reset`,
`/step`, `/observation` and `/close` take and return each environment's own field names (see
`environments.protocol`). As upstream, the server receives the action string that the
*client* extracted from the agent's response and hands it to the environment as is.

Where upstream answers a failure with HTTP 200 and `{"error": ...}`, this server answers a 4xx
(400 malformed JSON or a missing/mistyped field, 404 unknown id, 409 an instance not in a state
to step) or a 500 (the simulator failed), always with `{"error": "<what was wrong and what to
do>"}`. AgentGym's clients assert status 200 and end the episode on anything else, exactly as
they do on upstream's error bodies, so their happy path is unchanged.

Extensions, not in upstream: `GET /health` (instance count, resident memory), `GET
/expert_action?<id>=N` (the environment's expert move, for tests and demonstrations), an
optional `reward_mode` in the /create body, and a `textenv` field in /step answers carrying
the environment's own reward, truncation flag and info; `environments.client.RemoteEnv` uses
them for exact parity with a local env.
`--strict` drops the `textenv` field and the expert and runs every instance in the "paper"
reward mode unless /create names another, so the server answers, and ends episodes, as
upstream does.

Thread safety: id allocation and the instance table are guarded by one lock; each instance has
its own lock, so calls on different instances run concurrently in the thread pool.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import anyio
import fastapi
import requests
import uvicorn
from fastapi import responses

import environments
from environments import protocol as protocol_lib
from environments.base import REWARD_MODES, TextEnv


class RequestError(Exception):
  """A failed request: HTTP status and a message for the caller."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status
    self.message = message


class _Instance:
  """One environment instance and what its clients have seen of it."""

  def __init__(self, env: TextEnv, reward_mode: str):
    self.env: TextEnv | None = env
    self.reward_mode = reward_mode  # a rebuilt env gets the same
    self.lock = threading.Lock()
    self.observation = ""       # text answered by GET /observation
    self.last_step: dict[str, Any] = {}
    self.previous_raw = 0.0     # last raw score, for the per-step reward of score protocols
    self.running = False        # reset, and not finished
    self.closed = False


def jsonable(value: Any) -> Any:
  """`value` (an info dict) as plain JSON: numpy values converted, non-JSON objects dropped."""
  if isinstance(value, (str, bool)) or value is None:
    return value
  if isinstance(value, (int, float)):
    return value if not isinstance(value, float) or math.isfinite(value) else None
  if isinstance(value, dict):
    out = {}
    for key, item in value.items():
      item = jsonable(item)
      if item is not _SKIP:
        out[str(key)] = item
    return out
  if isinstance(value, (list, tuple)):
    return [item for item in map(jsonable, value) if item is not _SKIP]
  if hasattr(value, "tolist"):  # numpy scalar or array, without importing numpy
    return jsonable(value.tolist())
  return _SKIP


_SKIP = object()


def _resident_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class EnvService:
  """The instance table and the protocol logic, independent of the web framework."""

  def __init__(self, env_factory, proto: protocol_lib.Protocol, strict: bool = False):
    self.env_factory = env_factory
    self.protocol = proto
    self.strict = strict
    self._lock = threading.Lock()
    self._next_id = 0
    self._instances: dict[int, _Instance] = {}

  # ----- helpers -----------------------------------------------------------------------------

  @contextlib.contextmanager
  def _hold(self, instance_id: int) -> Iterator[_Instance]:
    """The instance, locked for the caller; 404 if it does not exist (or was just closed)."""
    with self._lock:
      instance = self._instances.get(instance_id)
    if instance is not None:
      with instance.lock:
        # A concurrent /close may have won the lock first.
        if not instance.closed:
          yield instance
          return
    raise RequestError(404, f"Unknown {self.protocol.id_key} {instance_id}: it was never "
                            "created or is already closed. POST /create for a new one.")

  @staticmethod
  def _discard_env(instance: _Instance) -> None:
    """Drops a failed simulator; it may be in any state, so the next reset builds a new one."""
    env, instance.env, instance.running = instance.env, None, False
    if env is not None:
      with contextlib.suppress(Exception):
        env.close()

  def _reset_locked(self, instance_id: int, instance: _Instance, task_id: int) -> Any:
    if instance.env is None:
      instance.env = self.env_factory(reward_mode=instance.reward_mode)
    instance.running = False
    try:
      observation, info = instance.env.reset(options={"task_id": task_id})
    except (ValueError, IndexError, KeyError) as exc:
      raise RequestError(400, f"Cannot reset to task {task_id}: {exc}") from exc
    except Exception as exc:  # pylint: disable=broad-except
      self._discard_env(instance)
      raise RequestError(500, f"The environment failed to reset ({type(exc).__name__}: {exc}); "
                              "the instance was rebuilt, try again.") from exc
    instance.running = True
    instance.previous_raw = 0.0
    response = self.protocol.reset_response(instance_id, observation, info)
    instance.observation = observation if isinstance(response, str) else response.get(
        "observation", observation)
    instance.last_step = {}
    return response

  # ----- endpoints ---------------------------------------------------------------------------

  def create(self, task_id: int | None = None, reset_to_own_id: bool = False,
             reward_mode: str | None = None) -> Any:
    """A new instance, reset to `task_id` (or to its own id) where upstream's server does so.

    `reward_mode` None takes the service's default: "paper" when strict, because that mode is
    AgentGym's own reward and episode end (a BabyAI success worth 0.5 or less does not end the
    episode upstream), else "normalized".
    """
    reward_mode = reward_mode or ("paper" if self.strict else "normalized")
    env = self.env_factory(reward_mode=reward_mode)
    with self._lock:
      instance_id = self._next_id
      self._next_id += 1
      instance = self._instances[instance_id] = _Instance(env, reward_mode)
    if reset_to_own_id:
      task_id = instance_id
    observation = None
    if task_id is not None:
      try:
        with self._hold(instance_id):
          self._reset_locked(instance_id, instance, task_id)
          observation = instance.observation
      except Exception:
        # The caller never learns this id, so the instance must not outlive the failure.
        self.close(instance_id)
        raise
    return self.protocol.create_response(instance_id, observation)

  def reset(self, instance_id: int, task_id: int) -> Any:
    with self._hold(instance_id) as instance:
      return self._reset_locked(instance_id, instance, task_id)

  def step(self, instance_id: int, action: str) -> dict[str, Any]:
    with self._hold(instance_id) as instance:
      if not instance.running:
        raise RequestError(409, f"Instance {instance_id} has no running episode (never reset, "
                                "finished, or failed). POST /reset to start one.")
      try:
        observation, reward, terminated, truncated, info = instance.env.step(action)
      except Exception as exc:  # pylint: disable=broad-except
        self._discard_env(instance)
        raise RequestError(500, f"The environment failed on this step ({type(exc).__name__}: "
                                f"{exc}); the instance was rebuilt, POST /reset.") from exc
      raw = float(info.get("score", reward))
      response = self.protocol.step_response(observation, raw, instance.previous_raw,
                                             terminated, truncated)
      instance.previous_raw = raw
      instance.running = not (terminated or truncated)
      instance.observation = observation
      instance.last_step = response
      if not self.strict:
        response = dict(response, textenv={
            "reward": float(reward), "terminated": terminated, "truncated": truncated,
            "info": jsonable(info)})
      return response

  def observation(self, instance_id: int) -> Any:
    with self._hold(instance_id) as instance:
      return self.protocol.observation_response(instance.observation, instance.last_step)

  def expert_action(self, instance_id: int) -> dict[str, str]:
    with self._hold(instance_id) as instance:
      if not instance.running:
        raise RequestError(409, f"Instance {instance_id} has no running episode; reset it.")
      return {"action": instance.env.expert_action()}

  def close(self, instance_id: int) -> Any:
    with self._hold(instance_id) as instance:
      with self._lock:
        self._instances.pop(instance_id, None)
      instance.closed = True
      self._discard_env(instance)
    return self.protocol.close_response()

  def health(self) -> dict[str, Any]:
    with self._lock:
      count = len(self._instances)
    return {"status": "ok", "env": self.protocol.name, "instances": count,
            "rss_bytes": _resident_bytes(), "extensions": not self.strict}

  def close_all(self) -> None:
    with self._lock:
      instances, self._instances = list(self._instances.values()), {}
    for instance in instances:
      with instance.lock:
        instance.closed = True
        self._discard_env(instance)


# ----- HTTP layer ----------------------------------------------------------------------------


async def _json_body(request: fastapi.Request, required: bool = True) -> dict[str, Any]:
  raw = await request.body()
  if not raw.strip():
    if required:
      raise RequestError(400, "The request body is empty; send a JSON object.")
    return {}
  try:
    body = json.loads(raw)
  except RecursionError as exc:
    raise RequestError(400, "The request body is nested too deeply to parse; send a flat JSON "
                            "object.") from exc
  except ValueError as exc:
    # Malformed text, bad UTF-8, and integers past Python's 4300-digit conversion limit.
    raise RequestError(400, f"The request body is not valid JSON this server can read ({exc}); "
                            "send a JSON object.") from exc
  if not isinstance(body, dict):
    raise RequestError(400, f"The request body must be a JSON object, got {type(body).__name__}.")
  return body


def _field(body: dict[str, Any], key: str, endpoint: str, kind: type) -> Any:
  """body[key], which must be a `kind` (int or str; JSON's true and false are not integers)."""
  name = {int: "an integer", str: "a string"}[kind]
  if key not in body:
    raise RequestError(400, f"{endpoint} needs the field {key!r} ({name}); got fields "
                            f"{sorted(body)}.")
  value = body[key]
  if isinstance(value, bool) or not isinstance(value, kind):
    raise RequestError(400, f"{endpoint}: field {key!r} must be {name}, got {value!r}.")
  return value


def _query_id(request: fastapi.Request, key: str) -> int:
  value = request.query_params.get(key)
  if value is None:
    raise RequestError(400, f"Pass the instance as a query parameter: ?{key}=N.")
  try:
    return int(value)
  except ValueError as exc:
    raise RequestError(400, f"Query parameter {key}={value!r} is not an integer.") from exc


def build_app(service: EnvService) -> fastapi.FastAPI:
  """The FastAPI app serving `service` with its protocol's field names."""
  proto = service.protocol
  key = proto.id_key

  @contextlib.asynccontextmanager
  async def lifespan(_):
    yield
    service.close_all()

  app = fastapi.FastAPI(title=f"agentgym-jax {proto.name} env server", lifespan=lifespan)

  @app.exception_handler(RequestError)
  async def _request_error(_, exc: RequestError):
    return responses.JSONResponse({"error": exc.message}, status_code=exc.status)

  @app.exception_handler(Exception)
  async def _internal_error(_, exc: Exception):
    return responses.JSONResponse(
        {"error": f"Internal error: {type(exc).__name__}: {exc}"}, status_code=500)

  async def call(fn, *args):
    # Simulators block; the thread pool keeps the event loop serving other instances.
    return await anyio.to_thread.run_sync(fn, *args)

  @app.get("/")
  async def hello():
    return f"This is environment {proto.name} (agentgym-jax)."

  @app.get("/health")
  async def health():
    return service.health()

  @app.post("/create")
  async def create(request: fastapi.Request):
    body = await _json_body(request, required=False)
    if body.get("commands") is not None or body.get("goal") is not None:
      raise RequestError(400, "Custom TextCraft commands/goal are not supported; create "
                              "without them and reset to a task id.")
    reward_mode = None  # the service's default: upstream's rewards and episode ends if strict
    if "reward_mode" in body:
      # Our client's extension: the instance computes rewards as the client's local env would.
      reward_mode = _field(body, "reward_mode", "/create", str)
      if reward_mode not in REWARD_MODES:
        raise RequestError(400, f"/create: reward_mode must be one of {REWARD_MODES}, got "
                                f"{reward_mode!r}.")
    # What upstream's server resets a new instance to, if anything (Protocol.create_resets_to).
    task_id, own_id = None, proto.create_resets_to == "own_id"
    if proto.create_resets_to == "body" and proto.reset_key in body:
      task_id = _field(body, proto.reset_key, "/create", int)
    return await call(service.create, task_id, own_id, reward_mode)

  @app.post("/reset")
  async def reset(request: fastapi.Request):
    body = await _json_body(request)
    instance_id = _field(body, key, "/reset", int)
    task_id = _field(body, proto.reset_key, "/reset", int)
    return await call(service.reset, instance_id, task_id)

  @app.post("/step")
  async def step(request: fastapi.Request):
    body = await _json_body(request)
    instance_id = _field(body, key, "/step", int)
    action = _field(body, "action", "/step", str)
    return await call(service.step, instance_id, action)

  @app.get("/observation")
  async def observation(request: fastapi.Request):
    return await call(service.observation, _query_id(request, key))

  if not service.strict:
    @app.get("/expert_action")
    async def expert_action(request: fastapi.Request):
      return await call(service.expert_action, _query_id(request, key))

  @app.post("/close")
  async def close(request: fastapi.Request):
    body = await _json_body(request)
    return await call(service.close, _field(body, key, "/close", int))

  return app


def env_factory(env: str):
  """A constructor (keyword `reward_mode`) for `env`: a REGISTRY name or "package.module:Class"."""
  if ":" in env:
    module_name, class_name = env.split(":", 1)
    return getattr(importlib.import_module(module_name), class_name)
  return environments.env_class(env)


def _free_port(host: str) -> int:
  with socket.socket() as sock:
    sock.bind((host, 0))
    return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(env: str, protocol: str | None = None, strict: bool = False,
                   host: str = "127.0.0.1", startup_timeout_s: float = 60.0,
                   extra_env: dict[str, str] | None = None) -> Iterator[str]:
  """Runs this server for `env` in a subprocess on a free port of `host`; yields its URL.

  The server is always stopped on exit (SIGTERM, which closes every instance; SIGKILL to its
  process group if it does not stop within 15 s).
  """
  command = [sys.executable, "-m", "environments.server", "--env", env, "--host", host]
  if protocol:
    command += ["--protocol", protocol]
  if strict:
    command.append("--strict")
  child_env = dict(os.environ, **(extra_env or {}))
  for _ in range(3):  # another process may take the free port before the server binds it
    port = _free_port(host)
    process = subprocess.Popen(command + ["--port", str(port)], env=child_env, process_group=0)
    url = f"http://{host}:{port}"
    try:
      deadline = time.monotonic() + startup_timeout_s
      while process.poll() is None and time.monotonic() < deadline:
        try:
          if requests.get(url + "/health", timeout=1.0).status_code == 200:
            break
        except requests.RequestException:
          time.sleep(0.1)
      else:
        if process.poll() is None:
          raise TimeoutError(f"The {env} server did not start within {startup_timeout_s} s.")
        continue
      yield url
      return
    finally:
      process.terminate()
      try:
        process.wait(15)
      except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
  raise RuntimeError(f"The {env} server exited at startup three times: {command}")


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--env", required=True,
                      help="environment: a name in environments.REGISTRY or module:Class")
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--host", default="127.0.0.1",
                      help="interface to bind (default loopback only; 0.0.0.0 exposes it)")
  parser.add_argument("--protocol", default=None,
                      help="field names to speak: those of a registered environment "
                           "(default: the environment's own)")
  parser.add_argument("--strict", action="store_true",
                      help="answer as upstream does: no 'textenv' field, no /expert_action")
  args = parser.parse_args(argv)
  proto = environments.protocol_of(args.protocol or args.env)
  service = EnvService(env_factory(args.env), proto, strict=args.strict)
  uvicorn.run(build_app(service), host=args.host, port=args.port, log_level="warning",
              access_log=False)


if __name__ == "__main__":
  main()
