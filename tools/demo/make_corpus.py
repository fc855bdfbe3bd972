#!/usr/bin/env python3
"""Regenerate tools/demo/corpus.txt from the Debian package bible-kjv-text.

    apt-get update && apt-get install -y bible-kjv bible-kjv-text
    bible -f "gen1:1-rev22:21" > /tmp/kjv_raw.txt
    python3 tools/demo/make_corpus.py /tmp/kjv_raw.txt

One verse per line (verse references stripped), a blank line between chapters.
"""
import re
import sys
from pathlib import Path

src = Path(sys.argv[1]).read_text(encoding="utf-8", errors="strict")
ref = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")
out, last = [], None
for line in src.splitlines():
    m = ref.match(line.strip())
    if not m:
        continue
    book, chap, _verse, text = m.groups()
    key = (book, chap)
    if last is not None and key != last:
        out.append("")
    last = key
    out.append(text.strip())
dst = Path(__file__).resolve().parent / "corpus.txt"
dst.write_text("\n".join(out) + "\n", encoding="utf-8")
print(f"wrote {dst} ({dst.stat().st_size} bytes, {sum(1 for l in out if l)} verses)")
