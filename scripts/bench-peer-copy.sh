#!/usr/bin/env bash
# Peer-copy throughput on loopback: one agent holds a model file of SIZE_MIB
# (random bytes) in its cache; `shardplane bench --copy-from` copies it over
# the data plane into a fresh cache several times (checksum included).
#
#   scripts/bench-peer-copy.sh [SIZE_MIB]
set -euo pipefail
# Agents started by hand under the admin's kubeconfig get no data-plane
# certificate: plain TCP on loopback (`shardplane up` runs TLS).
export SHARDPLANE_DATA_PLANE_TLS=off
cd "$(dirname "$0")/.."
SIZE_MIB=${1:-1024}
source scripts/bench-cluster.sh
KEY="url:https://example.invalid/bench-$SIZE_MIB.gguf"
mkdir -p "$STATE/holder"
file=$(python3 -c 'import hashlib,sys; print(hashlib.sha256(sys.argv[1].encode()).hexdigest()[:32] + ".gguf")' "$KEY")
head -c "$((SIZE_MIB << 20))" /dev/urandom >"$STATE/holder/$file"
"$bin" agent --kubeconfig "$KUBECONFIG" --node-name copy-holder --admin-address 127.0.0.1:0 \
  --data-plane-address 127.0.0.1:7399 --token-file "$TOKEN_FILE" --cache-dir "$STATE/holder" \
  >"$STATE/agent.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do
  curl -s --http2-prior-knowledge -o /dev/null 127.0.0.1:7399 2>/dev/null && break
  sleep 0.2
done
"$bin" bench --model "$MODEL" --copy-from 127.0.0.1:7399 --copy-key "$KEY" \
  --copy-to "${COPY_TO:-$STATE/copy}" --token-file "$TOKEN_FILE" --runs 5
