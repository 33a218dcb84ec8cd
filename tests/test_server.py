"""The env service: our client against our server behaves like the local environment, speaks
AgentGym's field names, rejects bad requests with a 4xx, and holds up under churn and
concurrency. Every server runs in a subprocess on a free loopback port and is always stopped.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import statistics
import time

import pytest
import requests
from fastapi import testclient

import environments
from environments import protocol as protocol_lib
from environments.client import RemoteEnv, RemoteEnvError
from environments.server import EnvService, build_app, jsonable, running_server
from environments.workers import EnvPool

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_TOY_ENV = {"PYTHONPATH": os.pathsep.join([_TESTS_DIR, os.environ.get("PYTHONPATH", "")])}
REAL_ENVS = ["babyai", "textcraft", "searchqa",
             pytest.param("sciworld", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def servers():
  """server(env, strict=False) -> URL of a server started once for this module."""
  urls: dict[tuple[str, bool], str] = {}
  with contextlib.ExitStack() as stack:

    def server(name: str, strict: bool = False) -> str:
      if (name, strict) not in urls:
        urls[name, strict] = stack.enter_context(running_server(name, strict=strict))
      return urls[name, strict]

    yield server


@pytest.fixture(scope="module")
def toy_url():
  with running_server("toy_envs:CounterEnv", protocol="babyai", extra_env=_TOY_ENV) as url:
    yield url


# ----- behaviour: remote equals local ---------------------------------------------------------

_ODD_RESPONSES = [
    "Thought: I am not sure.",                                  # no action at all
    "Action: fly to the moon\nAction: and back",               # two actions
    "Thought: x\nAction: " + "do it " * 4000,                  # huge
    "Thought: \x00\x01\x7f\ufffd\nAction: look \x1b[31m around",  # control and binary junk
]


def _text(env, observation: str) -> str | list[str]:
  # ScienceWorld lists the objects of a room in an order that can differ between two JVMs
  # (and after the expert reloads a game), so its observations compare as sets of lines.
  return sorted(observation.split("\n")) if env.name == "sciworld" else observation


def _play(env, task_id: int, responses: list[str] | None = None) -> list[tuple]:
  """Reset, then `responses` (default: the expert's, to the end); every result as plain data."""
  observation, info = env.reset(options={"task_id": task_id})
  trace = [(_text(env, observation), info["instruction"], info["task_id"])]
  # 120 turns outlast SciWorld's 100-move limit; the other experts finish well within them.
  for turn in range(len(responses) if responses is not None else 120):
    if responses is not None:
      response = responses[turn]
    else:
      response = env.format_action(env.expert_action())
    observation, reward, terminated, truncated, info = env.step(env.parse_action(response))
    trace.append((_text(env, observation), reward, terminated, truncated, jsonable(info)))
    if terminated or truncated:
      break
  return trace


@pytest.mark.parametrize("name", REAL_ENVS)
@pytest.mark.parametrize("reward_mode", ["normalized", "paper"])
def test_remote_env_equals_local_env(servers, name, reward_mode):
  url = servers(name)
  task_ids = environments.task_splits(name)["test"][:2]
  remote = environments.make("remote", url=url, env_name=name, reward_mode=reward_mode)
  local = environments.make(name, reward_mode=reward_mode)
  try:
    assert type(remote).parse_action is type(local).parse_action
    assert remote.instruction == local.instruction
    for task_id in task_ids:
      assert _play(remote, task_id, _ODD_RESPONSES) == _play(local, task_id, _ODD_RESPONSES)
      expected = _play(local, task_id)
      assert _play(remote, task_id) == expected
      assert expected[-1][2] or expected[-1][3], f"task {task_id} did not end"
  finally:
    remote.close()
    local.close()


@pytest.mark.parametrize("name", REAL_ENVS)
def test_strict_server_gives_local_rewards_and_success(servers, name):
  """Against upstream-shaped answers (no extension) the client derives the same rewards."""
  url = servers(name, strict=True)
  task_id = environments.task_splits(name)["test"][0]
  # The expert plays in an env of its own: SciWorld's expert reloads its game.
  expert, local = environments.make(name), environments.make(name)
  remote = environments.make("remote", url=url, env_name=name)
  try:
    for env in (expert, local):
      observation = env.reset(options={"task_id": task_id})[0]
    assert _text(remote, remote.reset(options={"task_id": task_id})[0]) == _text(
        local, observation)
    for _ in range(120):
      action = expert.expert_action()
      expert.step(action)
      want, got = local.step(action), remote.step(action)
      assert _text(remote, got[0]) == _text(local, want[0])
      assert got[1] == pytest.approx(want[1])
      assert got[2] == (want[2] or want[3])  # upstream's done folds in truncation
      assert got[4]["success"] == want[4]["success"]
      assert got[4]["score"] == pytest.approx(want[4]["score"])
      if got[2]:
        break
    assert got[2]
    with pytest.raises(NotImplementedError, match="expert"):
      remote.expert_action()
  finally:
    for env in (remote, expert, local):
      env.close()


def test_strict_babyai_server_continues_after_a_late_success_as_upstream(servers):
  """AgentGym's BabyAI server ends an episode only on a success worth more than 0.5; a late
  one (36 wasted turns of GoToRedBall's 64-primitive budget) leaves it running."""
  url = servers("babyai", strict=True)
  local = environments.make("babyai", reward_mode="paper")
  remote = environments.make("remote", url=url, env_name="babyai", reward_mode="paper")
  try:
    for env in (local, remote):
      env.reset(options={"task_id": 1})
    for _ in range(36):
      want, got = local.step("turn left"), remote.step("turn left")
    while not want[4]["success"]:
      action = local.expert_action()
      want, got = local.step(action), remote.step(action)
    assert 0 < want[4]["score"] <= 0.5 and not want[2]
    assert got[2] is False and got[1] == pytest.approx(want[1])
  finally:
    remote.close()
    local.close()


@pytest.mark.parametrize("name", REAL_ENVS)
def test_remote_reset_info_has_the_local_category(servers, name):
  """AgentGym's protocol sends no category; the client fills it in from the split file, so
  remote evaluations keep their per-category columns."""
  url = servers(name, strict=True)
  local = environments.make(name)
  remote = environments.make("remote", url=url, env_name=name)
  try:
    splits = environments.task_splits(name)
    for task_id in splits["test"][:3] + splits["train"][:2]:
      want = local.reset(options={"task_id": task_id})[1]["category"]
      assert remote.reset(options={"task_id": task_id})[1]["category"] == want
  finally:
    remote.close()
    local.close()


def test_webarena_split_names_each_test_task_site():
  """The paper's WebArena columns hold 15 Shopping, 15 CMS, 10 Maps, 10 GitLab+Reddit tasks."""
  categories = environments.task_categories("remote", "webarena")
  assert sorted(categories) == sorted(environments.task_splits("remote", "webarena")["test"])
  counts = collections.Counter(categories.values())
  assert counts == {"shopping": 15, "shopping_admin": 15, "map": 10, "gitlab": 5, "reddit": 5}


# ----- the registry: an environment is its package plus one registration ------------------


@pytest.fixture
def registered():
  """register(name, cls, **kwargs) as `environments.register`, undone after the test."""
  names = []

  def register(name, cls, **kwargs):
    environments.register(name, cls, **kwargs)
    names.append(name)

  yield register
  for name in names:
    environments.REGISTRY.pop(name)


@pytest.mark.parametrize("create_resets_to, create_body, steps_without_reset", [
    (None, None, False),             # BabyAI, SciWorld: the client resets
    ("own_id", None, True),          # TextCraft: task = the instance's own id
    ("body", {"data_idx": 2}, True),  # SearchQA: the task the body names under reset_key
    ("body", None, False),           # ... and none when it names none
])
def test_a_registration_is_served_with_its_protocol(registered, create_resets_to, create_body,
                                                     steps_without_reset):
  """The server serves any registered environment by name, and what it does on /create is
  the registration's data, not a branch on the environment's name."""
  registered("counter", "toy_envs:CounterEnv",
             protocol=protocol_lib.Protocol(create_resets_to=create_resets_to))
  assert environments.protocol_of("counter").name == "counter"
  service = EnvService(environments.env_class("counter"),
                       environments.protocol_of("counter"))
  with testclient.TestClient(build_app(service)) as client:
    for expected_id in range(2):
      instance = client.post("/create", json=create_body).json()["id"]
      assert instance == expected_id
      step = client.post("/step", json={"id": instance, "action": "inc"})
      assert step.status_code == (200 if steps_without_reset else 409), step.text
    if steps_without_reset:
      # Task n counts to n + 1, so neither task 1 (own id) nor 2 (the body's) ended in a step.
      assert client.get("/observation", params={"id": 1}).json() == "Count 1."
    assert client.get("/health").json()["env"] == "counter"
  service.close_all()


def test_registry_refuses_and_explains(registered):
  with pytest.raises(ValueError, match="'babyai' is already registered to "
                                       "environments.babyai.env:BabyAIEnv"):
    environments.register("babyai", "toy_envs:CounterEnv")
  with pytest.raises(ValueError, match="create_resets_to must be one of"):
    protocol_lib.Protocol(create_resets_to="instance")
  with pytest.raises(ValueError, match=r"No AgentGym protocol known for 'keypad'; known: \["
                                       r"'babyai', 'sciworld', 'searchqa', 'textcraft', "
                                       r"'webarena'\]"):
    environments.protocol_of("keypad")
  with pytest.raises(ValueError, match="'webarena' runs only behind its AgentGym server: use "
                                       "'remote' with env_name='webarena'"):
    environments.make("webarena")
  registered("counter", "toy_envs:CounterEnv")
  assert "counter" in environments.local_names()
  assert environments.make("counter").reset(options={"task_id": 0})[0] == "Target 1. Count 0."


def test_every_registration_loads_and_every_protocol_has_a_remote_class():
  for name, registration in environments.REGISTRY.items():
    cls = registration.load()
    assert cls.name == name or name == "remote", (name, cls)
    if registration.protocol is not None:
      remote = environments.env_class("remote", env_name=name)
      assert remote.protocol is registration.protocol
      assert (remote.instruction, remote.parse_action) == (cls.instruction, cls.parse_action)


# ----- AgentGym's own clients ------------------------------------------------------------------


@pytest.mark.parametrize("name", REAL_ENVS)
def test_agentgym_client_calls_work(servers, name):
  """The requests AgentGym's client for `name` makes, and the fields it reads, all work."""
  url = servers(name, strict=True)
  proto = environments.protocol_of(name)
  task_id = environments.task_splits(name)["test"][0]
  post = lambda path, body=None: requests.post(url + path, json=body, timeout=30)
  if name == "searchqa":
    created = post("/create", {"id": 0})
    assert created.status_code == 200 and isinstance(created.json(), int)
    env_idx = created.json()
    reset = post("/reset", {"env_idx": env_idx, "id": task_id})
    assert reset.status_code == 200 and isinstance(reset.json(), str)
    observed = requests.get(f"{url}/observation?env_idx={env_idx}", timeout=30)
    assert observed.status_code == 200 and observed.json() == reset.json()
    step = post("/step", {"env_idx": env_idx, "action": "<search> a query </search>"})
    assert step.status_code == 200
    assert set(step.json()) == {"observation", "reward", "done", "info"}
    assert post("/close", {"env_idx": env_idx}).json() is True
    return
  body = {"minecraft_dir": "agentenv_textcraft/", "commands": None, "goal": None} \
      if name == "textcraft" else None
  created = post("/create", body)
  assert created.status_code == 200
  instance = created.json()["id"]
  if name == "textcraft":
    assert isinstance(created.json()["observation"], str)
  reset = post("/reset", {"id": instance, "data_idx": task_id})
  assert reset.status_code == 200
  fields = {"babyai": {"observation", "reward", "score", "done"},
            "textcraft": {"observation", "reward", "done"},
            "sciworld": {"task_description", "observation"}}[name]
  assert fields <= set(reset.json())
  step = post("/step", {"id": instance, "action": "look around"})
  assert step.status_code == 200
  assert set(step.json()) == {"observation", "reward", "done"} | (
      {"score"} if proto.score_field else set())
  assert post("/close", {"id": instance}).json() is True


# ----- bad requests ----------------------------------------------------------------------------


@pytest.mark.parametrize("method, path, body, status, message", [
    ("post", "/step", b'{"id": 0, "action": "inc"', 400, "not valid JSON"),
    ("post", "/reset", b'[1, 2]', 400, "must be a JSON object"),
    ("post", "/reset", b'', 400, "empty"),
    # Valid JSON that Python's parser refuses: an integer past its 4300-digit limit, and
    # nesting past its recursion limit.
    ("post", "/step", b'{"id": ' + b"7" * 5000 + b', "action": "inc"}', 400, "not valid JSON"),
    ("post", "/step", b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    ("post", "/step", b'{"action": "inc"}', 400, "needs the field 'id'"),
    ("post", "/reset", b'{"id": 0}', 400, "needs the field 'data_idx'"),
    ("post", "/step", b'{"id": "zero", "action": "inc"}', 400, "must be an integer"),
    ("post", "/step", b'{"id": 0, "action": 5}', 400, "must be a string"),
    ("post", "/step", b'{"id": 987654, "action": "inc"}', 404, "Unknown id 987654"),
    ("post", "/reset", b'{"id": 987654, "data_idx": 1}', 404, "Unknown id"),
    ("post", "/close", b'{"id": 987654}', 404, "Unknown id"),
    ("get", "/observation?id=987654", None, 404, "Unknown id"),
    ("get", "/observation", None, 400, "?id=N"),
    ("get", "/observation?id=x", None, 400, "not an integer"),
])
def test_bad_requests_get_4xx_with_a_message(toy_url, method, path, body, status, message):
  response = getattr(requests, method)(toy_url + path, data=body, timeout=10)
  assert response.status_code == status
  assert message in response.json()["error"]


def test_episode_state_errors(toy_url):
  instance = requests.post(toy_url + "/create", timeout=10).json()["id"]
  step = lambda action: requests.post(toy_url + "/step", json={"id": instance, "action": action},
                                      timeout=10)
  assert step("inc").status_code == 409  # not reset yet
  bad_reset = requests.post(toy_url + "/reset", json={"id": instance, "data_idx": -3}, timeout=10)
  assert bad_reset.status_code == 400 and "task -3" in bad_reset.json()["error"]
  requests.post(toy_url + "/reset", json={"id": instance, "data_idx": 0}, timeout=10)
  assert step("raise").status_code == 500  # the env failed: rebuilt, needs a reset
  assert step("inc").status_code == 409
  requests.post(toy_url + "/reset", json={"id": instance, "data_idx": 0}, timeout=10)
  finished = step("inc").json()
  assert finished["done"] and finished["score"] == 1.0 and finished["reward"] == 1.0
  assert step("inc").status_code == 409  # the episode is over
  assert requests.post(toy_url + "/close", json={"id": instance}, timeout=10).json() is True


# ----- the client --------------------------------------------------------------------------------


def test_client_recreates_a_lost_instance_and_reports_errors(toy_url):
  env = RemoteEnv(toy_url, "babyai")
  lost = env.instance_id
  requests.post(toy_url + "/close", json={"id": lost}, timeout=10)
  assert env.reset(options={"task_id": 1})[0] == "Target 2. Count 0."
  assert env.instance_id != lost
  requests.post(toy_url + "/close", json={"id": env.instance_id}, timeout=10)
  with pytest.raises(RemoteEnvError, match="answered 404: Unknown id"):
    env.step("inc")
  env.close()
  env.close()
  with pytest.raises(RemoteEnvError, match="failed"):
    RemoteEnv("http://127.0.0.1:9", "babyai", retries=1, timeout_s=2)


def test_webarena_field_names():
  with running_server("toy_envs:BacktickCounterEnv", protocol="webarena",
                      extra_env=_TOY_ENV) as url:
    env = environments.make("remote", url=url, env_name="webarena")
    assert env.parse_action("I think. ```click [3]```") == "I think. ```click [3]```"
    assert env.reset(options={"task_id": 1})[0] == "Target 2. Count 0."
    # Without a ``` action the client answers itself, as AgentGym's WebArena client does.
    assert env.step("no backticks")[:3] == (
        "Cannot parse action from response. Your action should be inside triple backticks "
        "(```). Please adjust accordingly.", 0.0, False)
    assert env.step(env.format_action("inc"))[:4] == ("Count 1.", 0.0, False, False)
    observation, reward, terminated, truncated, info = env.step(env.format_action("inc"))
    assert (observation, reward, terminated, truncated) == ("Count 2.", 1.0, True, False)
    assert info["success"]
    observed = requests.get(url + "/observation", params={"env_idx": env.instance_id}, timeout=10)
    assert observed.json() == "Count 2."
    raw = requests.post(url + "/step", json={"env_idx": env.instance_id, "action": "x"},
                        timeout=10)
    assert raw.status_code == 409
    env.close()


def test_pool_of_remote_envs(toy_url):
  env_kwargs = {"url": toy_url, "env_name": "babyai"}
  with EnvPool("remote", num_workers=2, env_kwargs=env_kwargs, timeout_s=30) as pool:
    outcomes = pool.reset([0, 1, 2])
    assert [o.observation for o in outcomes] == [f"Target {n}. Count 0." for n in (1, 2, 3)]
    outcomes = pool.step([0, 1, 2], ["Action: inc"] * 3)
    assert [(o.reward, o.terminated) for o in outcomes] == [(1.0, True), (0.0, False),
                                                            (0.0, False)]
    assert outcomes[0].info["action"] == "inc"


# ----- load ----------------------------------------------------------------------------------


def _churn(url: str, name: str, cycles: int) -> tuple[int, int, int]:
  """create/reset/step/close `cycles` times; (RSS after warm-up, RSS at end, instances)."""
  proto = environments.protocol_of(name)
  session = requests.Session()
  rss = []
  for cycle in range(cycles):
    instance = proto.read_create(session.post(url + "/create", json=proto.create_body()).json())
    reset = session.post(url + "/reset", json=proto.reset_body(instance, cycle % 50))
    assert reset.status_code == 200, reset.text
    step = session.post(url + "/step", json=proto.step_body(instance, "inventory"))
    assert step.status_code == 200, step.text
    assert session.post(url + "/close", json=proto.close_body(instance)).status_code == 200
    if cycle in (cycles // 5, cycles - 1):
      rss.append(session.get(url + "/health").json()["rss_bytes"])
  return rss[0], rss[1], session.get(url + "/health").json()["instances"]


@pytest.mark.parametrize("cycles", [500, pytest.param(5000, marks=pytest.mark.slow)])
def test_create_step_close_cycles_leave_the_server_flat(servers, cycles):
  warm, end, instances = _churn(servers("textcraft"), "textcraft", cycles)
  print(f"{cycles} cycles: RSS {warm / 2**20:.1f} -> {end / 2**20:.1f} MiB")
  assert instances == 0
  assert end - warm < 16 * 2**20, f"RSS grew by {(end - warm) / 2**20:.1f} MiB"


def _client_steps(url: str, steps: int) -> list[float]:
  env = RemoteEnv(url, "babyai")
  latencies = []
  env.reset(options={"task_id": 4})  # five increments to the end
  for _ in range(steps):
    start = time.perf_counter()
    _, _, terminated, _, info = env.step(env.parse_action("Action: inc"))
    latencies.append(time.perf_counter() - start)
    assert "error" not in info
    if terminated:
      env.reset(options={"task_id": 4})
  env.close()
  return latencies


@pytest.mark.parametrize("steps", [50, pytest.param(200, marks=pytest.mark.slow)])
def test_32_concurrent_clients(toy_url, steps):
  with concurrent.futures.ThreadPoolExecutor(32) as executor:
    results = list(executor.map(lambda _: _client_steps(toy_url, steps), range(32)))
  assert [len(r) for r in results] == [steps] * 32
  assert requests.get(toy_url + "/health", timeout=10).json()["instances"] == 0


def test_median_step_latency_over_loopback(toy_url):
  latencies = _client_steps(toy_url, 300)
  median_ms = 1000 * statistics.median(latencies)
  print(f"median step latency over loopback (toy env): {median_ms:.2f} ms")
  assert median_ms < 50
