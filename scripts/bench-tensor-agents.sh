#!/usr/bin/env bash
# Decode speed of tensor groups of real agents, placed by the operator, on
# loopback against one agent with the whole model and against the same splits
# in one process, measured in one run, alternating so drift hits every
# configuration alike.
#
#   scripts/bench-tensor-agents.sh [--rounds N] [--gen-tokens N] [--prompt-tokens N]
#
# Starts a control plane, the operator and six agents: one with the whole
# model (2 compute threads), and groups of 2 and 3 ranks (1 compute thread per
# rank, so a group uses the machine's two cores as the whole model does).
# Deploys `parallelism: none` on the first and `parallelism: tensor` with
# equal shares on the others. Each round runs `shardplane bench` against each
# head's data plane and in-process (`--tensor 2|3 --tensor-processes`). The
# whole-model agent keeps a prefix cache, so its prefill of the repeated
# prompt is not comparable; decode is. Prints every report as JSON and a
# summary of medians and ratios to the whole-model agent.
set -euo pipefail
export SHARDPLANE_DATA_PLANE_TLS=off
cd "$(dirname "$0")/.."
ROUNDS=3 GEN=64 PROMPT=128
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift 2 ;;
    --gen-tokens) GEN=$2; shift 2 ;;
    --prompt-tokens) PROMPT=$2; shift 2 ;;
    *) echo "usage: $0 [--rounds N] [--gen-tokens N] [--prompt-tokens N]" >&2; exit 2 ;;
  esac
done
source scripts/bench-cluster.sh
"$bin" operator --kubeconfig "$KUBECONFIG" --admin-address 127.0.0.1:9310 \
  --leader-namespace default --node-lease-seconds 5 >"$STATE/operator.log" 2>&1 &
pids+=($!)
# agent NAME LABEL THREADS
agent() {
  "$bin" agent --kubeconfig "$KUBECONFIG" --node-name "$1" --label "bench=$2" --threads "$3" \
    --admin-address 127.0.0.1:0 --data-plane-address 127.0.0.1:0 --token-file "$TOKEN_FILE" \
    --memory-reserve 1Gi --cache-dir "$STATE/cache-$1" >"$STATE/agent-$1.log" 2>&1 &
  pids+=($!)
}
agent whole whole 2
agent t2-0 t2 1
agent t2-1 t2 1
agent t3-0 t3 1
agent t3-1 t3 1
agent t3-2 t3 1
{
  cat <<YAML
apiVersion: shardplane.dev/v1alpha1
kind: Model
metadata: {name: smollm2, namespace: default}
spec: {format: gguf, source: {path: {path: $MODEL}}}
YAML
  # deployment NAME POOL TIER PARALLELISM NODES
  for d in "whole whole daily none 1" "t2 t2 reasoning tensor 2" "t3 t3 reasoning tensor 3"; do
    set -- $d
    cat <<YAML
---
apiVersion: shardplane.dev/v1alpha1
kind: NodePool
metadata: {name: bench-$2}
spec: {tier: $3, nodeSelector: {matchLabels: {bench: $2}}}
---
apiVersion: shardplane.dev/v1alpha1
kind: ShardingStrategy
metadata: {name: bench-$1}
spec: {parallelism: $4, placement: evenLayers, minNodes: $5, maxNodes: $5, kvCache: {contextLength: 1024, concurrentSequences: 2}}
---
apiVersion: shardplane.dev/v1alpha1
kind: ModelDeployment
metadata: {name: $1, namespace: default}
spec: {model: smollm2, nodePool: bench-$2, strategy: bench-$1, replicas: 1}
YAML
  done
} | kubectl apply -f - >/dev/null
for _ in $(seq 180); do
  ready=$(kubectl get mdep -n default -o jsonpath='{range .items[*]}{.status.readyReplicas}{"\n"}{end}' | grep -c '^1$' || true)
  [ "$ready" = 3 ] && break
  sleep 1
done
[ "$ready" = 3 ] || { kubectl get mdep,shards -n default -o wide >&2; exit 1; }
# head DEPLOYMENT: the name and endpoint of its first stage's rank 0.
head_of() {
  kubectl get shards -n default -o json | python3 -c '
import json, sys
for s in json.load(sys.stdin)["items"]:
    sp = s["spec"]
    if sp["deployment"] == sys.argv[1] and sp["stage"] == 0 and sp.get("tensor", {}).get("rank", 0) == 0:
        print(s["metadata"]["name"], s["status"]["endpoint"])' "$1"
}
common=(--model "$MODEL" --prompt-tokens "$PROMPT" --gen-tokens "$GEN" --runs 5 --json)
results="$STATE/results.jsonl"
for round in $(seq 1 "$ROUNDS"); do
  for config in agents-whole agents-t2 agents-t3 local-t2 local-t3; do
    case $config in
      agents-*)
        read -r name endpoint < <(head_of "${config#agents-}")
        out=$("$bin" bench "${common[@]}" --endpoint "$endpoint" --shard "default/$name" --token-file "$TOKEN_FILE") ;;
      local-t2) out=$("$bin" bench "${common[@]}" --threads 2 --tensor 2 --tensor-processes) ;;
      local-t3) out=$("$bin" bench "${common[@]}" --threads 2 --tensor 3 --tensor-processes) ;;
    esac
    echo "$out" | python3 -c 'import json,sys; d=json.load(sys.stdin); d["config"]=sys.argv[1]; d["round"]=int(sys.argv[2]); print(json.dumps(d))' "$config" "$round" | tee -a "$results"
  done
done
python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault(r["config"], []).append(r)
def med(cfg, key):
    return statistics.median(r[key]["median"] for r in by[cfg])
base = med("agents-whole", "decode_tokens_per_second")
print()
print(f"{'configuration':<14} {'decode tok/s':>12} {'vs whole agent':>15} {'prefill tok/s':>14} {'ttft ms':>8}")
for cfg in ["agents-whole", "agents-t2", "agents-t3", "local-t2", "local-t3"]:
    d = med(cfg, "decode_tokens_per_second")
    print(f"{cfg:<14} {d:>12.1f} {d / base:>15.3f} {med(cfg, 'prefill_tokens_per_second'):>14.1f} {med(cfg, 'time_to_first_token_ms'):>8.1f}")
PY
