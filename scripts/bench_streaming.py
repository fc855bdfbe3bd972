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
    ap.add_argument("--svg", help="draw decode tok/s and misses/token by slots here")
    ap.add_argument("--from-json", help="only draw the chart from an earlier --json")
    args = ap.parse_args()
    if args.from_json:
        rows = json.load(open(args.from_json))
        if args.svg:
            chart(rows, args.svg)
        return

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
    if args.svg:
        chart(rows, args.svg)


def chart(rows, path):
    """Two panels side by side: decode tok/s and misses/token against slots,
    one line per direct-I/O setting. Plain SVG, no dependencies."""
    w, h, pad = 380, 260, 50
    colors = {"off": "#1f77b4", "on": "#d62728"}
    slots = sorted({r["slots"] for r in rows})
    parts = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">' % (2 * w, h + 30)]
    for panel, (key, title) in enumerate([("decode_tok_s", "decode tok/s"), ("misses_per_token", "expert misses per token")]):
        x0 = panel * w
        top = max(r[key] for r in rows) * 1.15 or 1
        def px(i):
            return x0 + pad + i * (w - 2 * pad) / max(1, len(slots) - 1)
        def py(v):
            return h - pad + 10 - v / top * (h - 2 * pad)
        parts.append('<text x="%d" y="16" font-size="13">%s</text>' % (x0 + pad, title))
        parts.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#000"/>' % (x0 + pad, py(0), x0 + w - pad, py(0)))
        parts.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#000"/>' % (x0 + pad, py(0), x0 + pad, py(top)))
        for k in range(5):
            v = top * k / 4
            parts.append('<text x="%d" y="%d" text-anchor="end">%.1f</text>' % (x0 + pad - 4, py(v) + 4, v))
        for i, sl in enumerate(slots):
            parts.append('<text x="%d" y="%d" text-anchor="middle">%d</text>' % (px(i), py(0) + 14, sl))
        parts.append('<text x="%d" y="%d" text-anchor="middle">slots per layer</text>' % (x0 + w / 2, py(0) + 28))
        for dio, color in colors.items():
            pts = [(px(slots.index(r["slots"])), py(r[key])) for r in rows if r["direct_io"] == dio]
            if not pts:
                continue
            parts.append('<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>' % (color, " ".join("%.1f,%.1f" % p for p in pts)))
            for x, y in pts:
                parts.append('<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>' % (x, y, color))
    for j, (dio, color) in enumerate(colors.items()):
        parts.append('<text x="%d" y="%d" fill="%s">direct I/O %s</text>' % (pad + j * 120, h + 24, color, dio))
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


if __name__ == "__main__":
    main()
