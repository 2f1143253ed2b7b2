"""Picks main or variant from the A/B runs of nodrop_cuda_bench: medians per (shape, sizes, mode)."""
import collections, pathlib, statistics, sys

probe = pathlib.Path(sys.argv[1])
times = collections.defaultdict(list)  # (lib, shape, sizes, mode) -> [ms]
for f in sorted(probe.glob("*.md")):
    lib = f.stem.split("-", 1)[1]
    for line in f.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5 or cells[2] not in ("forward", "input grad", "weight grad"):
            continue
        times[(lib, cells[0], cells[1], cells[2])].append(float(cells[4]))
keys = sorted({k[1:] for k in times})
ratio = {}
for k in keys:
    m, v = statistics.median(times[("main",) + k]), statistics.median(times[("variant",) + k])
    ratio[k] = v / m
    print(f"{k[0]:22s} {k[1]:8s} {k[2]:12s} main {m:.4f} ms  variant {v:.4f} ms  variant/main {v / m:.4f}")
pairs = collections.defaultdict(lambda: [0.0, 0.0])
for k in keys:
    if k[2] != "weight grad":
        pairs[k[:2]][0] += statistics.median(times[("main",) + k])
        pairs[k[:2]][1] += statistics.median(times[("variant",) + k])
sums = {k: v / m for k, (m, v) in pairs.items()}
for k, r in sums.items():
    print(f"forward+input grad {k[0]} {k[1]}: variant/main {r:.4f}")
dsv3 = [r for k, r in sums.items() if k[0].startswith("DeepSeek-V3") and k[1] == "uniform"]
ok = dsv3 and dsv3[0] <= 0.99 and max(sums.values()) <= 1.005
print("rule: DeepSeek-V3 uniform forward+input grad at most 0.99x main, none above 1.005x")
print("variant" if ok else "main")
