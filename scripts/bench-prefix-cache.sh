#!/usr/bin/env bash
# Time to first token of a repeated long prompt with and without the prefix
# cache, on two real agents serving the whole model (or, with --pipeline, two
# 2-stage pipelines on four agents), measured in one run and alternating so
# drift hits both alike.
#
#   scripts/bench-prefix-cache.sh [--rounds N] [--prompt-tokens N] [--gen-tokens N] [--pipeline]
#
# Agent bench-0 keeps the default prefix cache; agent bench-1 runs with
# `--prefix-cache 0`. With --pipeline, the cached pipeline runs layers 0-14
# on bench-0 and 15-29 on bench-1, both with the cache, and the uncached one
# on bench-2 and bench-3, both without. Each round runs `shardplane bench` against each head
# (one warm-up run, then 5 counted runs of the same prompt). Prints every
# report as JSON, the agents' prefix-cache counters, and the medians with
# their ratio. (The bench's "prefill tok/s" divides the whole prompt by the
# time to first token, so with the cache it counts tokens it never computed.)
set -euo pipefail
# Agents started by hand under the admin's kubeconfig get no data-plane
# certificate: plain TCP on loopback (`shardplane up` runs TLS).
export SHARDPLANE_DATA_PLANE_TLS=off
cd "$(dirname "$0")/.."
ROUNDS=3 PROMPT=1000 GEN=16 PIPELINE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift 2 ;;
    --prompt-tokens) PROMPT=$2; shift 2 ;;
    --gen-tokens) GEN=$2; shift 2 ;;
    --pipeline) PIPELINE=1; shift ;;
    *) echo "usage: $0 [--rounds N] [--prompt-tokens N] [--gen-tokens N] [--pipeline]" >&2; exit 2 ;;
  esac
done
source scripts/bench-cluster.sh
agents=(0 1) uncached=(1)
[ "$PIPELINE" = 1 ] && agents=(0 1 2 3) uncached=(2 3)
for i in "${agents[@]}"; do
  extra=()
  [[ " ${uncached[*]} " == *" $i "* ]] && extra=(--prefix-cache 0)
  RAYON_NUM_THREADS=2 "$bin" agent --kubeconfig "$KUBECONFIG" --node-name "bench-$i" \
    --admin-address "127.0.0.1:$((9300 + i))" --data-plane-address "127.0.0.1:0" --token-file "$TOKEN_FILE" \
    --cache-dir "$STATE/cache-$i" "${extra[@]}" >"$STATE/agent-$i.log" 2>&1 &
  pids+=($!)
done
# shard NAME NODE STAGE COUNT START END [NEXT] [PREVIOUS]
shard() {
  cat <<YAML
---
apiVersion: shardplane.dev/v1alpha1
kind: Shard
metadata:
  name: $1
  namespace: default
  labels: {shardplane.dev/node: $2, shardplane.dev/deployment: ${1%-*}, shardplane.dev/instance: "0"}
spec:
  deployment: ${1%-*}
  model: bench
  source: {path: {path: "$MODEL"}}
  format: gguf
  node: $2
  stage: $3
  stageCount: $4
  layers: {start: $5, end: $6}
  totalLayers: 30
  kvCache: {contextLength: 4096, concurrentSequences: 8}
${7:+  next: $7}
${8:+  previous: $8}
YAML
}
if [ "$PIPELINE" = 1 ]; then
  shard warm-0 bench-0 0 2 0 15 warm-1
  shard warm-1 bench-1 1 2 15 30 "" warm-0
  shard cold-0 bench-2 0 2 0 15 cold-1
  shard cold-1 bench-3 1 2 15 30 "" cold-0
else
  shard warm-0 bench-0 0 1 0 30
  shard cold-0 bench-1 0 1 0 30
fi | kubectl apply -f - >/dev/null
kubectl wait --for=jsonpath='{.status.phase}'=Ready --timeout=120s shard --all -n default >/dev/null
endpoint() { kubectl get shard "$1" -n default -o jsonpath='{.status.endpoint}'; }

common=(--model "$MODEL" --prompt-tokens "$PROMPT" --gen-tokens "$GEN" --runs 5 --json --token-file "$TOKEN_FILE")
results="$STATE/results.jsonl"
for round in $(seq 1 "$ROUNDS"); do
  for config in warm cold; do
    out=$("$bin" bench "${common[@]}" --endpoint "$(endpoint "$config-0")" --shard "default/$config-0")
    echo "$out" | python3 -c 'import json,sys; d=json.load(sys.stdin); d["config"]=sys.argv[1]; d["round"]=int(sys.argv[2]); print(json.dumps(d))' "$config" "$round" | tee -a "$results"
  done
done
for i in "${agents[@]}"; do
  curl -s "127.0.0.1:$((9300 + i))/metrics" | grep -E '^shardplane_agent_prefix_cache_(hit|lookup)_tokens_total|^shardplane_agent_prefix_cache_downstream_misses_total|^shardplane_agent_prefix_cache_bytes' | sed "s/^/agent bench-$i: /"
done
python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def med(cfg, key):
    return statistics.median(r[key]["median"] for r in rows if r["config"] == cfg)
warm, cold = med("warm", "time_to_first_token_ms"), med("cold", "time_to_first_token_ms")
print()
print(f"{'configuration':<22} {'ttft ms':>8} {'decode tok/s':>12}")
print(f"{'prefix cache (512Mi)':<22} {warm:>8.1f} {med('warm', 'decode_tokens_per_second'):>12.1f}")
print(f"{'no prefix cache':<22} {cold:>8.1f} {med('cold', 'decode_tokens_per_second'):>12.1f}")
print(f"time to first token, cached / uncached: {warm / cold:.3f}")
PY
