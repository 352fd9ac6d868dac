#!/usr/bin/env bash
# Multi-turn conversations through the gateway, as coding agents hold them:
# how much of each later turn's prompt the prefix cache served, and how many
# later turns reached an instance that did not hold their conversation.
#
#   scripts/bench-conversations.sh [--rounds N] [--conversations N] [--turns N] [--shared]
#
# Runs `shardplane up` (the quickstart: the daily deployment's two replicas),
# then N concurrent conversations with the official openai client (greedy, 24
# tokens an answer, a random pause of up to 0.5 s before each turn). Each
# opens with a system prompt of about 300 words, its own, or with --shared
# the same one for all (as agents of one tool share theirs). A later turn
# "missed its history" when fewer of its prompt tokens were cached than the
# previous turn's prompt held, less 64 (two blocks of slack). Prints one
# JSON line per round.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=2 CONVERSATIONS=12 TURNS=5 SHARED=0
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift 2 ;;
    --conversations) CONVERSATIONS=$2; shift 2 ;;
    --turns) TURNS=$2; shift 2 ;;
    --shared) SHARED=1; shift ;;
    *) echo "usage: $0 [--rounds N] [--conversations N] [--turns N] [--shared]" >&2; exit 2 ;;
  esac
done
source scripts/bench-build.sh
PYTHON="$HOME/.cache/shardplane/venv/bin/python"
STATE=$(mktemp -d /tmp/shardplane-bench-conversations.XXXXXX)
up_pid=''
stop() {
  if [ -n "$up_pid" ]; then kill -INT "$up_pid" 2>/dev/null || true; wait "$up_pid" 2>/dev/null || true; fi
  up_pid=''
}
trap 'stop; rm -rf "$STATE"' EXIT
cat >"$STATE/conversations.py" <<'PY'
import asyncio, json, os, random, sys, time
from openai import AsyncOpenAI

conversations, turns, shared = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
client = AsyncOpenAI(base_url="http://127.0.0.1:8080/v1", api_key=os.environ["KEY"])
WORDS = "alpha beta gamma delta river mountain code build test deploy cluster node shard model token cache".split()
totals = {"later_turns": 0, "prompt_tokens": 0, "cached_tokens": 0, "missed_history": 0}

async def conversation(c):
    rnd = random.Random(c)
    opening = random.Random(0) if shared else rnd
    who = "all" if shared else c
    messages = [
        {"role": "system", "content": f"Agent {who}. " + " ".join(opening.choice(WORDS) for _ in range(300))},
        {"role": "user", "content": f"Step 1 of task {c}: name one word."},
    ]
    previous = 0
    for t in range(turns):
        await asyncio.sleep(rnd.random() * 0.5)
        r = await client.chat.completions.create(model="smollm2", max_tokens=24, temperature=0, messages=messages)
        usage = r.usage
        details = usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details else 0
        if t > 0:
            totals["later_turns"] += 1
            totals["prompt_tokens"] += usage.prompt_tokens
            totals["cached_tokens"] += cached
            if cached + 64 < previous:
                totals["missed_history"] += 1
        previous = usage.prompt_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        messages.append({"role": "user", "content": f"Step {t + 2} of task {c}: one more word."})

async def main():
    started = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in range(conversations)))
    totals.update(
        conversations=conversations, turns=turns, shared_opening=shared,
        seconds=round(time.perf_counter() - started, 1),
        cached_share=round(totals["cached_tokens"] / max(1, totals["prompt_tokens"]), 3),
    )
    print(json.dumps(totals))

asyncio.run(main())
PY
for round in $(seq "$ROUNDS"); do
  echo "== round $round: shardplane up, load $(cut -d' ' -f1 /proc/loadavg)" >&2
  "$bin" up --no-setup --state "$STATE/up" >"$STATE/up.log" 2>&1 &
  up_pid=$!
  wait_for "$STATE/up.log" "Press Ctrl-C" 300
  key=$(head -1 "$STATE/up/api-keys" | cut -d: -f2 | tr -d ' ')
  KEY="$key" "$PYTHON" "$STATE/conversations.py" "$CONVERSATIONS" "$TURNS" "$SHARED"
  stop
  rm -rf "$STATE/up"
done
