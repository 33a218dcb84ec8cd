"""What the library keeps between runs in the user's cache directory, and the compile counter.

Under `user_cache_dir()` ($XDG_CACHE_HOME/agentgym_jax, default ~/.cache/agentgym_jax) live,
among others, the expert demonstrations of behaviour cloning (train/sources.py) and XLA's
executables.

A run compiles once. JAX's persistent compilation cache saves every executable XLA builds, keyed
by the program, its shardings and devices, the XLA flags and the jax version, and a later
process that compiles the same program loads it instead: a second run of a config, an
evaluation of its checkpoints, the test suite's processes; the directory may be copied or
moved (its keys do not include its path). Each command line turns it on before
anything compiles (`use_compilation_cache`, with the config's `compile.cache_dir`), and so does
tests/conftest.py for the test processes. JAX's own switch, JAX_ENABLE_COMPILATION_CACHE=false,
still turns it off everywhere. The directory may be deleted at any time; it only grows.

`CompileCounter` counts what each step still had to build, from `jax.monitoring`'s events, so a
step's metrics show a recompiling loop or a cache that stopped working.

jax is imported where it is used: the base config reads the default directory from here, and
reading a config imports no jax.
"""

from __future__ import annotations

import os
import threading

# JAX's monitoring events (jax/_src/dispatch.py, compiler.py). The first is recorded once per
# program JAX hands to XLA, around the XLA compile or, on a persistent-cache hit, the load; the
# second on each such hit, inside the first.
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_RETRIEVAL = "/jax/compilation_cache/cache_retrieval_time_sec"  # a hit's load, inside the first


def user_cache_dir(*parts: str) -> str:
  """$XDG_CACHE_HOME/agentgym_jax/<parts> (default ~/.cache/agentgym_jax/<parts>)."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
  return os.path.join(root, "agentgym_jax", *parts)


def default_compilation_cache_dir() -> str:
  """The compilation cache of a run that does not name one: JAX_COMPILATION_CACHE_DIR when it
  is set (JAX's own variable, e.g. a bucket shared by a pod's hosts), else the user's
  cache directory's jax_compile/."""
  return os.environ.get("JAX_COMPILATION_CACHE_DIR") or user_cache_dir("jax_compile")


def use_compilation_cache(directory: str) -> None:
  """Saves and loads this process's XLA executables in `directory` ("" = no cache).

  Call it before the process compiles anything: JAX opens its cache at the first compile and
  keeps that one. A local directory is created here; a URL (gs://...) is left to JAX.

  Raises:
    OSError: `directory` cannot be created.
  """
  import jax  # pylint: disable=import-outside-toplevel
  if not directory:
    jax.config.update("jax_enable_compilation_cache", False)
    return
  if "://" not in directory:
    os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  # JAX's default also points XLA's own caches (GPU autotuning results) into the directory, and
  # that path then enters every program's cache key: a copy of the cache in another directory
  # (a pod's hosts, a CI cache, the plan's output carried to the run) never hit. Without them
  # the key names the program, not where the cache lives; what GPU autotuning costs is paid
  # only when a program is compiled, never when it is loaded.
  jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
  # JAX saves only programs that took a second or more to compile; a run's many small programs
  # (each prefill and decode bucket, the scorers, the optimizer's pieces) add up to most of its
  # compile time on a CPU, so every program is saved, however small or quick.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


class _Totals:
  """This process's compile events since the listeners were installed (once per process)."""

  def __init__(self):
    self.lock = threading.Lock()
    self.count, self.cache_hits, self.seconds, self.load_seconds = 0, 0, 0.0, 0.0
    import jax  # pylint: disable=import-outside-toplevel
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)

  def _on_duration(self, event: str, duration: float, **_) -> None:
    if event == _BACKEND_COMPILE:
      with self.lock:
        self.count += 1
        self.seconds += duration
    elif event == _CACHE_RETRIEVAL:
      with self.lock:
        self.load_seconds += duration

  def _on_event(self, event: str, **_) -> None:
    if event == _CACHE_HIT:
      with self.lock:
        self.cache_hits += 1

  def read(self) -> tuple[int, int, float, float]:
    with self.lock:
      return self.count, self.cache_hits, self.seconds, self.load_seconds


_totals: _Totals | None = None
_totals_lock = threading.Lock()


class CompileCounter:
  """Counts the executables this process builds from the counter's creation on.

  JAX builds an executable the first time a jitted function runs with new shapes, dtypes or
  shardings: XLA compiles it or, with the persistent cache on, loads it from there. Tracing and
  lowering to StableHLO, which come before and which no cache saves, are not counted.
  """

  def __init__(self):
    global _totals
    with _totals_lock:
      if _totals is None:
        _totals = _Totals()
    self._totals = _totals
    self._last = self._totals.read()

  def built(self) -> int:
    """Executables built since the counter's creation (`take` does not reset it)."""
    return int(self._totals.read()[0])

  def take(self) -> dict[str, float]:
    """What was built since the last `take` (or the creation), as metrics:

      compile/count       executables built: compiled by XLA or loaded from the cache (0 once a
                          loop has seen all its shapes)
      compile/cache_hits  of these, loaded from the persistent cache
      compile/seconds     seconds spent building them (compiling or loading)
      compile/load_seconds  of these, spent loading the cache hits (reading the entry and
                          loading its executable); the rest is XLA compiling
    """
    now = self._totals.read()
    count, hits, seconds, load_seconds = (a - b for a, b in zip(now, self._last))
    self._last = now
    return {"compile/count": float(count), "compile/cache_hits": float(hits),
            "compile/seconds": float(seconds), "compile/load_seconds": float(load_seconds)}
