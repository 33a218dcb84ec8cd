"""SearchQA (Deep Search) as a text environment; see `env.py`, `retrieval.py`, README.md."""

from environments.searchqa.env import SearchQAEnv

__all__ = ["SearchQAEnv"]
