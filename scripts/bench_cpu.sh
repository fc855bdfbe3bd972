#!/bin/bash
# CPU ceilings and model speed (issue 4): hwbench, decode at 16 / 64 slots and
# all resident, prefill of a 3072-token prompt, with the phase split.
# Usage: scripts/bench_cpu.sh [MODEL.slip] [SLIPSTREAM_BIN] [HWBENCH_BIN] [OUT_DIR]
# Defaults: /work/synth/qwen36-35b.slip (`slipstream synth --preset
# qwen3.6-35b-a3b`), target/release/slipstream, target/release/examples/hwbench
# (`cargo build --release -p slipstream-cli -p slipstream-hwbench --examples`).
# Every run goes through scripts/quiet.sh, which stops the machine's other
# processes for its duration (a shared 2-core box is otherwise too noisy).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
M=${1:-/work/synth/qwen36-35b.slip}; S=${2:-target/release/slipstream}; H=${3:-target/release/examples/hwbench}
B=${4:-/tmp/bench-cpu}; mkdir -p "$B"
Q="$HERE/quiet.sh"
P8=$(python3 -c "print(','.join(str((i*7919+13)%248000) for i in range(8)))")
P3K=$(python3 -c "print(','.join(str((i*7919+13)%248000) for i in range(3072)))")
evict() { python3 -c "
import os,sys
for f in sys.argv[1:]:
    fd=os.open(f,os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED); os.close(fd)" $M/experts.bin $M/dense.bin; }
echo "== commit $(git -C "$HERE" rev-parse --short HEAD 2>/dev/null) binary $S $(date -u)"
echo "== hwbench"; $Q $H gb=2 sustain=60 dir=$B json=$B/hwbench.json 2>/dev/null
for slots in 16 64; do
  evict; echo "== decode, $slots slots, direct I/O, 8-token prompt, 128 new"
  $Q $S run --model $M --prompt-tokens $P8 --max-new 128 --expert-cache-slots $slots --direct-io --phases --stats-json $B/dec$slots.json 2>&1 | grep -E "quiet|stats|experts|decode:"
done
echo "== decode, resident, 8-token prompt, 128 new"
$Q $S run --model $M --prompt-tokens $P8 --max-new 128 --resident --phases --stats-json $B/decres.json 2>&1 | grep -E "quiet|stats|experts|decode:"
echo "== prefill 3072 tokens, resident, one chunk"
$Q $S run --model $M --prompt-tokens $P3K --max-new 2 --resident --phases --prefill-chunk 4096 --stats-json $B/pf3k.json 2>&1 | grep -E "quiet|stats|experts|prefill:"
echo "== done $(date -u)"
