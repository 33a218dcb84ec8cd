"""Our env server against the exact request sequences of AgentGym's own env clients.

Each test replays, with plain `requests`, what the corresponding `agentenv.envs.*EnvClient`
sends (body keys, query strings, the order of calls) and reads back exactly the fields that
client reads, with the status codes it asserts. If one of these fails, an unmodified AgentGym
client would crash against our server.
"""

from __future__ import annotations

import pytest
import requests

from environments.server import running_server

_TIMEOUT = 60


@pytest.fixture(scope="module")
def servers():
  """server(name) -> URL, each started once for this module and always stopped."""
  started, stacks = {}, []

  def server(name: str) -> str:
    if name not in started:
      context = running_server(name)
      started[name] = context.__enter__()
      stacks.append(context)
    return started[name]

  yield server
  for context in reversed(stacks):
    context.__exit__(None, None, None)


def _post(url: str, path: str, body: dict | None = None) -> requests.Response:
  response = requests.post(f"{url}/{path}", json=body, timeout=_TIMEOUT)
  assert response.status_code == 200, (path, response.status_code, response.text[:300])
  return response


def test_babyai_client_sequence(servers):
  url = servers("babyai")
  # BabyAIEnvClient.__init__: POST /create with no body, reads ["id"].
  env_id = _post(url, "create").json()["id"]
  # reset(data_idx): POST /reset {"data_idx", "id"}; reads observation, reward, score, done.
  reset = _post(url, "reset", {"data_idx": 1, "id": env_id}).json()
  assert reset["observation"].startswith("Your goal: ")
  assert (reset["reward"], reset["score"], reset["done"]) == (0, 0, False)
  # step(action): the client sends the text after "Action:", stripped.
  step = _post(url, "step", {"action": "turn left", "id": env_id}).json()
  assert set(step) >= {"observation", "reward", "score", "done"}
  assert "Available actions:" in step["observation"]
  bad = _post(url, "step", {"action": "fly to the moon", "id": env_id}).json()
  assert bad["score"] == 0 and bad["done"] is False
  # _get("observation"): GET /observation?id=...
  assert requests.get(f"{url}/observation?id={env_id}", timeout=_TIMEOUT).status_code == 200
  _post(url, "close", {"id": env_id})


def test_textcraft_client_sequence(servers):
  url = servers("textcraft")
  # TextCraftEnvClient.__init__ posts its directory info and reads ["id"] and ["observation"].
  created = _post(url, "create", {"minecraft_dir": "agentenv_textcraft/", "commands": None,
                                  "goal": None}).json()
  env_id = created["id"]
  assert isinstance(created["observation"], str)
  reset = _post(url, "reset", {"data_idx": 0, "id": env_id}).json()
  assert "Crafting commands:" in reset["observation"] and "Goal: craft" in reset["observation"]
  # The client already reduced the action to [A-Za-z0-9, ] and sends e.g. "inventory".
  step = _post(url, "step", {"action": "inventory", "id": env_id}).json()
  assert step["observation"].startswith("Inventory")
  assert (step["reward"], step["done"]) == (0, False)
  # TextCraftEnvClient.close: POST /close {"id"}.
  _post(url, "close", {"id": env_id})


@pytest.mark.slow  # starts a JVM
def test_sciworld_client_sequence(servers):
  url = servers("sciworld")
  env_id = _post(url, "create").json()["id"]
  # SciworldEnvClient.reset rebuilds the first observation from two fields.
  reset = _post(url, "reset", {"data_idx": 0, "id": env_id}).json()
  first = reset["task_description"] + "\n" + reset["observation"]
  assert "Your task is to" in first
  step = _post(url, "step", {"action": "look around", "id": env_id}).json()
  assert set(step) >= {"observation", "reward", "score", "done"}
  assert "This room is called" in step["observation"]
  _post(url, "close", {"id": env_id})


def test_searchqa_client_sequence(servers):
  url = servers("searchqa")
  # The SearchQA client creates with an item id, reads a bare integer, then resets with "id".
  env_idx = _post(url, "create", {"id": 0}).json()
  assert isinstance(env_idx, int)
  _post(url, "reset", {"env_idx": env_idx, "id": 3})
  observation = requests.get(f"{url}/observation", params={"env_idx": env_idx},
                             timeout=_TIMEOUT).json()
  assert "Question:" in observation
  step = _post(url, "step", {"env_idx": env_idx,
                             "action": "<think>x</think><search>paris</search>"}).json()
  assert step["observation"].startswith("<information>Doc 1(Title: ")
  assert (step["reward"], step["done"]) == (0, False)
  _post(url, "close", {"env_idx": env_idx})
