"""Name -> function registries for the RL math (estimators, policy losses, KL estimators).

Configs name an algorithm by string; a registry turns the string into the pure function and,
on a misspelt name, says which names exist instead of raising a bare `KeyError`.
"""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(dict):
  """A `dict[str, Callable]` whose missing-key error lists the registered names."""

  def __init__(self, kind: str):
    super().__init__()
    self.kind = kind

  def register(self, *names: str) -> Callable[[F], F]:
    """Decorator registering a function under one or more names (aliases)."""

    def decorator(fn: F) -> F:
      for name in names:
        if name in self and self[name] is not fn:
          raise ValueError(f"{self.kind} {name!r} is already registered to {self[name]}")
        self[name] = fn
      return fn

    return decorator

  def __missing__(self, name: str):
    raise KeyError(f"unknown {self.kind} {name!r}; registered: {sorted(self)}")
