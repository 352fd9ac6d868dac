#!/usr/bin/env bash
# The main job: a local shardplane cluster on this machine. Installs what it
# needs (cached), starts a real control plane, the operator and node agents,
# applies manifests/quickstart/ and waits until both deployments are Ready.
# Ctrl-C stops everything it started.
#
#   scripts/up.sh [--agents N] [--manifests DIR]
#
# Agents 0 and 1 join the daily pool, the others the reasoning pool. Once both
# deployments are Ready, each answers one chat over the data plane. (The
# OpenAI-compatible gateway is not built yet.)
set -euo pipefail
cd "$(dirname "$0")/.."
AGENTS=5
MANIFESTS=manifests/quickstart
while [ $# -gt 0 ]; do
  case "$1" in
    --agents) AGENTS=$2; shift 2 ;;
    --manifests) MANIFESTS=$2; shift 2 ;;
    *) echo "usage: $0 [--agents N] [--manifests DIR]" >&2; exit 2 ;;
  esac
done
[ "$AGENTS" -ge 3 ] || { echo "up: need at least 3 agents (2 daily, 1+ reasoning)" >&2; exit 2; }
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/shardplane/target}"
STATE="${SHARDPLANE_UP_DIR:-$HOME/.cache/shardplane/up}"
MODELS=/var/lib/shardplane/models

bash scripts/setup.sh
cargo build --release --locked -p shardplane
bin="$CARGO_TARGET_DIR/release/shardplane"

pids=()
stop_all() {
  # A second Ctrl-C must not cut the clean-up short.
  trap '' INT TERM
  echo; echo "stopping"
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  # Agents drain (bounded); whatever still runs after 15 s is killed.
  for _ in $(seq 1 30); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.5
  done
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  bash scripts/control-plane.sh stop "$STATE"
  jobs -p | xargs -r kill 2>/dev/null || true
}
bash scripts/control-plane.sh stop "$STATE" 2>/dev/null || true
trap stop_all EXIT
bash scripts/control-plane.sh start "$STATE" >/dev/null
export KUBECONFIG="$STATE/kubeconfig"
mkdir -p "$STATE/logs"

"$bin" crds | kubectl apply -f - >/dev/null
kubectl wait --for=condition=Established --timeout=60s $("$bin" crds | awk '/^  name: /{print "crd/"$2}') >/dev/null
bash scripts/model.sh --install-to "$MODELS" >/dev/null

# The data-plane token every agent (and, later, the gateway) shares.
TOKEN_FILE="$STATE/data-plane-token"
[ -s "$TOKEN_FILE" ] || (umask 077; head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TOKEN_FILE")

"$bin" operator --kubeconfig "$KUBECONFIG" --admin-address 127.0.0.1:9090 >"$STATE/logs/operator.log" 2>&1 &
pids+=($!)
for i in $(seq 0 $((AGENTS - 1))); do
  if [ "$i" -lt 2 ]; then tier=daily; else tier=reasoning; fi
  "$bin" agent --kubeconfig "$KUBECONFIG" --node-name "node-$i" --label "tier.shardplane.dev/$tier=true" \
    --admin-address "127.0.0.1:$((9100 + i))" --data-plane-address "127.0.0.1:$((7100 + i))" \
    --token-file "$TOKEN_FILE" --cache-dir "$STATE/cache/node-$i" --memory-reserve 1Gi \
    >"$STATE/logs/agent-$i.log" 2>&1 &
  pids+=($!)
done

# The gateway, with one API key for this machine's user.
KEYS_FILE="$STATE/api-keys"
[ -s "$KEYS_FILE" ] || (umask 077; echo "local:sk-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')" >"$KEYS_FILE")
API_KEY=$(cut -d: -f2 "$KEYS_FILE" | head -1)
"$bin" gateway --kubeconfig "$KUBECONFIG" --listen 127.0.0.1:8080 --admin-address 127.0.0.1:9092 \
  --token-file "$TOKEN_FILE" --api-keys-file "$KEYS_FILE" >"$STATE/logs/gateway.log" 2>&1 &
pids+=($!)

kubectl apply -f "$MANIFESTS"
echo "waiting for the deployments to become Ready (logs in $STATE/logs)"
if ! kubectl wait --for=condition=Ready --timeout=300s modeldeployment --all >/dev/null; then
  kubectl get shardplane
  echo "up: the deployments did not become Ready; see $STATE/logs" >&2
  exit 1
fi
kubectl get shardplane

# Every deployment answers: one short chat through each instance's head stage.
chat_lines=()
while read -r ns name endpoint dep; do
  [ -n "$endpoint" ] || continue
  line="$bin generate --endpoint $endpoint --shard $ns/$name --token-file $TOKEN_FILE --chat --prompt 'Why is the sky blue?' --max-tokens 64"
  chat_lines+=("$line")
  echo
  echo "$dep ($ns/$name at $endpoint) says:"
  "$bin" generate --endpoint "$endpoint" --shard "$ns/$name" --token-file "$TOKEN_FILE" \
    --chat --prompt "In one sentence, what is a GPU?" --max-tokens 48
done < <(kubectl get shards -A -o jsonpath='{range .items[?(@.spec.stage==0)]}{.metadata.namespace} {.metadata.name} {.status.endpoint} {.spec.deployment}{"\n"}{end}')

cat <<MSG

shardplane is up: operator, $AGENTS agents, the quickstart deployments Ready and answering.
  export KUBECONFIG=$KUBECONFIG
  kubectl get shardplane
  kubectl get shards -o wide
  curl -s 127.0.0.1:9090/metrics | grep shardplane_
The gateway (OpenAI, Anthropic and Ollama APIs) is at http://127.0.0.1:8080, API key in $KEYS_FILE:
  curl -s http://127.0.0.1:8080/v1/chat/completions -H "Authorization: Bearer $API_KEY" \\
    -H 'content-type: application/json' \\
    -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 64}'
  OpenAI base URL: http://127.0.0.1:8080/v1   models: smollm2 (daily), smollm2-pipeline (3 stages)
Or straight to a head stage over the data plane:
$(printf '  %s\n' "${chat_lines[@]}")
Press Ctrl-C to stop everything.
MSG
# `wait` returns on a signal (a foreground sleep would hold the trap back).
while true; do sleep 3600 & wait $!; done
