#!/usr/bin/env bash
# CUDA backend benchmark on a GPU machine (binaries from
# `scripts/cuda_device_test.sh build` in .devbin/):
# 1. HBM bandwidth (copy and read kernels) and each decode kernel's GB/s;
# 2. decode tok/s on the synthetic 35B model (generated here, ~19.5 GB):
#    fully resident in VRAM, and with a 4 GB VRAM budget over the RAM tier
#    and over the SSD (O_DIRECT, page cache dropped), misses per token;
# 3. GPU clocks sampled every 100 ms during the runs (does the SM clock drop
#    while the GPU waits for expert reads?).
# Results under $OUT: bench.txt, kernels.json, decode_*.log, clocks.csv.
#
#   device run(command="bash scripts/cuda_bench.sh run", carry=[".devbin"])
set -uo pipefail
cd "$(dirname "$0")/.."
B=.devbin
OUT=${OUT:-/tmp/cuda_out}
mkdir -p "$OUT"
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cuda_nvrtc", "lib") for p in nvidia.__path__))' 2>/dev/null); do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
NEW=${NEW:-64}
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu,power.draw --format=csv,noheader -lms 100 > "$OUT/clocks.csv" 2>/dev/null &
SMI=$!
mark() { echo "$(date +%Y/%m/%d\ %H:%M:%S.%3N), $*" >> "$OUT/marks.csv"; }

mark kernels
$B/cuda_bench --json "$OUT/kernels.json" 2>&1 | tee "$OUT/bench.txt"
# The experts' rows again with kernels strictly in turn (no programmatic
# dependent launch), for the ratio.
echo "--- experts, SLIPSTREAM_CUDA_PDL=0" | tee -a "$OUT/bench.txt"
SLIPSTREAM_CUDA_PDL=0 $B/cuda_bench --experts-only 2>&1 | tee -a "$OUT/bench.txt"

M=/tmp/m.slip
if [ ! -d $M ]; then
    t0=$(date +%s)
    $B/slipstream synth --preset qwen3.6-35b-a3b --output $M > "$OUT/synth.log" 2>&1 || { echo "synth failed"; tail "$OUT/synth.log"; }
    echo "synth: $(( $(date +%s) - t0 )) s, $(du -sh $M | cut -f1)" | tee -a "$OUT/bench.txt"
fi
decode() { # name, args...
    local name=$1; shift
    mark "$name"
    $B/slipstream run --model $M --prompt-tokens 1,2,3,4 --max-new $NEW --print-ids --backend cuda "$@" \
        --stats-json "$OUT/decode_$name.json" > /dev/null 2> "$OUT/decode_$name.log"
    echo "--- $name ($*)" | tee -a "$OUT/bench.txt"
    grep -h "^\[stats\]\|^\[cuda\]\|^\[backend\]\|rror" "$OUT/decode_$name.log" | tee -a "$OUT/bench.txt"
}
decode resident --resident
# The same without the CUDA graph per pass (each kernel launched on its own).
SLIPSTREAM_CUDA_GRAPH=0 decode resident_nograph --resident
# The same with kernels strictly in turn (no programmatic dependent launch).
SLIPSTREAM_CUDA_PDL=0 decode resident_nopdl --resident
# The same with the (opt-in) tensor-core 4-bit kernels.
SLIPSTREAM_CUDA_TC=1 decode resident_tc --resident
# The same with the host routing round trip per layer (device routing off).
SLIPSTREAM_CUDA_DEVICE_ROUTING=0 decode resident_host_routing --resident
# Prefill: a 512-token prompt, fully resident. Device routing runs it in
# passes of 64 tokens (and of 256); host routing (for the ratio) one token
# per pass.
P512=$(python3 -c "print(','.join(str(1 + (i * 7919) % 240000) for i in range(512)))")
prefill() { # name, args...
    local name=$1; shift
    mark "$name"
    $B/slipstream run --model $M --prompt-tokens "$P512" --max-new 16 --print-ids --backend cuda "$@" \
        > "$OUT/prefill_$name.ids" 2> "$OUT/prefill_$name.log"
    echo "--- $name ($*)" | tee -a "$OUT/bench.txt"
    grep -h "^\[stats\]\|^\[cuda\]\|rror" "$OUT/prefill_$name.log" | tee -a "$OUT/bench.txt"
}
prefill prefill512_resident --resident
SLIPSTREAM_CUDA_PASS_TOKENS=256 prefill prefill512_pass256 --resident
SLIPSTREAM_CUDA_DEVICE_ROUTING=0 prefill prefill512_one_token_passes --resident
cmp -s "$OUT/prefill_prefill512_resident.ids" "$OUT/prefill_prefill512_one_token_passes.ids" \
    && echo "prefill: generated tokens identical between 64-token and one-token passes" | tee -a "$OUT/bench.txt" \
    || echo "prefill: generated tokens differ between 64-token and one-token passes" | tee -a "$OUT/bench.txt"
decode vram4g_ram_pinned --resident --ram-cache-slots 256 --vram-budget 4G
decode vram4g_ram_pageable --resident --vram-budget 4G
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
decode vram4g_ssd --expert-cache-slots 8 --direct-io --io-threads 16 --vram-budget 4G
# The CPU backend on this machine's cores, for scale (fewer tokens).
mark cpu
$B/slipstream run --model $M --prompt-tokens 1,2,3,4 --max-new 16 --print-ids --backend cpu --resident \
    > /dev/null 2> "$OUT/decode_cpu.log"
echo "--- cpu (--resident, $(nproc) cores)" | tee -a "$OUT/bench.txt"
grep -h "^\[stats\]" "$OUT/decode_cpu.log" | tee -a "$OUT/bench.txt"
mark end
kill $SMI 2>/dev/null
python3 - "$OUT/clocks.csv" "$OUT/marks.csv" <<'PY' | tee -a "$OUT/bench.txt"
import sys, collections
rows = []
for line in open(sys.argv[1]):
    p = [x.strip() for x in line.split(",")]
    try: rows.append((p[0], float(p[1].split()[0]), float(p[3].split()[0])))
    except Exception: pass
marks = [tuple(x.strip() for x in l.split(",", 1)) for l in open(sys.argv[2])]
per = collections.OrderedDict()
for ts, sm, ut in rows:
    phase = "before"
    for mt, name in marks:
        if mt <= ts: phase = name
    per.setdefault(phase, []).append((sm, ut))
for ph, v in per.items():
    sm = sorted(x[0] for x in v); ut = [x[1] for x in v]
    print(f"clocks {ph}: {len(v)} samples, SM MHz min {sm[0]:.0f} median {sm[len(sm)//2]:.0f} max {sm[-1]:.0f}; util mean {sum(ut)/len(ut):.0f} %")
PY
