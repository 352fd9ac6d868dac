#!/usr/bin/env bash
# Decode speed of pipelines of real agents on loopback against the same engine
# in one process, measured in one run, alternating so drift hits every
# configuration alike.
#
#   scripts/bench-pipeline.sh [--rounds N] [--gen-tokens N] [--prompt-tokens N] [--tls]
#                             [--split L] [--concurrency N]
#
# --split L: the 2-stage pipeline's first stage runs layers 0..L (default 15,
# half of the 30 by count; the last stage also applies the output head, so a
# split past the middle balances the two stages' work). --concurrency N: each
# bench run also decodes N sequences at once, and the summary shows their
# aggregate decode rate and time to first token beside the single stream's.
#
# With --tls the data plane runs TLS as in a cluster (certificates from a CA
# made here with openssl, one per node naming it; agents read them with
# --data-plane-tls files); without, plain TCP. Compare the two runs by their
# ratios to the in-process whole model, which each run measures beside them.
#
# Starts a control plane and three agents (each with RAYON_NUM_THREADS=2), makes
# Shards by hand (no operator): the whole model on agent 0, a 2-stage pipeline
# on agents 0-1 and a 3-stage one on agents 0-2. Then, each round, runs
# `shardplane bench` in-process (whole and 3 stages) and against each head
# stage's data plane. Prints every report as JSON and a summary of medians and
# ratios to the in-process whole model.
set -euo pipefail
# Agents started by hand under the admin's kubeconfig get no data-plane
# certificate from the operator: plain TCP on loopback unless --tls.
export SHARDPLANE_DATA_PLANE_TLS=off
cd "$(dirname "$0")/.."
ROUNDS=3 GEN=64 PROMPT=41 TLS=0 SPLIT=15 CONCURRENCY=1
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift 2 ;;
    --gen-tokens) GEN=$2; shift 2 ;;
    --prompt-tokens) PROMPT=$2; shift 2 ;;
    --tls) TLS=1; shift ;;
    --split) SPLIT=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    *) echo "usage: $0 [--rounds N] [--gen-tokens N] [--prompt-tokens N] [--tls] [--split L] [--concurrency N]" >&2; exit 2 ;;
  esac
done
if ! [[ "$SPLIT" =~ ^[0-9]+$ ]] || [ "$SPLIT" -lt 1 ] || [ "$SPLIT" -gt 29 ]; then
  echo "--split must be a layer between 1 and 29 (the model has 30)" >&2; exit 2
fi
if ! [[ "$CONCURRENCY" =~ ^[0-9]+$ ]] || [ "$CONCURRENCY" -lt 1 ]; then
  echo "--concurrency must be a positive number of sequences" >&2; exit 2
fi
source scripts/bench-cluster.sh
agent_tls=() client_tls=() gateway_tls=()
if [ "$TLS" = 1 ]; then
  tls="$STATE/tls"
  mkdir -p "$tls/gateway"
  ec=(-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes)
  openssl req -x509 "${ec[@]}" -days 2 -subj /CN=bench-ca -keyout "$tls/ca.key" -out "$tls/ca.crt" 2>/dev/null
  cp "$tls/ca.crt" "$tls/gateway/ca.crt"
  # The gateway's certificate is for calling only and names no node.
  openssl req "${ec[@]}" -subj /CN=shardplane-gateway -keyout "$tls/gateway/tls.key" -out "$tls/gateway/request.csr" 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\n' >"$tls/gateway/extensions"
  openssl x509 -req -in "$tls/gateway/request.csr" -CA "$tls/ca.crt" -CAkey "$tls/ca.key" -CAcreateserial \
    -days 2 -extfile "$tls/gateway/extensions" -out "$tls/gateway/tls.crt" 2>/dev/null
  for i in 0 1 2; do
    d="$tls/bench-$i"
    mkdir -p "$d"
    cp "$tls/ca.crt" "$d/ca.crt"
    openssl req "${ec[@]}" -subj "/CN=bench-$i" -keyout "$d/tls.key" -out "$d/request.csr" 2>/dev/null
    printf 'subjectAltName=DNS:bench-%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$i" >"$d/extensions"
    openssl x509 -req -in "$d/request.csr" -CA "$tls/ca.crt" -CAkey "$tls/ca.key" -CAcreateserial \
      -days 2 -extfile "$d/extensions" -out "$d/tls.crt" 2>/dev/null
  done
  client_tls=(--data-plane-tls-dir "$tls/gateway" --node bench-0)
  gateway_tls=(--data-plane-tls files --tls-dir "$tls/gateway")
