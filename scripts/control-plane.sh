#!/usr/bin/env bash
# A real Kubernetes control plane on loopback for tests and `shardplane up`:
# Debian's etcd and a kube-apiserver built once from Debian's `kubernetes`
# source package, cached under ~/.cache/shardplane/.
#
#   control-plane.sh install        install etcd and build kube-apiserver (idempotent)
#   control-plane.sh check-build    fetch the kube-apiserver source and check its build
#                                   step with make -n (where it writes), compiling nothing
#   control-plane.sh start DIR [PID]
#                                   start both with state in DIR; writes DIR/kubeconfig,
#                                   DIR/env (source it) and pid files; prints DIR/kubeconfig.
#                                   With PID, stops them and removes DIR by itself once
#                                   process PID exits.
#   control-plane.sh stop DIR       stop what `start DIR` started and remove its etcd prefix
set -euo pipefail
# Run from `cargo run` (shardplane up), the environment may still carry
# cargo's build variables; Kubernetes' Makefile would put its output under an
# inherited OUT_DIR.
unset OUT_DIR

CACHE="${SHARDPLANE_CACHE:-$HOME/.cache/shardplane}"
APISERVER="$CACHE/bin/kube-apiserver"

log() { printf '[control-plane] %s\n' "$*" >&2; }
die() { printf '[control-plane] error: %s\n' "$*" >&2; exit 1; }

apt_updated=0
apt_install() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" = 0 ] || die "need root to apt-get install ${missing[*]}"
  if [ $apt_updated = 0 ]; then apt-get update -qq >&2; apt_updated=1; fi
  log "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

# Adds deb-src twins of the machine's own Debian sources (no host names of our own).
enable_deb_src() {
  local src=/etc/apt/sources.list.d/shardplane-deb-src.sources
  [ -f "$src" ] && return 0
  local base=/etc/apt/sources.list.d/debian.sources
  if [ -f "$base" ]; then
    sed -e 's/^Types:.*/Types: deb-src/' "$base" > "$src"
  elif [ -f /etc/apt/sources.list ]; then
    grep -E '^deb ' /etc/apt/sources.list | sed 's/^deb /deb-src /' > /etc/apt/sources.list.d/shardplane-deb-src.list
  else
    die "no Debian apt source found to derive a deb-src entry from"
  fi
  apt-get update -qq >&2; apt_updated=1
}

install_etcd() {
  command -v etcd >/dev/null 2>&1 || apt_install etcd-server
}

# Fetches Debian's kubernetes source into WORK/src, ready to build.
apiserver_source() { # apiserver_source WORK
  local work=$1
  enable_deb_src
  apt_install golang-1.19-go rsync make golang-github-modern-go-reflect2-dev dpkg-dev
  rm -rf "$work"; mkdir -p "$work"
  (cd "$work" && apt-get source --download-only kubernetes >&2)
  local orig
  orig=$(ls "$work"/kubernetes_*.orig.tar.* | head -n1)
  [ -n "$orig" ] || die "apt-get source did not give an orig tarball"
  mkdir -p "$work/src"
  tar -xf "$orig" -C "$work/src" --strip-components=1
  # The vendored reflect2 1.0.1 segfaults on the first custom-resource create under Go >= 1.18.
  rm -rf "$work/src/vendor/github.com/modern-go/reflect2"
  cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 "$work/src/vendor/github.com/modern-go/reflect2"
  rm -f "$work/src/vendor/github.com/modern-go/reflect2/go.mod"
}

# Kubernetes' make for kube-apiserver in SRC, as the build runs it (extra
# arguments such as -n go to make).
kube_make() { # kube_make SRC [MAKE-ARGS...]
  local src=$1; shift
  (cd "$src" && PATH=/usr/lib/go-1.19/bin:$PATH CGO_ENABLED=0 GOFLAGS=-mod=vendor \
     make "$@" WHAT=cmd/kube-apiserver)
}

build_apiserver() {
  [ -x "$APISERVER" ] && return 0
  log "building kube-apiserver from Debian's kubernetes source package (about 5 minutes, once)"
  local work="$CACHE/build/kubernetes"
  apiserver_source "$work"
  kube_make "$work/src" >&2
  mkdir -p "$CACHE/bin"
  cp "$work/src/_output/bin/kube-apiserver" "$APISERVER.tmp"
  mv "$APISERVER.tmp" "$APISERVER"
  rm -rf "$work"
  log "kube-apiserver cached at $APISERVER"
}

# The build step without compiling: fetches the source as a cold cache would,
# lets make print what it would run (make -n) in this environment, and checks
# that every file it would write lies in the source tree's own _output/.
check_build() {
  local work plan outside
  work=$(mktemp -d -t shardplane-apiserver-check-XXXXXX)
  apiserver_source "$work"
  plan=$(kube_make "$work/src" -n 2>&1) || { rm -rf "$work"; printf '%s\n' "$plan" | tail -20 >&2; die "make -n failed"; }
  rm -rf "$work"
  grep -q '^touch _output/bin/' <<<"$plan" ||
    die "make -n shows no build tool made under _output/bin: the Makefile changed, or OUT_DIR was inherited"
  outside=$(grep -E '^touch ' <<<"$plan" | grep -v '^touch _output/' || true)
  [ -z "$outside" ] || die "the kube-apiserver build would write outside its source tree: $outside"
  log "checked: the kube-apiserver build writes only under its source tree's _output/"
}

