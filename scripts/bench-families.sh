#!/usr/bin/env bash
# Prefill and decode speed of each model family's tiny model (the ones the
# family tests check against mlx-lm, written by
# engine/tests/reference/tiny_model.py), on candle and on MLX, next to
# llama.cpp's llama-bench on the same GGUF file when LLAMA_BENCH names it.
#
#   LLAMA_BENCH=/path/to/llama-bench scripts/bench-families.sh [--threads N] [--runs N]
#       [--families "deepseek_v3 gpt_oss:gguf_mxfp4 ..."]
#
# Families: gemma3_text, qwen3_moe_routed (Qwen3-MoE with every layer routed,
# as released models are and as llama.cpp requires), mixtral, gpt_oss (f32),
# gpt_oss with its experts in GGUF's MXFP4 blocks, as gpt-oss GGUF files
# come, deepseek_v3 (latent attention, sigmoid group routing) and
# deepseek_v2_lite (26 layers: llama.cpp reads a deepseek2 file without a
# low-rank query only at the Lite models' layer counts). Tiny models
# (hidden 64, a few layers) measure per-token overhead more than arithmetic:
# read the ratios, not the absolute rates. Prints one line per family and
# engine: medians of tokens/s over the runs.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=1 RUNS=5 PROMPT=64 GEN=64
FAMILIES="gemma3_text qwen3_moe_routed mixtral gpt_oss gpt_oss:gguf_mxfp4 deepseek_v3 deepseek_v2_lite"
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) THREADS=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --families) FAMILIES=$2; shift 2 ;;
    *) echo "usage: $0 [--threads N] [--runs N] [--families LIST]" >&2; exit 2 ;;
  esac
done
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/shardplane/target}"
bash scripts/setup.sh >/dev/null
cargo build --release --locked --workspace --features shardplane/mlx --bin shardplane 2>&1 | tail -1
bin="$CARGO_TARGET_DIR/release/shardplane"
python="${SHARDPLANE_CACHE:-$HOME/.cache/shardplane}/reference/bin/python"
work=$(mktemp -d /tmp/shardplane-families.XXXXXX)
trap 'rm -rf "$work"' EXIT

printf '%-26s %-10s %14s %14s\n' family engine "prefill tok/s" "decode tok/s"
for entry in $FAMILIES; do
  family=${entry%%:*}
  quant=${entry#"$family"}
  quant=${quant#:}
  label=$family${quant:+ ($quant)}
  "$python" engine/tests/reference/tiny_model.py "$work/$entry" "$family" ${quant:+0 "$quant"} >/dev/null
  gguf="$work/$entry/model.gguf"
  model="$gguf"
  [ -f "$gguf" ] || model="$work/$entry/mlx"
  for engine in candle mlx; do
    "$bin" bench --model "$model" --engine "$engine" --threads "$THREADS" --runs "$RUNS" \
      --prompt-tokens "$PROMPT" --gen-tokens "$GEN" --json 2>/dev/null >"$work/report.json"
    "$python" - "$work/report.json" "$label" "$engine" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:<26} {sys.argv[3]:<10} {r['prefill_tokens_per_second']['median']:>14.1f} {r['decode_tokens_per_second']['median']:>14.1f}")
PY
  done
  if [ -n "${LLAMA_BENCH:-}" ] && [ -f "$gguf" ]; then
    "$LLAMA_BENCH" -m "$gguf" -t "$THREADS" -r "$RUNS" -p "$PROMPT" -n "$GEN" -o json 2>/dev/null >"$work/llama.json"
    "$python" - "$work/llama.json" "$label" <<'PY'
import json, sys
import statistics
rows = json.load(open(sys.argv[1]))
rate = {("prefill" if r["n_prompt"] else "decode"): statistics.median(r["samples_ts"]) for r in rows}
print(f"{sys.argv[2]:<26} {'llama.cpp':<10} {rate['prefill']:>14.1f} {rate['decode']:>14.1f}")
PY
  fi
done
