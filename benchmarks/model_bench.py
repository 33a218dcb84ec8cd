"""Forward+backward throughput of our Decoder vs the same model in transformers (PyTorch, CPU).

For each size, one model is created in JAX, exported with `save_hf` and loaded by
transformers, so both frameworks run the same architecture and weights on the same right-padded
batch (masked next-token cross-entropy, gradients w.r.t. all parameters, no optimizer step).
Rounds alternate between the two so that load from other processes hits both alike; the median
round counts. Also reports each side's FLOP/s as a fraction of its own framework's f32 matmul
peak measured in the same round, and the page faults and system time of each side's steps.

    .venv/bin/python benchmarks/model_bench.py [--sizes 3M,30M] [--rounds 5] [--steps 3]
        [--keep_freed_memory]

Last line: `ratio: <jax tok/s / torch tok/s>` (the smaller over the sizes).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentgym_jax.models import Decoder, ModelConfig, save_hf
import loadavg  # benchmarks/loadavg.py: a script's folder is on sys.path
import host_memory  # benchmarks/host_memory.py
from faults import Faults  # benchmarks/faults.py
from flops import matmul_peak, torch_matmul_peak, train_flops_per_step  # benchmarks/flops.py

SIZES = {
    # ~3.4M parameters, batch 16 x 256.
    "3M": (ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_layers=4,
                       num_heads=4, num_kv_heads=2, tie_embeddings=True, model_type="llama"),
           16, 256),
    # ~29M parameters, batch 8 x 256.
    "30M": (ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536,
                        num_layers=8, num_heads=8, num_kv_heads=4, tie_embeddings=True,
                        model_type="llama"),
            8, 256),
}


def make_batch(cfg: ModelConfig, batch: int, length: int):
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, cfg.vocab_size, (batch, length)).astype(np.int32)
  lengths = rng.randint(length // 2, length + 1, batch)
  valid = np.arange(length)[None] < lengths[:, None]
  return tokens, valid


def jax_step(model: Decoder):
  """Returns (state, jitted fn(state, tokens, valid) -> (loss, grads))."""
  graphdef, state = nnx.split(model)

  def loss_fn(state, tokens, valid):
    logits = nnx.merge(graphdef, state)(tokens, valid)
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    mask = valid[:, 1:]
    return jnp.sum(nll * mask) / jnp.sum(mask)

  return state, jax.jit(jax.value_and_grad(loss_fn))


def torch_step(model, torch):
  def step(tokens, valid):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=tokens, attention_mask=valid).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, tokens[:, 1:, None])[..., 0]
    mask = valid[:, 1:].float()
    loss = (nll * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach()
  return step


def bench_size(name: str, rounds: int, steps: int, peak, torch_peak, remat: bool) -> float:
  import torch
  import transformers

  transformers.utils.logging.disable_progress_bar()

  cfg, batch, length = SIZES[name]
  cfg = dataclasses.replace(cfg, remat=remat)
  model = nnx.jit(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))()
  with tempfile.TemporaryDirectory() as tmp:
    save_hf(model, tmp)
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(tmp).train()
  tokens, valid = make_batch(cfg, batch, length)
  state, jstep = jax_step(model)
  jt, jv = jnp.asarray(tokens), jnp.asarray(valid)
  tt, tv = torch.tensor(tokens, dtype=torch.long), torch.tensor(valid, dtype=torch.long)
  tstep = torch_step(torch_model, torch)

  jax_loss = float(jax.block_until_ready(jstep(state, jt, jv))[0])  # compile + warm up
  torch_loss = float(tstep(tt, tv))
  if abs(jax_loss - torch_loss) > 1e-3:
    raise RuntimeError(f"losses differ: jax {jax_loss} vs torch {torch_loss}")

  tokens_per_step = batch * length
  flops_per_step = train_flops_per_step(cfg, batch, length)
  jax_rates, torch_rates, fractions, torch_fractions = [], [], [], []
  jax_faults, torch_faults = Faults(), Faults()
  for _ in range(rounds):
    # The peaks are re-measured every round: other jobs on the machine move them a lot.
    round_peak, round_torch_peak = peak(), torch_peak()
    jax_faults.measure(lambda: [jax.block_until_ready(jstep(state, jt, jv))
                                for _ in range(steps)])
    seconds = jax_faults.seconds[-1]
    jax_rates.append(steps * tokens_per_step / seconds)
    fractions.append(steps * flops_per_step / seconds / round_peak)
    torch_faults.measure(lambda: [tstep(tt, tv) for _ in range(steps)])
    seconds = torch_faults.seconds[-1]
    torch_rates.append(steps * tokens_per_step / seconds)
    torch_fractions.append(steps * flops_per_step / seconds / round_torch_peak)
  jax_rate, torch_rate = statistics.median(jax_rates), statistics.median(torch_rates)
  flops = flops_per_step * jax_rate / tokens_per_step
  print(f"{name}: {cfg.num_params / 1e6:.1f}M params, batch {batch}x{length}, remat={remat}")
  print(f"  jax   fwd+bwd tok/s median {jax_rate:9.0f}  (rounds {min(jax_rates):.0f}-"
        f"{max(jax_rates):.0f})")
  print(f"  torch fwd+bwd tok/s median {torch_rate:9.0f}  (rounds {min(torch_rates):.0f}-"
        f"{max(torch_rates):.0f})")
  print(f"  jax/torch {jax_rate / torch_rate:.2f}; jax {flops / 1e9:.0f} GFLOP/s, "
        f"{statistics.median(fractions):.0%} of jax's matmul peak measured in the same round "
        f"(rounds {min(fractions):.0%}-{max(fractions):.0%}); torch "
        f"{statistics.median(torch_fractions):.0%} of torch's own peak")
  unit = f"round of {steps} steps"
  print(f"  jax {jax_faults.summary(unit)}; torch {torch_faults.summary(unit)}", flush=True)
  return jax_rate / torch_rate


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="3M,30M")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--remat", action="store_true", help="recompute blocks in backward")
  host_memory.add_option(parser)
  args = parser.parse_args()
  kept = args.keep_freed_memory and host_memory.keep_freed_memory()
  loadavg.report("start", malloc_kept=kept)
  peak, torch_peak = matmul_peak(), torch_matmul_peak()
  print(f"f32 matmul peak (2048^3) now: jax {peak() / 1e9:.0f} GFLOP/s, torch "
        f"{torch_peak() / 1e9:.0f}; devices: {jax.devices()[0].platform} x {jax.device_count()}",
        flush=True)
  ratios = [bench_size(n, args.rounds, args.steps, peak, torch_peak, args.remat)
            for n in args.sizes.split(",")]
  loadavg.report("end")
  print(f"ratio: {min(ratios):.2f}")


if __name__ == "__main__":
  main()