fi
for i in 0 1 2; do
  [ "$TLS" = 1 ] && agent_tls=(--data-plane-tls files --tls-dir "$tls/bench-$i")
  RAYON_NUM_THREADS=2 "$bin" agent --kubeconfig "$KUBECONFIG" --node-name "bench-$i" \
    --admin-address "127.0.0.1:$((9300 + i))" --data-plane-address "127.0.0.1:0" --token-file "$TOKEN_FILE" \
    --cache-dir "$STATE/cache-$i" "${agent_tls[@]}" >"$STATE/agent-$i.log" 2>&1 &
  pids+=($!)
done

# shard NAME DEPLOYMENT NODE STAGE COUNT START END [NEXT] [PREVIOUS]
shard() {
  cat <<YAML
---
apiVersion: shardplane.dev/v1alpha1
kind: Shard
metadata:
  name: $1
  namespace: default
  labels: {shardplane.dev/node: $3, shardplane.dev/deployment: $2, shardplane.dev/instance: "0"}
spec:
  deployment: $2
  model: bench
  source: {path: {path: "$MODEL"}}
  format: gguf
  node: $3
  stage: $4
  stageCount: $5
  layers: {start: $6, end: $7}
  totalLayers: 30
  kvCache: {contextLength: 2048, concurrentSequences: 8}
${8:+  next: $8}
${9:+  previous: $9}
YAML
}
{
  # The Model and a deployment of the whole-model Shard, for the gateway.
  cat <<YAML
---
apiVersion: shardplane.dev/v1alpha1
kind: Model
metadata: {name: bench, namespace: default}
spec: {source: {path: {path: "$MODEL"}}, format: gguf, servedName: bench}
---
apiVersion: shardplane.dev/v1alpha1
kind: ModelDeployment
metadata: {name: whole, namespace: default}
spec: {model: bench, nodePool: none, strategy: none, replicas: 1}
YAML
  shard whole-0 whole bench-0 0 1 0 30
  shard p2-0 p2 bench-0 0 2 0 "$SPLIT" p2-1
  shard p2-1 p2 bench-1 1 2 "$SPLIT" 30 "" p2-0
  shard p3-0 p3 bench-0 0 3 0 10 p3-1
  shard p3-1 p3 bench-1 1 3 10 20 p3-2 p3-0
  shard p3-2 p3 bench-2 2 3 20 30 "" p3-1
} | kubectl apply -f - >/dev/null
kubectl wait --for=jsonpath='{.status.phase}'=Ready --timeout=120s shard --all -n default >/dev/null
endpoint() { kubectl get shard "$1" -n default -o jsonpath='{.status.endpoint}'; }

common=(--model "$MODEL" --prompt-tokens "$PROMPT" --gen-tokens "$GEN" --runs 5 --concurrency "$CONCURRENCY" --json)
results="$STATE/results.jsonl"
for round in $(seq 1 "$ROUNDS"); do
  for config in local-whole agents-whole agents-2 agents-3 local-3; do
    case $config in
      local-whole) out=$("$bin" bench "${common[@]}" --threads 2) ;;
      local-3) out=$("$bin" bench "${common[@]}" --threads 2 --stages 0-9,10-19,20-29) ;;
      agents-whole) out=$("$bin" bench "${common[@]}" --endpoint "$(endpoint whole-0)" --shard default/whole-0 --token-file "$TOKEN_FILE" "${client_tls[@]}") ;;
      agents-2) out=$("$bin" bench "${common[@]}" --endpoint "$(endpoint p2-0)" --shard default/p2-0 --token-file "$TOKEN_FILE" "${client_tls[@]}") ;;
      agents-3) out=$("$bin" bench "${common[@]}" --endpoint "$(endpoint p3-0)" --shard default/p3-0 --token-file "$TOKEN_FILE" "${client_tls[@]}") ;;
    esac
    echo "$out" | python3 -c 'import json,sys; d=json.load(sys.stdin); d["config"]=sys.argv[1]; d["round"]=int(sys.argv[2]); print(json.dumps(d))' "$config" "$round" | tee -a "$results"
  done
