#!/usr/bin/env bash
# Installs the pinned MLX for the `mlx` feature, once:
#   - Linux: the mlx-cpu wheel from PyPI (headers, lib/libmlx.so, CMake config)
#     unpacked into ~/.cache/shardplane/mlx/<version>/, and Debian's OpenBLAS
#     (libopenblas0), which the build links ahead of the wheel's reference BLAS;
#   - macOS (untested): the mlx-metal wheel, the same way (Metal device).
# Prints the directory holding include/ and lib/ (what SHARDPLANE_MLX_DIR takes).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=$(cat engine/mlx/VERSION)
CACHE="${SHARDPLANE_CACHE:-$HOME/.cache/shardplane}"
DEST="$CACHE/mlx/$VERSION"
case "$(uname -s)" in
  Linux) WHEEL="mlx-cpu==$VERSION" ;;
  Darwin) WHEEL="mlx-metal==$VERSION" ;;
  *) echo "[mlx] error: no MLX wheel for $(uname -s)" >&2; exit 1 ;;
esac
if [ ! -f "$DEST/mlx/include/mlx/mlx.h" ]; then
  rm -rf "$DEST.partial"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$DEST.partial" "$WHEEL" >&2 ||
    { echo "[mlx] error: pip could not install $WHEEL" >&2; exit 1; }
  rm -rf "$DEST" && mv "$DEST.partial" "$DEST"
fi
if [ "$(uname -s)" = Linux ] && ! ldconfig -p | grep -q 'libopenblas\.so\.0 '; then
  [ "$(id -u)" = 0 ] || { echo "[mlx] error: need root to apt-get install libopenblas0" >&2; exit 1; }
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libopenblas0; } >&2 ||
    { echo "[mlx] error: cannot install Debian's libopenblas0" >&2; exit 1; }
fi
echo "$DEST/mlx"