install() {
  apt_install openssl ca-certificates curl
  install_etcd
  build_apiserver
  command -v kubectl >/dev/null 2>&1 || die "kubectl is missing: install a kubectl >= 1.28 on PATH"
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

wait_for() { # wait_for SECONDS DESCRIPTION CMD...
  local t=$1 what=$2; shift 2
  for _ in $(seq 1 $((t * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  return 1
}

start() {
  local dir=$1 owner=${2:-}
  [ -x "$APISERVER" ] && command -v etcd >/dev/null 2>&1 || die "control plane not installed: run scripts/control-plane.sh install"
  mkdir -p "$dir"; dir=$(cd "$dir" && pwd)
  local etcd_port etcd_peer api_port prefix token
  etcd_port=$(free_port); etcd_peer=$(free_port); api_port=$(free_port)
  prefix="/shardplane-$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')"
  token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')

  # Own sessions: a Ctrl-C meant for the caller must not stop the control plane
  # before the caller's components have drained; `stop` stops it.
  setsid etcd --name sp --data-dir "$dir/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" \
    --initial-cluster "sp=http://127.0.0.1:$etcd_peer" \
    --unsafe-no-fsync >"$dir/etcd.log" 2>&1 &
  echo $! > "$dir/etcd.pid"
  wait_for 30 etcd curl -sf "http://127.0.0.1:$etcd_port/health" || { tail -20 "$dir/etcd.log" >&2; die "etcd did not start"; }

  openssl genrsa -out "$dir/sa.key" 2048 2>/dev/null
  openssl rsa -in "$dir/sa.key" -pubout -out "$dir/sa.pub" 2>/dev/null
  echo "$token,admin,admin,system:masters" > "$dir/tokens.csv"
  mkdir -p "$dir/certs"
  setsid "$APISERVER" --etcd-servers "http://127.0.0.1:$etcd_port" --etcd-prefix "$prefix" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
    --cert-dir "$dir/certs" --token-auth-file "$dir/tokens.csv" --authorization-mode RBAC \
    --service-account-key-file "$dir/sa.pub" --service-account-signing-key-file "$dir/sa.key" \
    --service-account-issuer https://kubernetes.default.svc \
    --api-audiences https://kubernetes.default.svc \
    --service-cluster-ip-range 10.96.0.0/16 \
    --disable-admission-plugins ServiceAccount --endpoint-reconciler-type none \
    --allow-privileged=false >"$dir/apiserver.log" 2>&1 &
  echo $! > "$dir/apiserver.pid"
  echo "$etcd_port" > "$dir/etcd.port"; echo "$prefix" > "$dir/etcd.prefix"

  cat > "$dir/kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: shardplane
  cluster:
    server: https://127.0.0.1:$api_port
    insecure-skip-tls-verify: true
users:
- name: admin
  user:
    token: $token
contexts:
- name: shardplane
  context:
    cluster: shardplane
    user: admin
    namespace: default
current-context: shardplane
KC
  echo "export KUBECONFIG=$dir/kubeconfig" > "$dir/env"
  if ! wait_for 60 apiserver kubectl --kubeconfig "$dir/kubeconfig" get --raw /readyz; then
    tail -30 "$dir/apiserver.log" >&2; stop "$dir"; die "kube-apiserver did not become ready"
  fi
  # The old API server has no controller-manager: create the default namespace ourselves.
  kubectl --kubeconfig "$dir/kubeconfig" get namespace default >/dev/null 2>&1 ||
    kubectl --kubeconfig "$dir/kubeconfig" create namespace default >/dev/null 2>&1 || true
  if [ -n "$owner" ]; then
    # A watcher outlives a test process that panics or is killed, and cleans up after it.
    setsid nohup bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 1; done; "$2" stop "$3"; rm -rf "$3"' \
      watcher "$owner" "$(readlink -f "$0")" "$dir" >/dev/null 2>&1 < /dev/null &
  fi
  echo "$dir/kubeconfig"
}

stop_pid() {
  local f=$1
  [ -f "$f" ] || return 0
  local pid; pid=$(cat "$f")
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

stop() {
  local dir=$1
  [ -d "$dir" ] || return 0
  stop_pid "$dir/apiserver.pid"
  stop_pid "$dir/etcd.pid"
  rm -rf "$dir/etcd" "$dir/certs" "$dir/sa.key"
}

case "${1:-}" in
  install) install ;;
  check-build) check_build ;;
  start) [ $# -ge 2 ] && [ $# -le 3 ] || die "usage: $0 start DIR [OWNER_PID]"; start "$2" "${3:-}" ;;
  stop) [ $# -eq 2 ] || die "usage: $0 stop DIR"; stop "$2" ;;
  *) echo "usage: $0 install | check-build | start DIR | stop DIR" >&2; exit 2 ;;
esac
