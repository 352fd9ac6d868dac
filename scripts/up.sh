#!/usr/bin/env bash
# `shardplane up` with the build shared with the test command: installs what
# is needed (cached), builds the binary into ~/.cache/shardplane/target and
# runs `shardplane up` with the given options (--agents N, --manifests DIR…).
# The binary has the MLX engine built in, as in the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/shardplane/target}"
bash scripts/setup.sh
cargo build --release --locked -p shardplane --features mlx
exec "$CARGO_TARGET_DIR/release/shardplane" up --no-setup "$@"
