"""WebArena's side of the text interface: what the agent is told and how its actions look.

There is no local WebArena (see the package docstring), so this is not a `TextEnv`: it is the
instruction, acknowledgement, parser and formatter that `environments.client.RemoteEnv.serving`
gives a remote WebArena, as it gives a remote BabyAI those of `BabyAIEnv`.
"""

from __future__ import annotations


class WebArenaPrompt:
  """The prompt and action format of AgentGym's WebArena client."""

  name = "webarena"
  instruction = (
      "You are an autonomous agent operating a web browser to complete a web-based task. Each "
      "observation shows the objective, the page's accessibility tree, its URL and the open "
      "tabs. Think step by step, then give exactly one action inside triple backticks, e.g. "
      "```click [42]```, ```type [17] [text] [1]```, ```scroll [down]```, ```goto [url]``` or "
      "```stop [answer]``` when the task is done (answer N/A if it cannot be done).")
  acknowledgement = "Ok."

  @staticmethod
  def parse_action(response: str) -> str:
    # WebArena's server extracts the ``` action itself from the full response.
    return response

  @staticmethod
  def format_action(action: str, thought: bool = True) -> str:  # pylint: disable=unused-argument
    return f"In summary, the next action I will perform is ```{action}```"
