"""Decoder-only transformer (Qwen2/2.5, Qwen3, Llama 3.x, SmolLM2) in Flax NNX.

Weight layout is chosen for speed: every projection is a plain 2-D matmul. On XLA:CPU the
backward pass of einsums against 3-D `[D, H, Dh]` kernels costs several times the forward, and
fusing q/k/v into one kernel and gate/up into another raises training throughput (measured in
benchmarks/README.md, "Decoder weight layout"). The fused kernels are ordered so that the
output axis splits cleanly under tensor parallelism:

* `qkv`: [D, K * (G + 2) * Dh] with K = kv heads, G = query heads per kv head; for each kv head
  its G query heads, then its key, then its value. Sharding the fused axis over `tensor` keeps
  each kv group (and its cache rows) on one shard.
* `gate_up`: [D, F * 2], gate and up interleaved per hidden unit, so a shard of the fused axis
  holds matching gate and up columns.

Every parameter carries logical axis names in its `out_sharding` metadata (`vocab`, `embed`,
`qkv`, `heads`, `mlp`, `norm`, `head_dim`); `agentgym_jax.sharding` maps them to mesh axes.
The training forward runs its blocks as a `lax.scan` on accelerators and as a Python loop on
CPU, the faster and (up to 4,096-token rows) smaller one there (`ModelConfig.layer_loop`,
`resolve_layer_loop`, `_scan_blocks`); with remat, an unrolled loop recomputes each block
behind a data dependency on its backward (`remat_after_cotangent`), since XLA:CPU ignores
`jax.checkpoint` there. Parameters are one array per layer either way.

With `cfg.lora_rank` > 0 each block's four projections carry LoRA adapters (`models.lora`):
y = x @ W + (alpha / r) * (x @ A) @ B, in the training forward and the rollout's `extend` alike,
and every base parameter is read through `stop_gradient` (`_base`), so gradients reach the
adapters only. A model loaded without adapters gets them from `add_adapters`.

The full-sequence (training) forward takes its RoPE tables as host constants, normalises the
softmax after the value matmul and skips the key blocks above the causal diagonal: work outside
the big matmuls, where a profile found XLA:CPU losing time (benchmarks/README.md, Update, has
the measurements, with those of the one-pass log-prob and entropy of `rl.logprobs`).

Given `Segments` (packed rows: sequences back to back, each after the opening it shares), the
training forward takes each token's RoPE position from them and attends by their rule
(`attention.segment_attention`), so each sequence's hidden states are those it would have in a
row of its own.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentgym_jax import sharding
from agentgym_jax.models import attention as attention_lib
from agentgym_jax.models import lora as lora_lib
from agentgym_jax.models.attention import Segments
from agentgym_jax.models.cache import KVCache
from agentgym_jax.models.config import LAYER_LOOPS, ModelConfig

_ACTIVATION = ("batch", None, None)  # [B, T, D] between blocks: split over data-parallel axes


def _param(value: jax.Array, names: tuple[str | None, ...]) -> nnx.Param:
  # eager_sharding=False: the names are logical; they become mesh axes only via the rules
  # table in agentgym_jax.sharding, so creating a model needs no mesh.
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], cfg: ModelConfig) -> jax.Array:
  x = cfg.initializer_range * jax.random.normal(rngs.params(), shape, jnp.float32)
  return x.astype(cfg.dtype)


def _base(variable: nnx.Variable, cfg: ModelConfig) -> jax.Array:
  """A base (non-adapter) parameter's value: frozen (no gradient) when the model has LoRA
  adapters, so the backward computes no weight gradient the optimizer would not use."""
  value = variable[...]
  return jax.lax.stop_gradient(value) if cfg.lora_rank else value


def _dot_general(x: jax.Array, w: jax.Array, x_axis: int, w_axis: int,
                 out_dtype: jnp.dtype) -> jax.Array:
  return jax.lax.dot_general(x, w, (((x_axis,), (w_axis,)), ((), ())),
                             preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bf16_dot(rows: jax.Array, kernel: jax.Array, kernel_in: int) -> jax.Array:
  """rows [N, In] float32 times kernel ([In, Out] for kernel_in=0, [Out, In] for 1) with bf16
  operands and float32 sums -> [N, Out] float32; the backward's input gradient likewise, its
  kernel gradient in float32 (`dot`)."""
  bf16 = jnp.bfloat16
  return _dot_general(rows.astype(bf16), kernel.astype(bf16), 1, kernel_in, rows.dtype)


def _bf16_dot_forward(rows, kernel, kernel_in):
  return _bf16_dot(rows, kernel, kernel_in), (rows, kernel)


def _bf16_dot_backward(kernel_in, saved, cotangent):
  rows, kernel = saved
  d_rows = _dot_general(cotangent.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16), 1,
                        1 - kernel_in, rows.dtype)
  # A contraction over the rows: XLA:CPU runs it no faster in bf16 than in float32.
  d_kernel = (_dot_general(rows, cotangent, 0, 0, kernel.dtype) if kernel_in == 0 else
              _dot_general(cotangent, rows, 0, 0, kernel.dtype))
  return d_rows, d_kernel


_bf16_dot.defvjp(_bf16_dot_forward, _bf16_dot_backward)


def dot(x: jax.Array, kernel: jax.Array, precision: str = "float32", kernel_in: int = 0,
        out_dtype: jnp.dtype | None = None) -> jax.Array:
  """x [..., In] times kernel ([In, Out], or [Out, In] with kernel_in=1) -> [..., Out], as one
  2-D matmul over flattened rows, summed in `out_dtype` (None: x's).

  Flattening matters for the backward pass on XLA:CPU: with x kept [B, T, In], the kernel
  gradient contracts two axes and lowers to a transpose plus a slow generic dot
  (benchmarks/README.md, Model forward+backward). `precision` "bfloat16"
  (`ModelConfig.matmul_precision`) rounds float32 operands to bf16 and sums in float32, in the
  forward and in the backward's input gradient, as a TPU's default precision does; on a CPU
  with AMX those matmuls run faster than float32 ones. The kernel gradient (a contraction
  over every row) stays float32, where XLA:CPU runs it no slower than in bf16
  (benchmarks/README.md, Matmul precision).
  """
  rows = x.reshape(-1, x.shape[-1])
  if precision == "bfloat16" and x.dtype == jnp.float32 and out_dtype in (None, jnp.float32):
    out = _bf16_dot(rows, kernel, kernel_in)
  else:
    out = _dot_general(rows, kernel, 1, kernel_in, out_dtype or x.dtype)
  return out.reshape(x.shape[:-1] + kernel.shape[1 - kernel_in:][:1])


class RMSNorm(nnx.Module):
  """x / rms(x) * scale, normalised in float32 (as transformers does)."""

  def __init__(self, dim: int, eps: float, dtype: jnp.dtype, names: tuple[str, ...]):
    self.scale = _param(jnp.ones((dim,), dtype), names)
    self.eps = eps

  def __call__(self, x: jax.Array, frozen: bool = False) -> jax.Array:
    """x [..., dim] -> [..., dim] in x's dtype; `frozen`: no gradient to the scale."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
    scale = jax.lax.stop_gradient(self.scale[...]) if frozen else self.scale[...]
    return scale * h.astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions: jax.Array | np.ndarray
                ) -> tuple[jax.Array, jax.Array]:
  """cos, sin [B, T, head_dim] float32 for integer positions [B, T] (HF half-split layout).

  Numpy positions (known when tracing, as in the full forward) give numpy tables, which enter
  the jitted program as constants instead of sin/cos recomputed inside its fusions.
  """
  xp = np if isinstance(positions, np.ndarray) else jnp
  angles = positions.astype(np.float32)[..., None] * cfg.inv_freq()
  angles = xp.concatenate([angles, angles], axis=-1)
  return xp.cos(angles), xp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates x [B, T, ..., Dh] by position; cos/sin [B or 1, T, Dh] (rotate_half convention)."""
  extra = x.ndim - cos.ndim
  cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:])
  sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:])
  h = x.astype(jnp.float32)
  half = h.shape[-1] // 2
  rotated = jnp.concatenate([-h[..., half:], h[..., :half]], axis=-1)
  return (h * cos + rotated * sin).astype(x.dtype)


# The block's projections: kernel attribute -> logical axis names of its [in, out] kernel.
PROJECTIONS = {"qkv": ("embed", "qkv"), "o": ("heads", "embed"), "gate_up": ("embed", "mlp"),
               "down": ("mlp", "embed")}


class Block(nnx.Module):
  """Pre-norm decoder block: x + attn(norm(x)), then x + swiglu(norm(x)).

  `lora`: the projections' LoRA adapters (`lora.Adapters`), or None.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    fused = cfg.num_kv_heads * (cfg.group_size + 2) * dh
    self.cfg = cfg
    self.attn_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.dtype, ("norm",))
    self.qkv = _param(_normal(rngs, (d, fused), cfg), ("embed", "qkv"))
    self.qkv_bias = _param(jnp.zeros((fused,), cfg.dtype), ("qkv",)) if cfg.qkv_bias else None
    if cfg.qk_norm:
      self.q_norm = RMSNorm(dh, cfg.rms_norm_eps, cfg.dtype, ("head_dim",))
      self.k_norm = RMSNorm(dh, cfg.rms_norm_eps, cfg.dtype, ("head_dim",))
    self.o = _param(_normal(rngs, (cfg.num_heads * dh, d), cfg), ("heads", "embed"))
    self.mlp_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.dtype, ("norm",))
    self.gate_up = _param(_normal(rngs, (d, 2 * f), cfg), ("embed", "mlp"))
    self.down = _param(_normal(rngs, (f, d), cfg), ("mlp", "embed"))
    # nnx.data: a data attribute even when None, so `add_adapters` may fill it in later.
    self.lora = nnx.data(self.make_adapters(cfg, rngs) if cfg.lora_rank else None)

  def make_adapters(self, cfg: ModelConfig, rngs: nnx.Rngs) -> lora_lib.Adapters:
    """Fresh adapters of rank `cfg.lora_rank` for this block's projections (B = 0)."""
    kernels = {name: (getattr(self, name).shape, names) for name, names in PROJECTIONS.items()}
    return lora_lib.Adapters(kernels, cfg.lora_rank, rngs=rngs)

  def _project(self, x: jax.Array, name: str) -> jax.Array:
    """x [..., In] through projection `name`: x @ W, plus (alpha / r) * (x @ A) @ B with
    adapters (A, B in x's dtype, as the mixed-precision forward casts every parameter)."""
    precision = self.cfg.matmul_precision
    out = dot(x, _base(getattr(self, name), self.cfg), precision)
    if self.lora is None:
      return out
    adapter = getattr(self.lora, name)
    low_rank = dot(dot(x, adapter.lora_a[...].astype(x.dtype), precision),
                   adapter.lora_b[...].astype(x.dtype), precision)
    return out + (self.cfg.lora_scale * low_rank).astype(out.dtype)

  def project_qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] -> q [B, T, K, G, Dh], k [B, T, K, Dh], v [B, T, K, Dh] (RoPE applied)."""
    cfg = self.cfg
    b, t, _ = x.shape
    frozen = cfg.lora_rank > 0
    h = self._project(self.attn_norm(x, frozen), "qkv")
    if self.qkv_bias is not None:
      h = h + _base(self.qkv_bias, cfg)
    h = h.reshape(b, t, cfg.num_kv_heads, cfg.group_size + 2, cfg.head_dim)
    q, k, v = h[:, :, :, :-2], h[:, :, :, -2], h[:, :, :, -1]
    if cfg.qk_norm:
      q, k = self.q_norm(q, frozen), self.k_norm(k, frozen)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

  def finish(self, x: jax.Array, attn_out: jax.Array) -> jax.Array:
    """Output projection, residual and MLP. x [B, T, D], attn_out [B, T, H * Dh]."""
    x = x + self._project(attn_out, "o")
    h = self._project(self.mlp_norm(x, self.cfg.lora_rank > 0), "gate_up")
    h = h.reshape(h.shape[:-1] + (self.cfg.intermediate_size, 2))
    h = jax.nn.silu(h[..., 0]) * h[..., 1]
    return x + self._project(h, "down")

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, valid: jax.Array,
               segments: Segments | None = None) -> jax.Array:
    """Self-attention over the chunk itself: x [B, T, D], valid [B, T] -> [B, T, D]; causal,
    or by `Segments`'s rule when given (cos, sin then at segments.positions)."""
    q, k, v = self.project_qkv(x, cos, sin)
    if segments is None:
      out = attention_lib.self_attention(q, k, v, valid, self.cfg.attention)
    else:
      out = attention_lib.segment_attention(q, k, v, valid, segments, self.cfg.attention)
    return self.finish(x, out)


