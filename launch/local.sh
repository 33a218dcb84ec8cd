#!/usr/bin/env bash
# Runs an experiment's `runlocal` variant on this machine's CPU: trains it (2 steps of a tiny
# random model), then evaluates the result on a few test tasks. The same entry points as a pod
# run, so a config that passes here only changes size on a TPU.
#
#   launch/local.sh CONFIG_FILE [ARG] [-- EXTRA TRAIN FLAGS]
#     CONFIG_FILE  e.g. experiments/agentgym_rl/babyai.py
#     ARG          the config argument without runlocal, e.g. schedule=scaling_inter
#   WORKDIR (default /tmp/agentgym_local/<file stem>[_<arg>]) is kept: re-running resumes.
#   PYTHON names the interpreter (default .venv/bin/python if present, else python3).
#   JEMALLOC: the malloc library to preload (default: libjemalloc.so.2 where installed; empty
#   for glibc's malloc), see below.
#
# Example: launch/local.sh experiments/agentgym_rl/textcraft.py schedule=scaling_inter
set -euo pipefail

die() { echo "launch/local.sh: $*" >&2; exit 2; }

[[ $# -ge 1 ]] || die "usage: launch/local.sh CONFIG_FILE [ARG] [-- EXTRA TRAIN FLAGS]"
CONFIG="$1"; shift
[[ -f "$CONFIG" ]] || die "no config file '$CONFIG'"
ARG=""
if [[ $# -gt 0 && "$1" != "--" ]]; then ARG="$1"; shift; fi
[[ $# -gt 0 && "$1" == "--" ]] && shift
EXTRA=("$@")

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
FULL_ARG="runlocal${ARG:+,$ARG}"
NAME="$(basename "$CONFIG" .py)${ARG:+_${ARG//[^A-Za-z0-9]/_}}"
WORKDIR="${WORKDIR:-/tmp/agentgym_local/$NAME}"

# A laptop has one CPU device; XLA would otherwise see whatever the caller's flags say.
export JAX_PLATFORMS=cpu

# Host memory: jemalloc where installed (Debian: libjemalloc2), keeping freed memory for reuse.
# Every jitted CPU step takes one large temporary buffer that glibc's malloc maps afresh and
# unmaps each call (~210,000 page faults per update of the 4M update bench); with jemalloc the
# keypad learning studies ran 8-12% faster (benchmarks/README.md, Update). JEMALLOC=PATH picks
# the library, an empty JEMALLOC keeps glibc's malloc.
if [[ -z "${JEMALLOC+set}" ]]; then
  JEMALLOC="$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null \
    | awk '/libjemalloc\.so\.2 /{print $NF; exit}')"
fi
if [[ -n "$JEMALLOC" ]]; then
  [[ -f "$JEMALLOC" ]] || die "JEMALLOC=$JEMALLOC is not a file; pass libjemalloc.so.2's path, or JEMALLOC= for glibc's malloc"
  export LD_PRELOAD="$JEMALLOC${LD_PRELOAD:+:$LD_PRELOAD}"
  export MALLOC_CONF="${MALLOC_CONF:-dirty_decay_ms:-1,muzzy_decay_ms:-1}"
fi
set -x
"$PYTHON" -m agentgym_jax.train --config="$CONFIG:$FULL_ARG" --workdir="$WORKDIR" \
  ${EXTRA[@]+"${EXTRA[@]}"}
"$PYTHON" -m agentgym_jax.evaluate --config="$CONFIG:$FULL_ARG" --checkpoint="$WORKDIR" \
  --split=test --num_samples=2 --output="$WORKDIR/eval"
