"""ScienceWorld as a text environment (AgentGym's SciWorld); see `env.py` and `games.py`."""

from environments.sciworld.env import SciWorldEnv

__all__ = ["SciWorldEnv"]