def resolve_layer_loop(loop: str, platform: str | None = None) -> str:
  """`ModelConfig.layer_loop` on `platform` (None: `jax.default_backend()`): "auto" scans the
  blocks on accelerators and unrolls them on CPU.

  On TPU an unrolled loop of FSDP blocks lets XLA gather many layers' weights at once; a scan
  holds one layer's. On CPU the unrolled loop is faster and, with remat
  (`remat_after_cotangent`), smaller up to rows of 4,096 tokens: the scan copies the blocks'
  weights into one stacked array and their gradients out of one (benchmarks/README.md,
  Memory)."""
  if loop not in LAYER_LOOPS:
    raise ValueError(f"layer_loop {loop!r} is not one of {LAYER_LOOPS}.")
  if loop != "auto":
    return loop
  return "unroll" if (platform or jax.default_backend()) == "cpu" else "scan"


def _zero_cotangent(x: jax.Array) -> jax.Array:
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


def remat_after_cotangent(layer):
  """`layer(block, x)` that keeps only its input x for the backward pass and recomputes the
  rest there, once the cotangent of its output exists.

  The remat of an unrolled loop of blocks on XLA:CPU: `jax.checkpoint`'s recomputation has
  no data dependency on the backward, and XLA:CPU, which drops `lax.optimization_barrier`,
  merges it with the forward's identical computation (CSE) or runs it early, so every block's
  activations stay live (no saving at all, benchmarks/README.md, Memory). Here the
  recomputation reads its inputs through `attention.after(cotangent)`, and the input's
  gradient comes out through `attention.after(the parameters' gradients)`: each block's
  backward, recomputation included, runs whole between its neighbours', holding one block's
  activations. In a scan
  the loop already orders the blocks, and `nnx.remat` does (`Backbone.__call__`).
  """
  def apply(block, x):
    graphdef, params = nnx.split(block)
    # Values the layer closes over (the valid mask) become explicit inputs: a custom_vjp's
    # backward is traced on its own and cannot read another trace's values.
    run, consts = jax.closure_convert(lambda p, x: layer(nnx.merge(graphdef, p), x), params, x)

    @jax.custom_vjp
    def remat(p, x, consts):
      return run(p, x, *consts)

    def forward(p, x, consts):
      return run(p, x, *consts), (p, x, consts)

    def backward(saved, cotangent):
      p, x, consts = saved
      # The parameters too, not the input alone: with x alone an 8,192-token row of SmolLM2's
      # update measured 3.51 GiB of temporaries instead of 2.78.
      p, x = attention_lib.after(cotangent, (p, x))
      grads = jax.vjp(lambda p, x: run(p, x, *consts), p, x)[1](cotangent)
      # The input's gradient waits for the parameters' too: the previous block's backward
      # then cannot start before this block's weight-gradient matmuls are done.
      dp, dx = grads
      dx = attention_lib.after(dp, dx)
      return (dp, dx, jax.tree.map(_zero_cotangent, consts))

    remat.defvjp(forward, backward)
    return remat(params, x, consts)
  return apply


