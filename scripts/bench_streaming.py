#!/usr/bin/env python3
"""Decode benchmark of the streaming expert store on one model.

Runs `slipstream run` once per configuration (slots x direct I/O), each in a
fresh process with the model files evicted from the page cache first (cold),
and prints one table: decode tok/s, misses/token, read wait/token, bytes
read/token, peak RSS against the predicted footprint. Standard library only.

    python3 scripts/bench_streaming.py --model /work/synth/qwen36-35b.slip \
        --slots 16,64,128 --max-new 256 --prompt-len 32
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def evict(model_dir):
    """Drop the model's files from the page cache (POSIX_FADV_DONTNEED)."""
    for name in os.listdir(model_dir):
        path = os.path.join(model_dir, name)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bin", default="target/release/slipstream")
    ap.add_argument("--slots", default="16,64,128")
    ap.add_argument("--direct-io", default="off,on", help="off, on or off,on")
    ap.add_argument("--policy", default="aging")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=248000)
    ap.add_argument("--json", help="write all results here")
    args = ap.parse_args()

    prompt = ",".join(str((i * 7919 + 13) % args.vocab) for i in range(args.prompt_len))
    rows = []
    for slots in [int(s) for s in args.slots.split(",")]:
        for dio in args.direct_io.split(","):
            evict(args.model)
            with tempfile.NamedTemporaryFile(suffix=".json") as stats:
                cmd = [args.bin, "run", "--model", args.model, "--prompt-tokens", prompt,
                       "--max-new", str(args.max_new), "--print-ids",
                       "--expert-cache-slots", str(slots), "--expert-cache-policy", args.policy,
                       "--stats-json", stats.name]
                if dio == "on":
                    cmd.append("--direct-io")
                load = os.getloadavg()[0]
                t = time.time()
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    sys.exit(f"failed: {' '.join(cmd)}\n{out.stderr}")
                j = json.load(open(stats.name))
            s, p = j["stats"], j["predicted_footprint"]
            predicted = sum(p.values())
            row = {
                "slots": slots, "direct_io": dio, "decode_tok_s": s["decode_tokens_per_s"],
                "misses_per_token": s["decode_misses_per_token"],
                "read_wait_ms_per_token": s["decode_read_wait_ms_per_token"],
                "mb_read_per_token": s["decode_bytes_read_per_token"] / 1e6,
                "ttft_s": s["time_to_first_token_s"], "peak_rss_gb": s["peak_rss_bytes"] / 1e9,
                "predicted_gb": predicted / 1e9, "load_avg_1m": load,
                "wall_s": time.time() - t, "command": " ".join(cmd),
            }
            rows.append(row)
            print(f"slots {slots:4d} direct-io {dio:3s}: {row['decode_tok_s']:.3f} tok/s, "
                  f"{row['misses_per_token']:.1f} misses/tok, {row['read_wait_ms_per_token']:.1f} ms wait/tok, "
                  f"{row['mb_read_per_token']:.1f} MB/tok, peak RSS {row['peak_rss_gb']:.2f} GB "
                  f"(predicted {row['predicted_gb']:.2f}, {100*(row['peak_rss_gb']/row['predicted_gb']-1):+.1f}%), "
                  f"load {load:.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
