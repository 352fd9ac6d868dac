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
cargo clippy --workspace --all-targets --locked --release --features shardplane/mlx -- -D warnings

state=$(mktemp -d -t shardplane-test-XXXXXX)
trap 'bash scripts/control-plane.sh stop "$state"; rm -rf "$state"' EXIT
bash scripts/control-plane.sh start "$state" >/dev/null
export SHARDPLANE_TEST_KUBECONFIG="$state/kubeconfig"

echo "== cargo test" >&2
# Release: the engine is too slow unoptimized, and `up` builds release too (one
# build). The MLX engine is built in (libmlx from scripts/mlx.sh, run by setup).
cargo test --workspace --locked --release --features shardplane/mlx "$@"

# The decoders of what strangers send under libFuzzer for a short while each
# (a crash fails the run and leaves its input in fuzz/artifacts/): data-plane
# messages, model-file headers (GGUF, safetensors, config.json), whose
# single allocations must stay under 64 MiB for inputs of a few KiB, and the
# request bodies of every API the gateway speaks and the server-sent events of
# external endpoints, stop-string matching, and chat-template rendering of
# hostile messages (from the seeds in fuzz/seeds/). Sanitizer
# builds go to their own target directory; RUSTC_BOOTSTRAP lets stable rustc
# take the sanitizer flags cargo-fuzz passes.
if [ $# -eq 0 ]; then
  for target in dataplane_messages model_headers api_requests sse_events stop_strings chat_templates; do
    echo "== cargo fuzz ($target, ${SHARDPLANE_FUZZ_SECONDS:-30} s)" >&2
    log="$state/fuzz-$target.log"
    # Committed seed inputs (fuzz/seeds/TARGET) start the corpus, which
    # grows in fuzz/corpus/TARGET (not committed).
    corpus=()
    if [ -d "fuzz/seeds/$target" ]; then
      mkdir -p "fuzz/corpus/$target"
      corpus=("corpus/$target" "seeds/$target")
    fi
    if (cd fuzz && CARGO_TARGET_DIR="$HOME/.cache/shardplane/fuzz-target" RUSTC_BOOTSTRAP=1 \
      cargo fuzz run "$target" --fuzz-dir . "${corpus[@]}" -- \
      -max_total_time="${SHARDPLANE_FUZZ_SECONDS:-30}" -malloc_limit_mb=64 -print_final_stats=1) >"$log" 2>&1; then
      grep -E "^Done|stat::number_of_executed_units" "$log" >&2 || tail -3 "$log" >&2
    else
      cat "$log" >&2
      echo "== cargo fuzz found a crash in $target (input saved under fuzz/artifacts/)" >&2
      exit 1
    fi
  done
fi
