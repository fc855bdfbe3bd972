set -euo pipefail
cd /work/main
S=target/release/slipstream; G=/work/m80.gguf; L=$HOME/.cache/slipstream/llama.cpp/build/bin
O=/work/bench-big-80b/ra128
mkdir -p $O
echo 128 > /sys/block/vda/queue/read_ahead_kb
trap 'echo 8192 > /sys/block/vda/queue/read_ahead_kb' EXIT
common=(--model $G --gguf $G --peer llama.cpp=$L --slots none --prompt-lens 1024 --gen 64 --evict drop-caches --timeout-s 1500)
$S bench "${common[@]}" --peer-modes mmap --out $O/uncapped
$S bench "${common[@]}" --peer-modes mmap --memory-cap 16G --cap-runs capped --out $O/capped
reads() {
    sync; echo 3 > /proc/sys/vm/drop_caches
    /usr/bin/time -f "%I" -o "$O/llama_tg$1.time" "$L/llama-bench" -m "$G" -p 0 -n "$1" -t 2 -r 1 --no-warmup -lm mmap --repack 0 -o jsonl > "$O/llama_tg$1.jsonl" 2>/dev/null
    echo $(( $(tail -1 "$O/llama_tg$1.time") * 512 ))
}
a=$(reads 8); b=$(reads 40)
echo "read_ahead_kb 128: $a bytes for 8 tokens, $b for 40: $(( (b - a) / 32 / 1000000 )) MB per decoded token"