def _scan_blocks(layer, blocks: list[Block], x: jax.Array) -> jax.Array:
  """x through `layer(block, x)` for every block in turn, as one `lax.scan` over the blocks'
  parameters stacked on a leading axis.

  On TPU an unrolled loop of FSDP blocks let XLA gather many layers' weights at once (the
  update's memory grew with every layer, docs/tpu.md); a scan holds one layer's at a time.
  The stacked copy of the (sharded) parameters is made inside the program, so checkpoints and
  the rollout keep one array per layer.
  """
  graphdef, _ = nnx.split(blocks[0])
  stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *[nnx.split(b)[1] for b in blocks])

  def body(x, params):
    return layer(nnx.merge(graphdef, params), x), None

  return jax.lax.scan(body, x, stacked)[0]


@functools.partial(jax.jit, static_argnums=0)
def _extend_block(graphdef: nnx.GraphDef, params: nnx.State, x: jax.Array, cos: jax.Array,
                  sin: jax.Array, cache: KVCache) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One block of `Backbone.extend`: x [B, T, D] at RoPE tables cos, sin [B, T, Dh] through
  the block `graphdef`/`params`, its keys and values written into the one-layer `cache` at
  slots cache.lengths[b] + t. Returns x and the layer's new key and value buffers.

  Jitted so that the blocks of an unrolled model, alike in structure and shapes, share one
  trace and one lowering (the program still inlines the call once per block): building an
  extend or decode program of a 30-block model then traces one block instead of 30, which
  is most of the time a rollout spends rebuilding programs dropped to keep its memory
  (`freed_memory.ProgramBudget`)."""
  block = nnx.merge(graphdef, params)
  starts = cache.lengths
  q, k, v = block.project_qkv(x, cos, sin)
  k_buf, v_buf = cache.write(0, k, v, starts)
  out = attention_lib.cache_attention(q, *cache.attention_view(k_buf, v_buf, q), starts,
                                      block.cfg.attention)
  return sharding.constrain(block.finish(x, out), _ACTIVATION), k_buf, v_buf


class Backbone(nnx.Module):
  """Embedding, decoder blocks and final norm (shared by the policy and the value model)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), cfg),
                        ("vocab", "embed"))
    self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, ("norm",))

  def _embed(self, tokens: jax.Array) -> jax.Array:
    # mode="clip": an out-of-range pad id must not turn into NaN, which would leak through
    # 0 * NaN into the attention of valid tokens.
    return jnp.take(_base(self.embed, self.cfg), tokens, axis=0, mode="clip")

  def __call__(self, tokens: jax.Array, valid: jax.Array, segments: Segments | None = None
               ) -> jax.Array:
    """tokens [B, T] int32, valid [B, T] bool -> final-normed hidden states [B, T, D].

    Token t sits at position t; it attends to keys s <= t with valid[b, s]. With `segments`
    (packed rows) it sits at segments.positions[b, t] and attends by `Segments`'s rule.
    """
    t = tokens.shape[1]
    if segments is None:
      # Static positions 0..T-1: RoPE tables become constants, not sin/cos inside the fusions.
      cos, sin = rope_tables(self.cfg, np.arange(t, dtype=np.int32)[None])  # [1, T, Dh]
    else:
      cos, sin = rope_tables(self.cfg, segments.positions)  # [B, T, Dh]
    valid = valid.astype(bool)

    def layer(block: Block, x: jax.Array) -> jax.Array:
      return sharding.constrain(block(x, cos, sin, valid, segments), _ACTIVATION)

    x = sharding.constrain(self._embed(tokens), _ACTIVATION)
    if resolve_layer_loop(self.cfg.layer_loop) == "scan":
      x = _scan_blocks(nnx.remat(layer) if self.cfg.remat else layer, list(self.layers), x)
    else:
      layer = remat_after_cotangent(layer) if self.cfg.remat else layer
      for block in self.layers:
        x = layer(block, x)
    return self.final_norm(x, self.cfg.lora_rank > 0)

  def extend(self, tokens: jax.Array, num_new: jax.Array, cache: KVCache
             ) -> tuple[jax.Array, KVCache]:
    """Appends a right-padded chunk to each row of the cache (see `Decoder.extend`).

    Returns hidden states [B, T, D] and the updated cache.
    """
    t = tokens.shape[1]
    starts = cache.lengths
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    cos, sin = rope_tables(self.cfg, positions)
    x = sharding.constrain(self._embed(tokens), _ACTIVATION)
    ks, vs = [], []
    for i, block in enumerate(self.layers):
      graphdef, params = nnx.split(block)
      layer_cache = cache.replace(k=(cache.k[i],), v=(cache.v[i],))
      x, k_buf, v_buf = _extend_block(graphdef, params, x, cos, sin, layer_cache)
      ks.append(k_buf)
      vs.append(v_buf)
    lengths = starts + num_new.astype(jnp.int32)
    cache = KVCache(k=tuple(ks), v=tuple(vs), lengths=lengths, live=cache.live)
    return self.final_norm(x, self.cfg.lora_rank > 0), cache


