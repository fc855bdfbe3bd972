#!/usr/bin/env bash
# Prefill on the GPU machine (binaries from `scripts/cuda_device_test.sh
# build` in .devbin/): the synthetic 35B model's 512-token prompt, every
# expert in VRAM, in 64- and 256-token passes (device routing, each twice)
# and one token per pass (host routing), on the default kernels and on the
# tensor-core ones; the generated tokens' logits must be the same bits at
# every pass length; long prompts with and without the prompt attention on
# tensor cores; 256 decode tokens for scale; then where a 64-token
# pass's kernel time goes (ncu, summed per kernel). Results under $OUT (one tarball, so
# the device tool brings everything back).
#
#   device run(command="bash scripts/cuda_device_test.sh run; bash scripts/cuda_prefill_bench.sh", carry=[".devbin"])
set -uo pipefail
cd "$(dirname "$0")/.."
B=.devbin
OUT=${OUT:-/tmp/cuda_out}
mkdir -p "$OUT"
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
W=$(mktemp -d)
M=/tmp/m.slip
[ -d $M ] || $B/slipstream synth --preset qwen3.6-35b-a3b --output $M > $W/synth.log 2>&1 \
    || { echo "synth failed"; tail -5 $W/synth.log; exit 1; }
P512=$(python3 -c "print(','.join(str(1 + (i * 7919) % 240000) for i in range(512)))")
# Bits: the logits of 8 generated tokens after the prompt (dumping logits
# keeps every position's row, so these runs are not timed).
ck() { # name, cache flags, env assignments...
    local name=$1 cache=$2; shift 2
    env "$@" $B/slipstream run ${PP:-} --model $M --prompt-tokens "$P512" --max-new 8 --print-ids --backend cuda \
        $cache --dump-logits /tmp/pf_$name.npy > $W/ck_$name.ids 2> $W/ck_$name.log \
        || { echo "$name failed"; tail -3 $W/ck_$name.log; }
}
R=--resident
# Default kernels (tensor cores for the prompt, a4v for generated tokens)
# in 64- and 256-token passes, one token per pass (host routing), and at
# 64 VRAM slots per layer (4.5 GB of experts: host routing, misses from
# the host): the same bits.
ck p64 $R SLIPSTREAM_CUDA_PASS_TOKENS=64
ck p256 $R SLIPSTREAM_CUDA_PASS_TOKENS=256
ck p1 $R SLIPSTREAM_CUDA_DEVICE_ROUTING=0
ck s64 "--vram-slots 64"
# Every pass on the CUDA-core kernels (SLIPSTREAM_CUDA_TC=0): 64 == 256,
# and within 1e-3 of the default at the prompt's last position.
ck a64 $R SLIPSTREAM_CUDA_TC=0 SLIPSTREAM_CUDA_PASS_TOKENS=64
ck a256 $R SLIPSTREAM_CUDA_TC=0 SLIPSTREAM_CUDA_PASS_TOKENS=256
# Every pass on the tensor cores (SLIPSTREAM_CUDA_TC=1): 64 == 1, also
# with one token per mma (the one-token kernels' B layout).
ck tc64 $R SLIPSTREAM_CUDA_TC=1 SLIPSTREAM_CUDA_PASS_TOKENS=64
ck tc1 $R SLIPSTREAM_CUDA_TC=1 SLIPSTREAM_CUDA_DEVICE_ROUTING=0
ck tcone64 $R SLIPSTREAM_CUDA_TC=1 SLIPSTREAM_CUDA_TC_TPM=1 SLIPSTREAM_CUDA_PASS_TOKENS=64
# The prompt's products in int8 (--prompt-precision int8): 256-token
# passes == one token per pass == 64 VRAM slots, and within 5e-2 of the
# a4v kernels; the default (exact) within 1e-3 of them.
PP="--prompt-precision int8" ck q256 $R SLIPSTREAM_CUDA_PASS_TOKENS=256
PP="--prompt-precision int8" ck q1 $R SLIPSTREAM_CUDA_DEVICE_ROUTING=0
PP="--prompt-precision int8" ck qs64 "--vram-slots 64"
fail=0
python3 - <<'PY' || fail=1
import sys, numpy as np
names = ["p64", "p256", "p1", "s64", "a64", "a256", "tc64", "tc1", "tcone64", "q256", "q1", "qs64"]
l = {}
for k in names:
    try:
        l[k] = np.load(f"/tmp/pf_{k}.npy")
    except OSError:
        l[k] = np.zeros(1)
