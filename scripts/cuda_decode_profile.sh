#!/usr/bin/env bash
# Where a generated token's GPU time goes (GPU machine, binaries from
# `scripts/cuda_device_test.sh build` in .devbin/): the synthetic 35B
# model, every expert in VRAM, a 4-token prompt and STEPS generated tokens
# under ncu (kernel durations, clocks not locked), summed per kernel over
# the decode steps only; then the same run without ncu for the wall time
# per token, whose difference from the kernel sum is launch gaps and
# host work.
#
#   device run(command="bash scripts/cuda_decode_profile.sh", carry=[".devbin"])
#
# RUN_ARGS adds settings to every run (e.g. RUN_ARGS="--temperature 0.7
# --top-p 0.95 --seed 3" for the seeded draw's kernels).
set -uo pipefail
cd "$(dirname "$0")/.."
B=.devbin
OUT=${OUT:-/tmp/cuda_out}
mkdir -p "$OUT"
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
M=/tmp/m.slip
[ -d $M ] || $B/slipstream synth --preset qwen3.6-35b-a3b --output $M > /tmp/synth.log 2>&1 \
    || { echo "synth failed"; tail -5 /tmp/synth.log; exit 1; }
STEPS=${STEPS:-8}
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
RUN_ARGS=${RUN_ARGS:-}
$B/slipstream run --model $M --prompt-tokens 1,2,3,4 --max-new 256 --print-ids --backend cuda --resident $RUN_ARGS \
    > /dev/null 2> "$OUT/decode_wall.log"
grep -h "^\[stats\]" "$OUT/decode_wall.log"
# The prompt pass's kernels carry no marker, so profile the whole run
# (prompt pass + STEPS tokens) and a run with one token fewer: the
# difference per kernel is one decode step, averaged over the rest.
for steps in 1 $((STEPS + 1)); do
    timeout 280 $NCU --clock-control none --metrics gpu__time_duration.sum --csv \
        $B/slipstream run --model $M --prompt-tokens 1,2,3,4 --max-new $steps --backend cuda --resident $RUN_ARGS \
        > "$OUT/ncu_decode_$steps.csv" 2>/dev/null
done
python3 scripts/ncu_sum.py steps "$OUT/ncu_decode_1.csv" "$OUT/ncu_decode_$((STEPS + 1)).csv" "$STEPS"
