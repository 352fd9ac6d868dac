# Sourced by the bench scripts (from the repository's root): installs what
# they need (cached), builds the binary and names it and the test model.
# Sets: CARGO_TARGET_DIR, bin, MODEL; defines wait_for.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/shardplane/target}"
bash scripts/setup.sh >/dev/null
cargo build --release --locked --workspace --features shardplane/mlx 2>&1 | tail -1 >&2
bin="$CARGO_TARGET_DIR/release/shardplane"
MODEL=$(bash scripts/model.sh)

# wait_for FILE TEXT SECONDS: until FILE holds TEXT; else its tail, and exit.
wait_for() {
  for _ in $(seq "$3"); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 1; done
  echo "no '$2' in $1 after $3 s:" >&2; tail -20 "$1" >&2; exit 1
}
