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
$B/slipstream run --model $M --prompt-tokens 1,2,3,4 --max-new 256 --print-ids --backend cuda --resident \
    > /dev/null 2> "$OUT/decode_wall.log"
grep -h "^\[stats\]" "$OUT/decode_wall.log"
# The prompt pass's kernels carry no marker, so profile the whole run
# (prompt pass + STEPS tokens) and a run with one token fewer: the
# difference per kernel is one decode step, averaged over the rest.
for steps in 1 $((STEPS + 1)); do
    timeout 280 $NCU --clock-control none --metrics gpu__time_duration.sum --csv \
        $B/slipstream run --model $M --prompt-tokens 1,2,3,4 --max-new $steps --backend cuda --resident \
        > "$OUT/ncu_decode_$steps.csv" 2>/dev/null
done
python3 - "$OUT/ncu_decode_1.csv" "$OUT/ncu_decode_$((STEPS + 1)).csv" "$STEPS" <<'PY'
import collections, csv, sys
def load(path):
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    h = rows[0]
    ki, vi, ui = h.index("Kernel Name"), h.index("Metric Value"), h.index("Metric Unit")
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    tot, cnt = collections.Counter(), collections.Counter()
    for r in rows[1:]:
        try:
            v = float(r[vi].replace(",", "")) * scale[r[ui]]
        except (ValueError, KeyError):
            continue
        name = r[ki].split("(")[0]
        tot[name] += v
        cnt[name] += 1
    return tot, cnt
(t1, c1), (tn, cn), steps = load(sys.argv[1]), load(sys.argv[2]), int(sys.argv[3])
per = {k: (tn[k] - t1[k]) / steps for k in tn}
launches = {k: (cn[k] - c1[k]) / steps for k in cn}
s = sum(per.values())
print(f"ncu, per generated token (average of {steps}): kernel time {s / 1000:.3f} ms, {sum(launches.values()):.0f} launches")
for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:18]:
    print(f"  {k}: {v:.1f} us ({100 * v / s:.0f} %), {launches[k]:.0f} launches, {v / max(launches[k], 1):.2f} us each")
PY
