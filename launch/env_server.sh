#!/usr/bin/env bash
# Starts or stops N replicas of an environment service (AgentGym's HTTP protocol), one process
# per port, so trainer hosts can spread episodes over them by URL.
#
#   launch/env_server.sh start --env NAME [--replicas N] [--port P] [--logdir D] [-- SERVER ARGS]
#   launch/env_server.sh stop  --env NAME [--logdir D]
#   launch/env_server.sh status --env NAME [--logdir D]
#
# start runs `python -m environments.server --env NAME --port P+i` for i in 0..N-1 in the
# background, writes D/NAME.P.log per replica and D/NAME.pids, and prints the replica URLs.
# stop ends exactly the processes listed in D/NAME.pids. Defaults: N=1, P=36005 (AgentGym's),
# D=env_logs. PYTHON names the interpreter (default .venv/bin/python if present, else python3);
# ENV_SERVER_HOST is the host printed in the URLs (default this machine's hostname).
#
# Trainer hosts reach the replicas with env.name=remote. One service per trainer host (the
# printed URLs, or several env machines): --config.env.urls="('http://h0:36005', 'http://h1:36005')"
# gives process i the URL urls[i % len(urls)]. One replica on every trainer host itself:
# `launch/tpu.sh ssh -- 'cd agentgym_jax && launch/env_server.sh start --env babyai'`, then
# --config.env.kwargs.url=http://localhost:36005 (each host reaches its own).
set -euo pipefail

die() { echo "launch/env_server.sh: $*" >&2; exit 2; }

[[ $# -ge 1 ]] || die "usage: launch/env_server.sh start|stop|status --env NAME [options]"
VERB="$1"; shift
ENV_NAME=""
REPLICAS=1
PORT=36005
LOGDIR="env_logs"
SERVER_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --env) ENV_NAME="$2"; shift 2 ;;
    --replicas) REPLICAS="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --logdir) LOGDIR="$2"; shift 2 ;;
    --) shift; SERVER_ARGS=("$@"); break ;;
    *) die "unknown option '$1'" ;;
  esac
done
[[ -n "$ENV_NAME" ]] || die "pass --env NAME (babyai, textcraft, sciworld, searchqa)"
[[ "$REPLICAS" =~ ^[1-9][0-9]*$ ]] || die "--replicas must be a positive integer, got '$REPLICAS'"
[[ "$PORT" =~ ^[0-9]+$ ]] || die "--port must be a number, got '$PORT'"

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
PIDS="$LOGDIR/$ENV_NAME.pids"
HOST="${ENV_SERVER_HOST:-$(hostname)}"

case "$VERB" in
  start)
    mkdir -p "$LOGDIR"
    if [[ -s "$PIDS" ]]; then
      die "$PIDS exists: replicas of $ENV_NAME may be running; run 'stop' first"
    fi
    urls=()
    for ((i = 0; i < REPLICAS; i++)); do
      p=$((PORT + i))
      (cd "$ROOT" && exec "$PYTHON" -m environments.server --env "$ENV_NAME" --port "$p" \
        ${SERVER_ARGS[@]+"${SERVER_ARGS[@]}"}) >"$LOGDIR/$ENV_NAME.$p.log" 2>&1 &
      echo "$! $p" >>"$PIDS"
      urls+=("http://$HOST:$p")
    done
    echo "started $REPLICAS $ENV_NAME replica(s); logs in $LOGDIR; URLs:"
    printf '%s\n' "${urls[@]}"
    ;;
  stop)
    [[ -f "$PIDS" ]] || die "no $PIDS: nothing started from this logdir"
    while read -r pid port; do
      if kill "$pid" 2>/dev/null; then echo "stopped $ENV_NAME on port $port (pid $pid)"; fi
    done <"$PIDS"
    rm -f "$PIDS"
    ;;
  status)
    [[ -f "$PIDS" ]] || { echo "no replicas of $ENV_NAME recorded in $LOGDIR"; exit 0; }
    while read -r pid port; do
      if kill -0 "$pid" 2>/dev/null; then state=running; else state=exited; fi
      echo "$ENV_NAME port $port pid $pid $state"
    done <"$PIDS"
    ;;
  *)
    die "unknown verb '$VERB'; use start | stop | status"
    ;;
esac
