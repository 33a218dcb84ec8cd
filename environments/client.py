"""`RemoteEnv`: a `TextEnv` whose simulator runs behind an AgentGym env server.

    env = environments.make("remote", url="http://127.0.0.1:36005", env_name="babyai")
    observation, info = env.reset(options={"task_id": 7})
    observation, reward, terminated, truncated, info = env.step(env.parse_action(response))

It talks to our `environments.server` and to genuine AgentGym servers alike (BabyAI, TextCraft,
SciWorld, SearchQA, WebArena), using each one's field names (`environments.protocol`). As in
AgentGym, the client extracts the action from the agent's response (`parse_action`, the local
environment's parser) and the server receives the action string. In an `EnvPool`, use
`EnvPool("remote", env_kwargs={"url": ..., "env_name": ...})`.

Rewards: with `reward_mode="paper"` the step reward is the raw value AgentGym's own client
reports (`score` for BabyAI and SciWorld, else `reward`). With "normalized" it is the reward
of our local environment: taken verbatim from our server's `textenv` extension, or, against a
genuine server, the raw value scaled to [0, 1] (`Protocol.normalize`). Against a genuine
server, `truncated` is always False: AgentGym's `done` folds truncation into termination.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import requests
from requests import adapters
from urllib3.util import retry as retry_lib

import environments
from environments import protocol as protocol_lib
from environments.base import (MULTIPLE_ACTIONS, MULTIPLE_ACTIONS_OBSERVATION, TextEnv,
                               react_response)

class RemoteEnvError(RuntimeError):
  """The server could not be reached, or answered with an error."""

  def __init__(self, message: str, status: int | None = None, payload: Any = None):
    super().__init__(message)
    self.status = status
    self.payload = payload


def react_action(response: str) -> str:
  """Everything after the last "Action:" in `response`, stripped; "" when there is none."""
  if "Action:" not in response:
    return ""
  return response.rsplit("Action:", 1)[1].strip()


class RemoteEnv(TextEnv):
  """A `TextEnv` over AgentGym's HTTP protocol.

  `RemoteEnv(url, env_name)` builds an instance of `RemoteEnv.serving(env_name)`, whose parser,
  formatter and instruction are those of the class `env_name` is registered with (WebArena's:
  the raw response is sent, its server parses the triple-backtick action, as with AgentGym's
  client). The class itself (`environments.env_class("remote")`) parses generic ReAct
  responses.

  Args:
    url: the server's base URL, e.g. "http://127.0.0.1:36005".
    env_name: the served environment, registered with a protocol (`environments.protocol_of`).
    reward_mode: "normalized" or "paper" (see the module docstring).
    timeout_s: limit on each HTTP request.
    retries: how often a failed connection is retried, with exponential backoff (the
      default 5 wait about 15 s in all); requests that reached the server are not repeated.
    instruction: overrides the instruction shown to the agent.
  """

  name = "remote"
  instruction = ("Solve the task. Answer in the format\nThought:\nyour thoughts.\n\nAction:\n"
                 "your next action")
  protocol: protocol_lib.Protocol | None = None

  def __new__(cls, url: str | None = None, env_name: str | None = None, *args, **kwargs):
    del url, args, kwargs
    if cls is RemoteEnv and env_name is not None:
      cls = cls.serving(env_name)
    return super().__new__(cls)

  @classmethod
  def serving(cls, env_name: str) -> type[RemoteEnv]:
    """The subclass for `env_name`, with the parser and prompt of the class it is registered
    with; one per name, built once."""
    return _served_class(env_name)

  def __init__(self, url: str, env_name: str, reward_mode: str = "normalized",
               timeout_s: float = 60.0, retries: int = 5, instruction: str | None = None):
    super().__init__(reward_mode)
    if self.protocol is None or self.protocol.name != env_name:
      raise ValueError(f"Build remote envs as RemoteEnv(url, env_name) or "
                       f"environments.make('remote', url=..., env_name=...); got {type(self)}.")
    self.url = url.rstrip("/")
    self.env_name = env_name
    self.timeout_s = timeout_s
    if instruction is not None:
      self.instruction = instruction
    self._session = requests.Session()
    # Only failures to connect are retried: a /step that reached the server must not run twice.
    policy = retry_lib.Retry(total=retries, connect=retries, read=0, status=0, other=0,
                             redirect=0, backoff_factor=0.5, raise_on_status=False)
    self._session.mount("http://", adapters.HTTPAdapter(max_retries=policy))
    self._session.mount("https://", adapters.HTTPAdapter(max_retries=policy))
    self.instance_id: int | None = None
    self._last_raw, self._last_success = 0.0, False
    # An agentgym-jax server with extensions gives exact local behaviour (see the server).
    self.extensions = self._probe_extensions()
    self._create()

  # ----- HTTP ----------------------------------------------------------------------------------

  def _request(self, method: str, path: str, body: Any = None,
               params: dict[str, Any] | None = None) -> Any:
    where = f"{method} {self.url}{path}"
    try:
      response = self._session.request(method, self.url + path, json=body, params=params,
                                       timeout=self.timeout_s)
    except requests.RequestException as exc:
      raise RemoteEnvError(f"{where} failed: {exc}") from exc
    try:
      payload = response.json()
    except ValueError:
      payload = None
    if response.status_code != 200:
      if isinstance(payload, dict):
        message = payload.get("error") or payload.get("detail")
      else:
        message = response.text[:300]
      raise RemoteEnvError(f"{where} answered {response.status_code}: {message}",
                           response.status_code, payload)
    if isinstance(payload, dict) and "error" in payload:
      # Upstream servers report failures as HTTP 200 with an "error" field.
      raise RemoteEnvError(f"{where} answered an error: {payload['error']}", 200)
    return payload

  def _probe_extensions(self) -> bool:
    try:
      health = self._request("GET", "/health")
    except RemoteEnvError as exc:
      if exc.status is None:  # unreachable: say so now rather than after /create's retries
        raise
      return False  # upstream servers have no /health
    return isinstance(health, dict) and health.get("extensions") is True

  def _create(self) -> None:
    body = self.protocol.create_body()
    if self.extensions:
      body = dict(body or {}, reward_mode=self.reward_mode)
    self.instance_id = self.protocol.read_create(self._request("POST", "/create", body))

  # ----- TextEnv -------------------------------------------------------------------------------

  def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
    if self.instance_id is None:
      self._create()
    body = self.protocol.reset_body(self.instance_id, task_id)
    try:
      response = self._request("POST", "/reset", body)
    except RemoteEnvError as exc:
      if exc.status != 404:
        raise
      # The server no longer knows the instance (e.g. it restarted): start a new one.
      self._create()
      response = self._request("POST", "/reset",
                               self.protocol.reset_body(self.instance_id, task_id))
    self._last_raw, self._last_success = 0.0, False
    # AgentGym's protocol carries no category; the split file knows each task's.
    category = _categories(self.env_name).get(int(task_id))
    return self.protocol.read_reset(response), {} if category is None else {"category": category}

  def _step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
    # AgentGym's clients answer these responses themselves, without a server round trip; our
    # server's environments answer them the same way.
    if not self.extensions and action == MULTIPLE_ACTIONS:
      return (MULTIPLE_ACTIONS_OBSERVATION, 0.0, False, False,
              {"success": self._last_success, "score": self._last_raw})
    local_answer = self.protocol.answer_locally(action)
    if local_answer is not None:
      return (local_answer, 0.0, False, False,
              {"success": self._last_success, "score": self._last_raw})
    response = self._request("POST", "/step", self.protocol.step_body(self.instance_id, action))
    reply = self.protocol.read_step(response)
    extension = response.get("textenv") if isinstance(response, dict) else None
    if extension is not None:
      reward = float(extension["reward"])
      terminated, truncated = bool(extension["terminated"]), bool(extension["truncated"])
      info = dict(extension["info"])
    else:
      reward = self.protocol.normalize(reply.raw_reward)
      if self.reward_mode == "paper":
        reward = reply.raw_reward
      terminated, truncated = reply.terminated, reply.truncated
      info = {"success": self.protocol.is_success(reply.raw_reward, terminated)}
    info["score"] = reply.raw_reward
    self._last_raw, self._last_success = reply.raw_reward, bool(info["success"])
    return reply.observation, reward, terminated, truncated, info

  def expert_action(self) -> str:
    """The expert's move, from an agentgym-jax server (upstream servers have no expert)."""
    try:
      response = self._request("GET", "/expert_action",
                               params={self.protocol.id_key: self.instance_id})
    except RemoteEnvError as exc:
      # A missing route answers 404 without our "error" field (an unknown id has one).
      if exc.status == 404 and not (isinstance(exc.payload, dict) and "error" in exc.payload):
        raise NotImplementedError(f"{self.url} has no /expert_action endpoint; only "
                                  "agentgym-jax servers provide the expert.") from exc
      raise
    return str(response["action"])

  def close(self) -> None:
    """Frees the server-side instance and the connection pool. Idempotent."""
    instance_id, self.instance_id = self.instance_id, None
    try:
      # A server that is gone or already forgot the instance leaves nothing to free.
      with contextlib.suppress(RemoteEnvError):
        if instance_id is not None:
          self._request("POST", "/close", self.protocol.close_body(instance_id))
    finally:
      self._session.close()

  @staticmethod
  def parse_action(response: str) -> str:
    return react_action(response)

  @staticmethod
  def format_action(action: str, thought: bool = True) -> str:
    return react_response(action, "I act." if thought else None)


@functools.cache
def _categories(env_name: str) -> dict[int, str]:
  """Task id -> category of the served environment (none for one without a split file)."""
  try:
    return environments.task_categories(env_name)
  except ValueError:
    return {}


@functools.cache
def _served_class(env_name: str) -> type[RemoteEnv]:
  proto = environments.protocol_of(env_name)
  served = environments.REGISTRY[env_name].load()
  attrs: dict[str, Any] = {
      "name": env_name, "protocol": proto, "__module__": __name__,
      "instruction": served.instruction, "acknowledgement": served.acknowledgement,
      "parse_action": staticmethod(served.parse_action),
      "format_action": staticmethod(served.format_action)}
  class_name = "Remote" + "".join(part.capitalize() for part in env_name.split("_"))
  return type(class_name, (RemoteEnv,), attrs)
