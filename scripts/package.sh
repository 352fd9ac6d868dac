#!/usr/bin/env bash
# Packages a built shardplane binary with the MLX libraries it links, so it
# can be copied to another machine of the same OS and architecture and run
# without this checkout or its cache:
#
#   dist/shardplane-<os>-<arch>/
#     shardplane                 finds mlx/lib through its rpath
#                                ($ORIGIN/mlx/lib, @loader_path/mlx/lib on macOS)
#     mlx/lib/libmlx.*           (macOS: and mlx.metallib, the Metal kernels)
#     mlx_cpu.libs/              (Linux: the BLAS/LAPACK libmlx.so names by its own rpath)
#   dist/shardplane-<os>-<arch>.tar.gz
#
# Usage: bash scripts/package.sh [BINARY] [OUT_DIR]
#   BINARY   default: the release build in $CARGO_TARGET_DIR (built with
#            `cargo build --release --locked --features shardplane/mlx`)
#   OUT_DIR  default: dist/
# Linux targets also need Debian's libopenblas0 (or the distribution's
# libopenblas.so.0), which the binary links ahead of the wheel's BLAS.
# Prints the package directory.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET="${CARGO_TARGET_DIR:-$HOME/.cache/shardplane/target}"
BIN="${1:-$TARGET/release/shardplane}"
OUT="${2:-dist}"
[ -x "$BIN" ] || { echo "[package] error: no binary at $BIN (build it first: cargo build --release --locked --features shardplane/mlx)" >&2; exit 1; }
MLX=$(bash scripts/mlx.sh)
OS=$(uname -s | tr '[:upper:]' '[:lower:]')
NAME="shardplane-$OS-$(uname -m)"
PKG="$OUT/$NAME"
rm -rf "$PKG" "$PKG.tar.gz"
mkdir -p "$PKG/mlx"
cp "$BIN" "$PKG/shardplane"
cp -R "$MLX/lib" "$PKG/mlx/lib"
# The wheel's own libraries, where libmlx's rpath ($ORIGIN/../../<wheel>.libs) looks.
for libs in "$MLX"/../*.libs; do
  [ -d "$libs" ] && cp -R "$libs" "$PKG/"
done
tar -C "$OUT" -czf "$PKG.tar.gz" "$NAME"
echo "$PKG"
