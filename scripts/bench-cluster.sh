# Sourced by the bench scripts: builds the binary, starts a control plane with
# the CRDs and makes a data-plane token; everything started is stopped on exit.
# Sets: CARGO_TARGET_DIR, STATE, bin, MODEL, KUBECONFIG, TOKEN_FILE, pids
# (append the PIDs of what you start).
source scripts/bench-build.sh
STATE=$(mktemp -d /tmp/shardplane-bench.XXXXXX)

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  bash scripts/control-plane.sh stop "$STATE" >/dev/null 2>&1 || true
  rm -rf "$STATE"
}
trap cleanup EXIT
bash scripts/control-plane.sh start "$STATE" >/dev/null
export KUBECONFIG="$STATE/kubeconfig"
"$bin" crds | kubectl apply -f - >/dev/null
kubectl wait --for=condition=Established --timeout=60s $("$bin" crds | awk '/^  name: /{print "crd/"$2}') >/dev/null
TOKEN_FILE="$STATE/token"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TOKEN_FILE"
chmod 600 "$TOKEN_FILE"
