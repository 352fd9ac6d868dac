#!/usr/bin/env bash
# Serving through the gateway as its clients see it, against llama.cpp's
# server on the same file and threads, measured by the same client.
#
#   LLAMA_SERVER=/path/to/llama-server scripts/bench-gateway.sh [--rounds N] [--concurrency 1,8,32] [--runs N]
#
# Runs `shardplane up` (the quickstart: the daily deployment's two replicas on
# agents that share this machine's cores), then `shardplane bench --gateway`
# (OpenAI completions, streamed, `ignore_eos`) sweeping the concurrency; then,
# when LLAMA_SERVER names a llama-server binary, that server on the same GGUF
# with as many threads as the machine has cores and continuous batching (one
# slot per stream of the largest count), measured by the same command. Each
# round does both, so drift hits both alike. Prints every report as JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=2 CONCURRENCY=1,8,32 RUNS=3
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    *) echo "usage: $0 [--rounds N] [--concurrency 1,8,32] [--runs N]" >&2; exit 2 ;;
  esac
done
source scripts/bench-build.sh
CORES=$(nproc)
SLOTS=$(tr ',' '\n' <<<"$CONCURRENCY" | sort -n | tail -1)
STATE=$(mktemp -d /tmp/shardplane-bench-gateway.XXXXXX)
up_pid='' server_pid=''
stop() {
  if [ -n "$up_pid" ]; then kill -INT "$up_pid" 2>/dev/null || true; wait "$up_pid" 2>/dev/null || true; fi
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  up_pid='' server_pid=''
}
trap 'stop; rm -rf "$STATE"' EXIT
bench() {
  "$bin" bench --json --model "$MODEL" --runs "$RUNS" --concurrency "$CONCURRENCY" "$@"
}
for round in $(seq "$ROUNDS"); do
  echo "== round $round: shardplane up, daily deployment (2 replicas), load $(cut -d' ' -f1 /proc/loadavg)" >&2
  "$bin" up --no-setup --state "$STATE/up" >"$STATE/up.log" 2>&1 &
  up_pid=$!
  wait_for "$STATE/up.log" "Press Ctrl-C" 300
  key=$(head -1 "$STATE/up/api-keys" | cut -d: -f2 | tr -d ' ')
  SHARDPLANE_API_KEY="$key" bench --gateway http://127.0.0.1:8080 --gateway-model smollm2
  stop
  if [ -n "${LLAMA_SERVER:-}" ]; then
    echo "== round $round: llama-server -t $CORES -np $SLOTS, load $(cut -d' ' -f1 /proc/loadavg)" >&2
    LD_LIBRARY_PATH="$(dirname "$LLAMA_SERVER"):${LD_LIBRARY_PATH:-}" "$LLAMA_SERVER" -m "$MODEL" \
      -t "$CORES" -np "$SLOTS" -c $((SLOTS * 2048)) --host 127.0.0.1 --port 8181 >"$STATE/llama-server.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 120); do curl -sf http://127.0.0.1:8181/health >/dev/null && break; sleep 1; done
    bench --gateway http://127.0.0.1:8181 --gateway-model smollm2
    stop
  fi
done