class Decoder(nnx.Module):
  """Causal language model: `Backbone` plus a tied or separate LM head.

  Attributes:
    cfg: the ModelConfig.
    backbone: embedding + blocks + final norm.
    lm_head: [D, V] kernel, or None when tied to the embedding.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.backbone = Backbone(cfg, rngs=rngs)
    self.lm_head = (None if cfg.tie_embeddings else
                    _param(_normal(rngs, (cfg.hidden_size, cfg.vocab_size), cfg),
                           ("embed", "vocab")))

  def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
    """hidden [B, T, D] -> logits [B, T, V] float32 (accumulated in float32)."""
    precision = self.cfg.matmul_precision
    if self.lm_head is None:
      return dot(hidden, _base(self.backbone.embed, self.cfg), precision, kernel_in=1,
                 out_dtype=jnp.float32)
    return dot(hidden, _base(self.lm_head, self.cfg), precision, out_dtype=jnp.float32)

  def __call__(self, tokens: jax.Array, valid: jax.Array, segments: Segments | None = None
               ) -> jax.Array:
    """Full forward over right-padded rows: tokens [B, T], valid [B, T] -> [B, T, V] float32.

    Token t has position t and attends to keys s <= t that are valid; with `segments` (packed
    rows) it has position segments.positions[b, t] and attends by `Segments`'s rule.
    """
    return self.logits_from_hidden(self.backbone(tokens, valid, segments))

  def extend(self, tokens: jax.Array, num_new: jax.Array, cache: KVCache
             ) -> tuple[jax.Array, KVCache]:
    """Appends a chunk to every row of the cache and returns its logits.

    Args:
      tokens: [B, T] int32, right-padded chunk.
      num_new: [B] int32 in 0..T, how many of row b's tokens are real (0: row stays put).
      cache: KVCache; row b's tokens go to slots lengths[b] .. lengths[b] + T - 1 with RoPE
        positions lengths[b] + t and attend to slots < lengths[b] + t + 1. Slots past the
        cache end are dropped.

    Returns:
      logits [B, T, V] float32 and the cache with lengths += num_new (padded tail slots are
      overwritten by the next chunk). Prefill is extend on an empty cache, decode is T = 1.
    """
    hidden, cache = self.backbone.extend(tokens, num_new, cache)
    return self.logits_from_hidden(hidden), cache


def replace_config(model: nnx.Module, cfg: ModelConfig) -> nnx.Module:
  """Sets `cfg` (static) on every submodule of `model` holding the model config."""
  for _, module in nnx.iter_modules(model):
    if hasattr(module, "cfg"):
      module.cfg = cfg
  return model


def add_adapters(model: Decoder, rank: int, alpha: float, *, seed: int,
                 mesh: jax.sharding.Mesh) -> Decoder:
  """`model` (built or loaded without adapters) with fresh LoRA adapters of rank `rank` on
  every block (B = 0: the same function), created sharded on `mesh`, in place."""
  if model.cfg.lora_rank:
    raise ValueError(f"The model already has rank-{model.cfg.lora_rank} LoRA adapters.")
  cfg = dataclasses.replace(model.cfg, lora_rank=rank, lora_alpha=alpha)
  for i, block in enumerate(model.backbone.layers):
    block.lora = sharding.sharded_init(
        lambda block=block, i=i: block.make_adapters(cfg, nnx.Rngs(seed + i)), mesh)
  return replace_config(model, cfg)


def merge_adapters(model: Decoder) -> Decoder:
  """`model` with every block's LoRA adapters folded into its kernels, W + (alpha / r) A B in
  W's dtype and sharding, and then removed: the adapted function as a plain model, in place
  (a LoRA run's policy as another run's start, `policies` init_from)."""
  if not model.cfg.lora_rank:
    return model
  for block in model.backbone.layers:
    for name in PROJECTIONS:
      kernel = getattr(block, name)
      merged = lora_lib.merged_kernel(kernel[...], getattr(block.lora, name),
                                      model.cfg.lora_scale)
      kernel[...] = jax.device_put(merged, kernel[...].sharding)
    block.lora = None
  return replace_config(model, dataclasses.replace(model.cfg, lora_rank=0))