done
# The gateway's overhead on time to first token: the same question straight to
# the head stage and through the gateway's OpenAI API, alternating.
"$bin" gateway --kubeconfig "$KUBECONFIG" --listen 127.0.0.1:8399 --admin-address 127.0.0.1:9399 \
  --token-file "$TOKEN_FILE" --allow-anonymous "${gateway_tls[@]}" >"$STATE/gateway.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do curl -sf 127.0.0.1:9399/readyz >/dev/null && break; sleep 0.2; done
"$bin" bench --model "$MODEL" --endpoint "$(endpoint whole-0)" --shard default/whole-0 \
  --token-file "$TOKEN_FILE" "${client_tls[@]}" --gateway http://127.0.0.1:8399 --gateway-model bench --runs 101

# Each agent's memory above the weights it holds (resident set vs loaded weights).
for i in 0 1 2; do
  rss=$(awk '/VmRSS/{print $2 * 1024}' "/proc/${pids[$i]}/status")
  weights=$(curl -s "127.0.0.1:$((9300 + i))/metrics" | awk '/^shardplane_agent_weight_bytes /{print $2}')
  python3 -c 'import sys; r, w = int(sys.argv[2]), float(sys.argv[3]); print(f"agent {sys.argv[1]}: resident {r / 2**20:.0f} MiB, weights {w / 2**20:.0f} MiB, above the weights {(r - w) / 2**20:.0f} MiB")' "$i" "$rss" "$weights"
done
# Each agent's forward passes: time per pass, by shard; decode round trips from each head.
for i in 0 1 2; do curl -s "127.0.0.1:$((9300 + i))/metrics"; done | python3 -c '
import re, sys
lines = sys.stdin.read().splitlines()
def means(metric):
    sums, counts = {}, {}
    for line in lines:
        m = re.match(metric + r"_(sum|count)\{shard=\"([^\"]+)\"\} (\S+)", line)
        if m:
            (sums if m[1] == "sum" else counts)[m[2]] = float(m[3])
    return [(s, counts[s], sums[s] / counts[s] * 1e3) for s in sorted(sums)]
for s, n, ms in means("shardplane_agent_forward_seconds"):
    print(f"agent stage {s}: {n:.0f} passes, {ms:.2f} ms mean per pass")
for s, n, ms in means("shardplane_agent_downstream_step_seconds"):
    print(f"head {s}: {n:.0f} decode steps, {ms:.2f} ms mean from sending the hidden state to receiving the token")
'
python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault(r["config"], []).append(r)
def med(cfg, key):
    return statistics.median(r[key]["median"] for r in by[cfg])
base_decode = med("local-whole", "decode_tokens_per_second")
print()
print(f"{'configuration':<14} {'decode tok/s':>12} {'vs local whole':>15} {'prefill tok/s':>14} {'ttft ms':>8}")
for cfg in ["local-whole", "local-3", "agents-whole", "agents-2", "agents-3"]:
    d = med(cfg, "decode_tokens_per_second")
    print(f"{cfg:<14} {d:>12.1f} {d / base_decode:>15.3f} {med(cfg, 'prefill_tokens_per_second'):>14.1f} {med(cfg, 'time_to_first_token_ms'):>8.1f}")
# Sequences decoded at once (--concurrency): aggregate rate and first tokens.
if any(r.get("concurrent") for r in rows):
    n = next(c["sequences"] for r in rows for c in r.get("concurrent", []))
    print()
    print(f"{n} sequences at once: {'configuration':<14} {'decode tok/s':>12} {'vs local whole':>15} {'ttft ms (median)':>17}")
    def conc(cfg, key, inner):
        return statistics.median(c[key][inner] for r in by[cfg] for c in r.get("concurrent", []))
    base = conc("local-whole", "decode_tokens_per_second", "median")
    for cfg in ["local-whole", "local-3", "agents-whole", "agents-2", "agents-3"]:
        d = conc(cfg, "decode_tokens_per_second", "median")
        print(f"{'':<20} {cfg:<14} {d:>12.1f} {d / base:>15.3f} {conc(cfg, 'time_to_first_token_ms', 'p50'):>17.1f}")
# Hop cost per token: the extra time per decoded token of an n-stage pipeline
# over the whole model on one agent, divided by its hops (n - 1).
w = 1 / med("agents-whole", "decode_tokens_per_second")
for n, cfg in [(2, "agents-2"), (3, "agents-3")]:
    extra = 1 / med(cfg, "decode_tokens_per_second") - w
    print(f"{cfg}: {extra * 1e6:.0f} us more per token than one agent, {extra * 1e6 / (n - 1):.0f} us per hop")
PY
