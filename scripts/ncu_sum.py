"""Kernel time per kernel from `ncu --metrics gpu__time_duration.sum --csv`.

    python3 scripts/ncu_sum.py pass RUN.csv [TITLE]
        every kernel of one run, summed (top 14)
    python3 scripts/ncu_sum.py steps BASE.csv RUN.csv STEPS
        (RUN - BASE) / STEPS per kernel: one generated token's kernels when
        RUN generated STEPS tokens more than BASE
"""
import collections
import csv
import sys

SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def load(path):
    """(microseconds, launches) per kernel name."""
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    tot, cnt = collections.Counter(), collections.Counter()
    if not rows:
        return tot, cnt
    h = rows[0]
    ki, vi, ui = h.index("Kernel Name"), h.index("Metric Value"), h.index("Metric Unit")
    for r in rows[1:]:
        try:
            v = float(r[vi].replace(",", "")) * SCALE[r[ui]]
        except (ValueError, KeyError):
            continue
        name = r[ki].split("(")[0]
        tot[name] += v
        cnt[name] += 1
    return tot, cnt


def main(argv):
    if len(argv) >= 2 and argv[0] == "pass":
        tot, cnt = load(argv[1])
        s = sum(tot.values()) or 1.0
        title = argv[2] if len(argv) > 2 else "run"
        print(f"ncu, {title}: kernel time {s / 1000:.2f} ms")
        for n, v in tot.most_common(14):
            print(f"  {n}: {v / 1000:.2f} ms ({100 * v / s:.0f} %), {cnt[n]} launches")
        return 0
    if len(argv) == 4 and argv[0] == "steps":
        (t1, c1), (tn, cn), steps = load(argv[1]), load(argv[2]), int(argv[3])
        per = {k: (tn[k] - t1[k]) / steps for k in tn}
        launches = {k: (cn[k] - c1[k]) / steps for k in cn}
        s = sum(per.values()) or 1.0
        print(f"ncu, per generated token (average of {steps}): kernel time {s / 1000:.3f} ms, "
              f"{sum(launches.values()):.0f} launches")
        for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:18]:
            print(f"  {k}: {v:.1f} us ({100 * v / s:.0f} %), {launches[k]:.0f} launches, "
                  f"{v / max(launches[k], 1):.2f} us each")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