bits = lambda a, b: bool(np.array_equal(l[a], l[b]))
# The first row (the prompt's last position): later rows follow generated tokens, which may differ.
relf = lambda a, b: float(np.abs(l[a][0] - l[b][0]).max() / np.abs(l[b][0]).max()) if l[a].shape == l[b].shape else float("inf")
rel, rel8 = relf("p64", "a64"), relf("q256", "a64")
pairs = [("p64", "p1"), ("p256", "p1"), ("s64", "p1"), ("a64", "a256"), ("tc64", "tc1"), ("tcone64", "tc1"), ("q256", "q1"), ("qs64", "q1")]
ok = all(bits(a, b) for a, b in pairs) and rel < 1e-3 and rel8 < 5e-2
print("prefill logits (8 generated tokens after 512): " + "; ".join(f"{a} == {b}: {bits(a, b)}" for a, b in pairs)
      + f"; prompt on tensor cores vs a4v, last prompt position, max rel err: exact (default) {rel:.2e}, int8 {rel8:.2e}: {'ok' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
rm -f /tmp/pf_*.npy
# Speed (no logits kept), alternating.
pf() { # name, env assignments...
    local name=$1; shift
    env "$@" $B/slipstream run ${PP:-} --model $M --prompt-tokens "$P512" --max-new 16 --print-ids --backend cuda \
        --resident > $W/pf_$name.ids 2> $W/pf_$name.log
    echo "--- $name ${PP:-} $*"
    grep -h "^\[stats\]\|rror" $W/pf_$name.log
}
for rep in 1 2; do
    pf p64_$rep SLIPSTREAM_CUDA_PASS_TOKENS=64
    pf p256_$rep SLIPSTREAM_CUDA_PASS_TOKENS=256
    PP="--prompt-precision int8" pf q256_$rep SLIPSTREAM_CUDA_PASS_TOKENS=256
    pf a64_$rep SLIPSTREAM_CUDA_TC=0 SLIPSTREAM_CUDA_PASS_TOKENS=64
    pf a256_$rep SLIPSTREAM_CUDA_TC=0 SLIPSTREAM_CUDA_PASS_TOKENS=256
done
# Long prompts: the prompt's attention on tensor cores (default) against
# the decode kernels (SLIPSTREAM_CUDA_TC_ATTN=0), 4096 and 16384 tokens.
# And the bits of a 2100-token prompt (crossing the tensor-core attention's
# key splits at 1024 and 2048) in 256-token passes and one token per pass.
for len in ${LONG_PROMPTS:-4096 16384}; do
    PL=$(python3 -c "print(','.join(str(1 + (i * 7919) % 240000) for i in range($len)))")
    for v in 1:exact 1:int8 0:exact; do
        attn=${v%%:*} prec=${v#*:}
        SLIPSTREAM_CUDA_TC_ATTN=$attn timeout 300 $B/slipstream run --model $M --prompt-tokens "$PL" --max-new 8 \
            --print-ids --backend cuda --resident --prompt-precision $prec > /dev/null 2> $W/long${len}_${attn}_$prec.log
        echo "--- prompt $len tokens, SLIPSTREAM_CUDA_TC_ATTN=$attn, --prompt-precision $prec"
        grep -h "^\[stats\]\|rror" $W/long${len}_${attn}_$prec.log
    done
done
P2100=$(python3 -c "print(','.join(str(1 + (i * 7919) % 240000) for i in range(2100)))")
for name in l256 l1; do
    extra=SLIPSTREAM_CUDA_PASS_TOKENS=256
    [ $name = l1 ] && extra=SLIPSTREAM_CUDA_DEVICE_ROUTING=0
    env $extra $B/slipstream run --model $M --prompt-tokens "$P2100" --max-new 4 --print-ids --backend cuda \
        --resident --dump-logits /tmp/pf_$name.npy > $W/ck_$name.ids 2> $W/ck_$name.log || echo "$name failed"
done
python3 - <<'PY' || fail=1
import sys, numpy as np
a, b = np.load("/tmp/pf_l256.npy"), np.load("/tmp/pf_l1.npy")
ok = a.shape == b.shape and bool(np.array_equal(a, b))
print(f"2100-token prompt: rows {a.shape[0]}; 256-token passes bit-identical to one-token passes: {ok}")
sys.exit(0 if ok else 1)
PY
rm -f /tmp/pf_*.npy
for tc in prompt 0 1; do
    SLIPSTREAM_CUDA_TC=$tc $B/slipstream run --model $M --prompt-tokens 1,2,3,4 --max-new 256 --print-ids \
        --backend cuda --resident > /dev/null 2> $W/decode$tc.log
    echo "--- decode, SLIPSTREAM_CUDA_TC=$tc"
    grep -h "^\[stats\]" $W/decode$tc.log
done
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ -x "$NCU" ]; then
    P64=$(python3 -c "print(','.join(str(1 + (i * 7919) % 240000) for i in range(64)))")
    for prec in ${NCU_PRECISION:-exact int8}; do
    timeout 150 $NCU --clock-control none --metrics gpu__time_duration.sum --csv \
        $B/slipstream run --model $M --prompt-tokens "$P64" --max-new 1 --backend cuda --resident \
        --prompt-precision $prec > $W/ncu64_$prec.csv 2>/dev/null
    echo "--- ncu: --prompt-precision $prec"
    python3 scripts/ncu_sum.py pass $W/ncu64_$prec.csv "64-token pass + 1 decode step"
    done
    # NCU_DETAIL=regex: speed of light, warp stalls and memory sections of
    # the first 3 launches of the matching kernels in the same pass.
    if [ -n "${NCU_DETAIL:-}" ]; then
        timeout 200 $NCU --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
            --section MemoryWorkloadAnalysis -k regex:"$NCU_DETAIL" --launch-count 3 $B/slipstream run --model $M \
            --prompt-tokens "$P64" --max-new 1 --backend cuda --resident > $W/ncu_detail.txt 2>&1
        grep -E "^  [a-z_]+|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Stall|Warp Cycles Per Issued|Issued Warp|L1/TEX Hit|L2 Hit" $W/ncu_detail.txt | head -80
    fi
fi
tar czf "$OUT/prefill.tgz" -C $W .
exit $fail
