#!/usr/bin/env bash
# Speculative decoding on the GPU (issue 36), on the device machine with the
# binaries of scripts/cuda_device_test.sh build in .devbin/: the synthetic
# 35B (qwen3.6-35b-a3b shape, one MTP layer, every expert in VRAM) and the
# demo model (its trained MTP head). Prints
#   - the cost of a verify pass of n = 1..9 tokens (`--measure-verify`),
#   - decode tok/s plain and speculating (lookup, mtp, both; k = 2, 4, 8)
#     with the acceptance of each, in alternating rounds;
# every speculative run's tokens are compared with the plain run's.
#
#   run(command="bash scripts/cuda_spec_bench.sh", carry=[".devbin/slipstream.xz"])
set -uo pipefail
cd "$(dirname "$0")/.."
B=.devbin
OUT=${OUT:-/tmp/spec_out}
mkdir -p "$OUT"
[ -x $B/slipstream ] || python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as f, open(sys.argv[2], "wb") as o: shutil.copyfileobj(f, o)' \
    $B/slipstream.xz $B/slipstream && chmod +x $B/slipstream
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cuda_nvrtc", "lib") for p in nvidia.__path__))' 2>/dev/null); do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
S=$B/slipstream
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
M=${MODEL:-/tmp/m35-mtp.slip}
BK=${BACKEND:-cuda}
P=$(python3 -c "print(','.join(str((i * 7919) % 248000) for i in range(24)))")
GEN=${GEN:-256}
rm -f "$OUT/failed"
# Decode rate of a run (the [stats] line) and its speculation line.
summary() { grep -ho "decode [0-9.]* tok/s\|[0-9.]* tok/s decode" "$1" | head -1; grep -h "^\[speculat" "$1" | tail -1; }
bench() {  # name, model args...
    local name=$1; shift
    $S run "$@" --max-new $GEN --print-ids > /tmp/plain.ids 2> /tmp/plain.err || touch "$OUT/failed"
    echo "== $name plain: $(summary /tmp/plain.err)"
    for round in 1 2; do
        for cfg in "lookup 4" "mtp 2" "mtp 4" "both 4" "lookup 8"; do
            read -r mode k <<< "$cfg"
            $S run "$@" --max-new $GEN --print-ids --speculate $mode --draft-tokens $k --speculate-always \
                > /tmp/spec.ids 2> /tmp/spec.err || touch "$OUT/failed"
            same=FAIL; cmp -s /tmp/spec.ids /tmp/plain.ids && same=same
            [ $same = same ] || touch "$OUT/failed"
            echo "   round $round $mode k=$k ($same tokens): $(summary /tmp/spec.err | tr '\n' ' ')"
        done
        $S run "$@" --max-new $GEN > /dev/null 2> /tmp/plain2.err || touch "$OUT/failed"
        echo "   round $round plain: $(summary /tmp/plain2.err)"
    done
    $S run "$@" --max-new 32 --measure-verify 9 > /dev/null 2> /tmp/verify.err || touch "$OUT/failed"
    grep -h "^\[verify\]" /tmp/verify.err
}
bench "demo (trained MTP head)" --backend $BK --resident 2>&1 | tee "$OUT/demo.log"
[ -n "${DEMO_ONLY:-}" ] || [ -d "$M" ] || { /usr/bin/time -f "synth: %e s" $S synth --preset qwen3.6-35b-a3b --mtp-layers 1 --output "$M" > /dev/null; } 2>&1 | tail -2
[ -n "${DEMO_ONLY:-}" ] || bench "35B synthetic (random weights), resident" --model "$M" --backend $BK --prompt-tokens "$P" 2>&1 | tee "$OUT/m35.log"
grep -h "rror" /tmp/*.err | sort | uniq -c | head
[ -e "$OUT/failed" ] && fail=1 || fail=0
echo "spec bench: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
