#!/usr/bin/env bash
# A model larger than memory, one GGUF file on disk, run in place by
# slipstream and mmapped by llama.cpp (docs/BENCHMARKS.md, "Larger than
# memory"). In one run, so the figures share a machine state:
#   1. hwbench: the disk's O_DIRECT read rate and the memory bandwidth;
#   2. `slipstream bench`, uncapped: slipstream with no memory flags (its own
#      plan) against llama.cpp mmap; 1,024-token prompt, $GEN tokens, cold;
#   3. the same under a $CAP cgroup cap (page cache counted), llama.cpp
#      also with --mmap 0 (which must hold every weight and cannot run);
#      CAP=none skips it;
#   4. disk bytes per decoded token of llama.cpp: two decode-only llama-bench
#      runs from a cold cache, $SHORT and $LONG tokens, the difference of
#      their reads over the difference of their tokens (slipstream's own
#      figure is in its stats: expert bytes read per decode token).
#
#   bash scripts/bench_big.sh /path/model.gguf
#   CAP=16G GEN=64 LLAMA_BIN=~/.cache/slipstream/llama.cpp/build/bin bash scripts/bench_big.sh m.gguf
#   READ_AHEAD_KB=128 PEER_ONLY=1 bash scripts/bench_big.sh m.gguf   # llama.cpp
#       rows again with the model disk's readahead set (restored after):
#       mmap page faults read around the fault by this much
#
# llama.cpp: scripts/build_llama_cpp.sh builds the pinned CPU llama-bench.
# Needs root for the cgroup and for --evict drop-caches. Results under $OUTD.
set -euo pipefail
cd "$(dirname "$0")/.."
G=${1:?usage: bench_big.sh MODEL.gguf}
CAP=${CAP:-16G}
GEN=${GEN:-64}
SHORT=${SHORT:-8}
LONG=${LONG:-40}
S=${SLIPSTREAM:-target/release/slipstream}
L=${LLAMA_BIN:-$HOME/.cache/slipstream/llama.cpp/build/bin}
OUTD=${OUTD:-bench-results/big-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUTD"
if [ -n "${READ_AHEAD_KB:-}" ]; then
    dev=$(lsblk -no pkname "$(df --output=source "$G" | tail -1)" 2>/dev/null | head -1)
    [ -n "$dev" ] || dev=$(basename "$(df --output=source "$G" | tail -1)")
    ra=/sys/block/$dev/queue/read_ahead_kb
    old=$(cat "$ra")
    trap 'echo "$old" > "$ra"' EXIT
    echo "$READ_AHEAD_KB" > "$ra"
    echo "read_ahead_kb of $dev: $old -> $READ_AHEAD_KB for this run" | tee -a "$OUTD/summary.txt"
fi
slots=auto
[ "${PEER_ONLY:-0}" = 1 ] && slots=none
[ -x "$L/llama-bench" ] || { echo "no llama-bench in $L (scripts/build_llama_cpp.sh builds it)"; exit 2; }

if [ "${PEER_ONLY:-0}" != 1 ]; then
echo "== hwbench" | tee -a "$OUTD/summary.txt"
$S hwbench --scratch-dir "$(dirname "$G")" --scratch-gb 4 --sustain-secs 0 --io-threads 4 \
    --json "$OUTD/hwbench.json" > "$OUTD/hwbench.txt" 2>&1
sed -n '/^SSD/,/^kernels/p' "$OUTD/hwbench.txt" | grep -v '^kernels' | tee -a "$OUTD/summary.txt"
fi

common=(--model "$G" --gguf "$G" --peer "llama.cpp=$L" --slots "$slots" --prompt-lens 1024
        --gen "$GEN" --evict drop-caches --timeout-s 1500)
echo "== uncapped" | tee -a "$OUTD/summary.txt"
$S bench "${common[@]}" --peer-modes mmap --out "$OUTD/uncapped" | tee -a "$OUTD/summary.txt"
if [ "$CAP" != none ]; then
echo "== capped at $CAP" | tee -a "$OUTD/summary.txt"
$S bench "${common[@]}" --peer-modes mmap,no-mmap --memory-cap "$CAP" --cap-runs capped \
    --out "$OUTD/capped" | tee -a "$OUTD/summary.txt"
fi

echo "== llama.cpp disk reads per decoded token (mmap, uncapped)" | tee -a "$OUTD/summary.txt"
reads() { # tokens -> bytes the process read from disk
    sync; echo 3 > /proc/sys/vm/drop_caches
    /usr/bin/time -f "%I" -o "$OUTD/llama_tg$1.time" "$L/llama-bench" -m "$G" -p 0 -n "$1" \
        -t "$(nproc)" -r 1 --no-warmup -lm mmap --repack 0 -o jsonl > "$OUTD/llama_tg$1.jsonl" 2>/dev/null
    echo $(( $(tail -1 "$OUTD/llama_tg$1.time") * 512 ))
}
a=$(reads "$SHORT")
b=$(reads "$LONG")
python3 - "$a" "$b" "$SHORT" "$LONG" <<'EOF' | tee -a "$OUTD/summary.txt"
import sys
a, b, s, l = map(int, sys.argv[1:])
print(f"llama.cpp mmap: {a/1e9:.2f} GB read for {s} tokens, {b/1e9:.2f} GB for {l}: "
      f"{(b - a) / (l - s) / 1e6:.1f} MB per decoded token")
EOF
echo "results: $OUTD"
