#!/usr/bin/env bash
# The test command: installs what the tests need (cached), checks formatting and
# lints, then runs every test against one real control plane shared by the run.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/shardplane/target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

bash scripts/setup.sh

echo "== cargo fmt --check" >&2
cargo fmt --all -- --check
echo "== cargo clippy" >&2
cargo clippy --workspace --all-targets --locked --release -- -D warnings

state=$(mktemp -d -t shardplane-test-XXXXXX)
trap 'bash scripts/control-plane.sh stop "$state"; rm -rf "$state"' EXIT
bash scripts/control-plane.sh start "$state" >/dev/null
export SHARDPLANE_TEST_KUBECONFIG="$state/kubeconfig"

echo "== cargo test" >&2
# Release: the engine is too slow unoptimized, and `up` builds release too (one build).
cargo test --workspace --locked --release "$@"
