"""Runs a command and samples its resident memory every few seconds until it ends.

    python benchmarks/sample_rss.py --every 5 --out /tmp/rss.tsv -- \
        python -m agentgym_jax.train --config=... --workdir=...

Each sample is VmRSS (/proc/PID/status) of the command's process and, apart, the sum over its
descendants (environment workers, a JVM): one TSV line `seconds  main_MiB  children_MiB`. The
command's own output passes through; the last lines give the peaks and the load average at the
start and end, and the exit status is the command's.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time

import loadavg  # benchmarks/loadavg.py: a script's folder is on sys.path


def vm_rss_mib(pid: int) -> float:
  """VmRSS of `pid` in MiB (0 once it is gone)."""
  with contextlib.suppress(FileNotFoundError, ProcessLookupError), \
      open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return 0.0


def descendants(pid: int) -> list[int]:
  """Every process below `pid` (children, their children, ...)."""
  found, frontier = [], [pid]
  while frontier:
    parent = frontier.pop()
    try:
      with open(f"/proc/{parent}/task/{parent}/children") as f:
        kids = [int(k) for k in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
      kids = []
    found += kids
    frontier += kids
  return found


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
  parser.add_argument("--out", required=True, help="TSV of the samples")
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args()
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the command to run after --")
  loadavg.report("start")
  start = time.time()
  proc = subprocess.Popen(command)
  peak_main = peak_children = 0.0
  with open(args.out, "w") as out:
    out.write("seconds\tmain_MiB\tchildren_MiB\n")
    while proc.poll() is None:
      main_mib = vm_rss_mib(proc.pid)
      children_mib = sum(vm_rss_mib(p) for p in descendants(proc.pid))
      peak_main, peak_children = max(peak_main, main_mib), max(peak_children, children_mib)
      out.write(f"{time.time() - start:.1f}\t{main_mib:.0f}\t{children_mib:.0f}\n")
      out.flush()
      with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=args.every)
  loadavg.report("end")
  print(f"wall {time.time() - start:.0f} s; peak RSS: main {peak_main:.0f} MiB, children "
        f"{peak_children:.0f} MiB (samples every {args.every:g} s in {args.out})", flush=True)
  return proc.returncode


if __name__ == "__main__":
  sys.exit(main())
