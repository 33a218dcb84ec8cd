"""PPO policy update: our jitted, donated update step vs the same update in PyTorch eager.

Both sides train the same Llama-architecture decoder from the same weights (ours written with
`save_hf`, loaded by transformers' LlamaForCausalLM) on the same batch with the same loss:

  token-mean over agent tokens of  ppo_clip(ε = 0.2) + 0.001 · k3 KL to a reference
                                   - 0.001 · entropy
  then global-norm clip 1.0 and AdamW (lr 1e-5, betas 0.9/0.999, eps 1e-8, weight decay 0.01).

Ours is `agentgym_jax.train.update.make_update_step` (one epoch, one minibatch, the micro-batch
count of --micro); the reference is the forward, log-softmax gather, entropy, clipped surrogate,
backward, `clip_grad_norm_` and `torch.optim.AdamW.step` written out in torch, as verl's actor
does it (eager, float32). Before timing, the first step's loss of both must agree.

  python benchmarks/update_bench.py [--rows 8] [--length 512] [--repeats 5] [--keep_freed_memory]

Throughput counts every token of the [rows, length] batch per update; also printed: both as a
fraction of its own framework's f32 matmul peak measured in the same run (benchmarks/flops.py),
and the page faults and system time of a step (benchmarks/faults.py). Last line:
`ratio: <ours tokens/s / torch tokens/s>`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import jax
import numpy as np
import torch
import transformers
from flax import nnx

from agentgym_jax import sharding
from agentgym_jax.models import Decoder, ModelConfig, save_hf
from agentgym_jax.train import config as base
from agentgym_jax.train import state as state_lib
from agentgym_jax.train import update as update_lib
import loadavg  # benchmarks/loadavg.py: a script's folder is on sys.path
import host_memory  # benchmarks/host_memory.py
from faults import Faults  # benchmarks/faults.py
from flops import matmul_peak, torch_matmul_peak, train_flops_per_step  # benchmarks/flops.py

KL_COEF, ENTROPY_COEF, CLIP, LR = 1e-3, 1e-3, 0.2, 1e-5


def make_batch(rows: int, length: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Right-padded multi-turn rows: prompt, agent turns and observations, ~40% agent tokens."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (rows, length)).astype(np.int32)
  valid = np.zeros((rows, length), bool)
  mask = np.zeros((rows, length), bool)
  for r in range(rows):
    end = length - int(rng.integers(0, length // 8))
    valid[r, :end] = True
    t = int(rng.integers(16, 64))
    while t < end:
      n = int(rng.integers(8, 48))
      mask[r, t:min(t + n, end)] = True
      t += n + int(rng.integers(8, 64))
  adv = rng.normal(size=(rows, length)).astype(np.float32) * mask
  return {"tokens": tokens, "valid": valid, "loss_mask": mask, "advantages": adv}


def jax_setup(cfg: ModelConfig, batch: dict, micro: int):
  """Our update step, a fresh state, and the batch with old/ref log-probs scored by ours."""
  config = base.base_config()
  config.algo.kl_coef, config.algo.entropy_coef = KL_COEF, ENTROPY_COEF
  config.algo.clip_low = config.algo.clip_high = CLIP
  config.algo.minibatches, config.algo.microbatches = 1, micro
  config.optim.lr, config.optim.weight_decay, config.optim.grad_clip = LR, 0.01, 1.0
  mesh = sharding.make_mesh((("data", -1), ("fsdp", 1), ("tensor", 1)))
  model = sharding.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh)
  opts = state_lib.Optimizers.from_config(config, with_critic=False)
  graphdef, params = state_lib.split_params(model)
  shardings = state_lib.train_state_shardings(
      policy_shardings=state_lib.param_shardings(model, mesh), critic_shardings=None,
      keep_reference=True, optimizers=opts, policy=params, critic=None, mesh=mesh)
  state = state_lib.init_train_state(policy=params, critic=None, keep_reference=True,
                                     optimizers=opts, seed=0, shardings=shardings)
  ucfg = update_lib.UpdateConfig.from_config(config)
  step = update_lib.make_update_step(graphdef, None, opts, ucfg, mesh, shardings)
  logprobs, _ = update_lib.make_scorers(graphdef, None, ucfg, mesh)
  device_batch = sharding.shard_batch(batch, mesh)
  old = logprobs(state.policy, {"tokens": device_batch["tokens"], "valid": device_batch["valid"]})
  device_batch.update(old_logprobs=old, ref_logprobs=old, rollout_logprobs=old)
  return model, step, state, device_batch


def torch_policy_loss(model, tokens, valid, mask, adv, old, ref):
  """The same loss as `update.policy_loss` (token-mean), written as verl's actor computes it."""
  logits = model(input_ids=tokens, attention_mask=valid.long()).logits[:, :-1].float()
  log_p = torch.log_softmax(logits, dim=-1)
  logp = torch.gather(log_p, -1, tokens[:, 1:, None])[..., 0]
  entropy = -(log_p.exp() * log_p).sum(-1)
  m, a, o, r = mask[:, 1:].float(), adv[:, 1:], old[:, 1:], ref[:, 1:]
  log_ratio = torch.clamp(logp - o, -20.0, 20.0)
  ratio = torch.exp(log_ratio)
  pg = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1.0 - CLIP, 1.0 + CLIP))
  d = torch.clamp(r - logp, -20.0, 20.0)
  kl = torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)
  token_loss = pg + KL_COEF * kl - ENTROPY_COEF * entropy
  return (token_loss * m).sum() / m.sum().clamp(min=1.0)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--length", type=int, default=512)
  parser.add_argument("--micro", type=int, default=1, help="micro-batches of our update")
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--vocab", type=int, default=4096)
  parser.add_argument("--repeats", type=int, default=5)
  host_memory.add_option(parser)
  args = parser.parse_args()
  kept = args.keep_freed_memory and host_memory.keep_freed_memory()
  loadavg.report("start", malloc_kept=kept)
  if args.rows % jax.device_count():
    parser.error(f"--rows {args.rows} must be a multiple of the {jax.device_count()} JAX "
                 "devices: the batch is split over them.")

  cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                    intermediate_size=args.hidden * 11 // 4, num_layers=args.layers,
                    num_heads=8, num_kv_heads=4, tie_embeddings=True, model_type="llama")
  batch = make_batch(args.rows, args.length, args.vocab)
  model, step, state, device_batch = jax_setup(cfg, batch, args.micro)
  with tempfile.TemporaryDirectory() as tmp:
    save_hf(model, tmp)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
  ref_model.train()
  optimizer = torch.optim.AdamW(ref_model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.01)
  t = {k: torch.from_numpy(np.asarray(v)) for k, v in batch.items()}
  old = torch.from_numpy(np.array(device_batch["old_logprobs"]))
  tokens_per_step = args.rows * args.length

  def torch_step():
    loss = torch_policy_loss(ref_model, t["tokens"].long(), t["valid"], t["loss_mask"],
                             t["advantages"], old, old)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())

  # Parity of the first step: the same loss from the same weights and batch.
  state, metrics = step(state, device_batch)
  ours_loss = float(metrics["actor/loss"])
  torch_loss = torch_step()
  print(f"first-step loss: ours {ours_loss:.6f}, torch {torch_loss:.6f}")
  if abs(ours_loss - torch_loss) > 1e-4 * max(1.0, abs(torch_loss)):
    raise SystemExit("The two updates compute different losses; the comparison is void.")

  ours, ref = Faults(), Faults()
  for _ in range(args.repeats):
    state, metrics = ours.measure(lambda: jax.block_until_ready(step(state, device_batch)))
    ref.measure(torch_step)
  ours_s, ref_s = statistics.median(ours.seconds), statistics.median(ref.seconds)
  # Measured after the timed steps, in the same run.
  peak, torch_peak = matmul_peak()(), torch_matmul_peak()()
  print(f"model: {cfg.num_params / 1e6:.2f}M params (hidden {cfg.hidden_size}, {cfg.num_layers} "
        f"layers, vocab {cfg.vocab_size}); batch {args.rows} x {args.length} tokens, "
        f"{int(batch['loss_mask'].sum())} agent tokens; micro-batches {args.micro}; "
        f"torch threads {torch.get_num_threads()}, jax devices {jax.device_count()}")
  print(f"torch eager: {ref_s * 1e3:.1f} ms/update, {tokens_per_step / ref_s:.0f} tokens/s; "
        f"{ref.summary('update')}")
  print(f"ours (jit):  {ours_s * 1e3:.1f} ms/update, {tokens_per_step / ours_s:.0f} tokens/s; "
        f"{ours.summary('update')}")
  # Forward and backward of the policy; the optimizer's elementwise work is not counted.
  flops = train_flops_per_step(cfg, args.rows, args.length)
  print(f"f32 matmul peak (2048^3, measured in this run): jax {peak / 1e9:.0f} GFLOP/s, torch "
        f"{torch_peak / 1e9:.0f}")
  print(f"ours: {flops / ours_s / 1e9:.1f} GFLOP/s, {flops / ours_s / peak:.0%} of jax's peak; "
        f"torch {flops / ref_s / 1e9:.1f} GFLOP/s, {flops / ref_s / torch_peak:.0%} of torch's")
  loadavg.report("end")
  print(f"ratio: {ref_s / ours_s:.2f}")


if __name__ == "__main__":
  main()
