"""Every benchmark script runs end to end on a tiny workload and ends with its result line.

The numbers of such small runs mean nothing; what is tested is that the scripts, the README's
commands, still work: both contestants run, agree where the script checks agreement, the
load average is reported before the run and again just before the last line, which is
`ratio: <value>` (`peak RSS: <value> MiB` for the memory benchmark).
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATIO = r"ratio: (\d+\.\d+)"
LOAD = r"load average at (start|end): (\d+\.\d+) \d+\.\d+ \d+\.\d+ \(1, 5, 15 min\) on (\d+) CPUs"

CASES = [
    pytest.param("gae_bench.py", ["--batch", "4", "--length", "512", "--repeats", "2",
                                  "--ref-repeats", "1"], RATIO, id="gae"),
    pytest.param("update_bench.py", ["--rows", "8", "--length", "64", "--hidden", "32",
                                     "--layers", "1", "--vocab", "256", "--repeats", "1",
                                     "--keep_freed_memory"],
                 RATIO, id="update"),
    pytest.param("packed_attention_bench.py", ["--opening", "40", "--row", "128",
                                               "--continuations", "30,20", "--blocks", "16,64",
                                               "--repeats", "1"], RATIO, id="packed-attention"),
    pytest.param("packing_bench.py", ["--config", "experiments/keypad/learn.py:runlocal",
                                      "--opening", "24", "--continuations", "8,16,30,40",
                                      "--repeats", "1"], RATIO, id="packing"),
    pytest.param("rollout_bench.py", ["--episodes", "4", "--turns", "2", "--reply", "4",
                                      "--repeats", "1", "--group_size", "2"], RATIO,
                 id="rollout", marks=pytest.mark.slow),
    pytest.param("decode_bench.py", ["--model", "d64", "--rows", "4", "--prompt", "32",
                                     "--new", "4", "--repeats", "1"], RATIO, id="decode",
                 marks=pytest.mark.slow),
    # Without SciWorld there is no 2-worker SciWorld ratio to report: the line says nan.
    pytest.param("env_bench.py", ["--envs", "babyai,textcraft", "--num-envs", "4",
                                  "--workers", "1,2"], r"ratio: nan", id="env"),
    pytest.param("model_bench.py", ["--sizes", "3M", "--rounds", "1", "--steps", "1"], RATIO,
                 id="model", marks=pytest.mark.slow),
    pytest.param("env_bench.py", ["--envs", "sciworld", "--num-envs", "2", "--workers", "2",
                                  "--sciworld-warmup", "1"], RATIO, id="env-sciworld",
                 marks=pytest.mark.slow),
    pytest.param("sciworld_step.py", [], RATIO, id="sciworld-step", marks=pytest.mark.slow),
    pytest.param("matmul_precision.py", ["--tokens", "64", "--repeats", "1"], RATIO,
                 id="matmul-precision"),
    pytest.param("program_memory.py", ["--model", "d64", "--rows", "2", "--widths", "8,16"],
                 RATIO, id="program-memory"),
    pytest.param("program_heap.py", ["--model", "d64", "--rows", "2", "--width", "16"], RATIO,
                 id="program-heap"),
    pytest.param("memory_bench.py", ["--config", "experiments/keypad/learn.py:runlocal",
                                     "--lengths", "64,128", "--time_lengths", "64",
                                     "--choices",
                                     "blockwise/scan/remat,blockwise/unroll/remat/bf16",
                                     "--heads", "agent", "--repeats", "1"], RATIO, id="memory"),
    # Four processes: a compile and a load for each layer loop.
    pytest.param("compile_bench.py", ["--config", "experiments/keypad/learn.py:runlocal",
                                      "--length", "64", "--repeats", "1"], RATIO,
                 id="compile"),
    pytest.param("run_memory_bench.py", [], r"peak RSS: \d+ MiB", id="run-memory",
                 marks=pytest.mark.slow),
    # Four short training runs (a warm-up and a timed run of each mode).
    pytest.param("async_bench.py", ["--steps", "2", "--env_latency", "0.01"], RATIO,
                 id="async", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("script,args,last_line", CASES)
def test_benchmark_runs(script, args, last_line):
  result = subprocess.run([sys.executable, os.path.join("benchmarks", script), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.strip().splitlines()
  assert lines and re.fullmatch(last_line, lines[-1]), result.stdout[-3000:]
  # The load average before the run and right before the result line, each followed by a
  # warning exactly when its 1-minute figure is above one per CPU.
  reports = [(i, m) for i, m in enumerate(re.fullmatch(LOAD, line) for line in lines) if m]
  assert [m[1] for _, m in reports] == ["start", "end"], result.stdout[-3000:]
  warned = [lines[i + 1].startswith("WARNING: load") for i, _ in reports]
  assert warned == [float(m[2]) > int(m[3]) for _, m in reports], result.stdout[-3000:]
  assert reports[1][0] + 1 + warned[1] == len(lines) - 1, result.stdout[-3000:]


def test_sample_rss_sees_a_commands_memory(tmp_path):
  """A child that holds 200 MiB for two seconds: sampled every 0.2 s, its peak is seen, every
  sample is a TSV line, and the command's exit status is passed on."""
  child = "import sys, time; x = bytearray(200 << 20); x[::4096] = b'1' * len(x[::4096]); " \
          "time.sleep(2); sys.exit(3)"
  out = tmp_path / "rss.tsv"
  result = subprocess.run(
      [sys.executable, os.path.join("benchmarks", "sample_rss.py"), "--every", "0.2", "--out",
       str(out), "--", sys.executable, "-c", child],
      cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 3, result.stderr[-2000:]
  peak = re.search(r"peak RSS: main (\d+) MiB", result.stdout)
  assert peak and 190 <= int(peak[1]) <= 400, result.stdout
  rows = out.read_text().splitlines()
  assert rows[0] == "seconds\tmain_MiB\tchildren_MiB" and len(rows) > 5
  assert max(float(r.split("\t")[1]) for r in rows[1:]) == int(peak[1])
