"""Name -> function registries for the RL math (estimators, policy losses, KL estimators).

Configs name an algorithm by string; a registry turns the string into the pure function and,
on a misspelt name, says which names exist instead of raising a bare `KeyError`. A registry
may also keep what its callers need to know about each function beyond the function itself
(its traits: e.g. whether an advantage estimator needs a critic), declared where the function
is registered, so callers read them instead of keeping their own lists of names:

  ESTIMATORS = Registry("advantage estimator", uses_critic=False, uses_turns=False)

  @ESTIMATORS.register("gae", uses_critic=True)
  def gae(...): ...

  ESTIMATORS.traits("gae")  # {"uses_critic": True, "uses_turns": False}
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(dict):
  """A `dict[str, Callable]` whose missing-key error lists the registered names.

  Attributes:
    kind: what the functions are, for error messages ("advantage estimator").
    default_traits: every trait a registration may declare, with the value of those that do
      not (a misspelt trait is an error at registration, not a silent default).
  """

  def __init__(self, kind: str, **default_traits: Any):
    super().__init__()
    self.kind = kind
    self.default_traits = default_traits
    self._traits: dict[str, dict[str, Any]] = {}

  def register(self, *names: str, **traits: Any) -> Callable[[F], F]:
    """Decorator registering a function under one or more names (aliases), with its traits.

    Raises:
      ValueError: a name already registered to another function, or a trait this registry
        does not define.
    """
    unknown = sorted(set(traits) - set(self.default_traits))
    if unknown:
      raise ValueError(f"{self.kind} traits {unknown} are not among this registry's "
                       f"{sorted(self.default_traits)}; declare them in its Registry(...).")

    def decorator(fn: F) -> F:
      for name in names:
        if name in self and self[name] is not fn:
          raise ValueError(f"{self.kind} {name!r} is already registered to {self[name]}")
        self[name] = fn
        self._traits[name] = {**self.default_traits, **traits}
      return fn

    return decorator

  def unregister(self, *names: str) -> None:
    """Removes the names (and their traits); names not registered are ignored."""
    for name in names:
      self.pop(name, None)
      self._traits.pop(name, None)

  def traits(self, name: str) -> dict[str, Any]:
    """The traits `name` was registered with, every default trait included.

    Raises:
      KeyError: `name` is not registered (the message lists the registered names).
    """
    self[name]  # pylint: disable=pointless-statement  (the listing KeyError of a bad name)
    return dict(self._traits.get(name, self.default_traits))

  def __missing__(self, name: str):
    raise KeyError(f"unknown {self.kind} {name!r}; registered: {sorted(self)}")
