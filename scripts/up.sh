#!/usr/bin/env bash
# The main job: a local shardplane cluster on this machine. Installs what it
# needs (cached), starts a real control plane, installs the shardplane.dev API
# and applies manifests/quickstart/. Ctrl-C stops everything it started.
#
# Today this brings up the control plane and the API with the quickstart
# applied; the operator, agents and gateway join as they land.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/shardplane/target}"
STATE="${SHARDPLANE_UP_DIR:-$HOME/.cache/shardplane/up}"
MODELS=/var/lib/shardplane/models

bash scripts/setup.sh
cargo build --release --locked -p shardplane
bin="$CARGO_TARGET_DIR/release/shardplane"

bash scripts/control-plane.sh stop "$STATE" 2>/dev/null || true
trap 'echo; echo "stopping"; bash scripts/control-plane.sh stop "$STATE"' EXIT
bash scripts/control-plane.sh start "$STATE" >/dev/null
export KUBECONFIG="$STATE/kubeconfig"

"$bin" crds | kubectl apply -f - >/dev/null
kubectl wait --for=condition=Established --timeout=60s $("$bin" crds | awk '/^  name: /{print "crd/"$2}') >/dev/null
bash scripts/model.sh --install-to "$MODELS" >/dev/null
kubectl apply -f manifests/quickstart/

cat <<MSG

shardplane is up.
  export KUBECONFIG=$KUBECONFIG
  kubectl get shardplane
  kubectl explain modeldeployment.spec
Press Ctrl-C to stop everything.
MSG
while true; do sleep 3600; done
