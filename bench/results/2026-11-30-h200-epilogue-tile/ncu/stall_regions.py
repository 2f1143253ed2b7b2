# Warp-stall samples of an `ncu --page source --csv --print-source sass` export, summed per
# 1 KB of code, with the kinds of instructions in each: which part of the kernel the warps wait in.
import csv
import sys

rows = list(csv.reader(open(sys.argv[1])))
header, data = rows[1], rows[2:]
samples = header.index("Warp Stall Sampling (All Samples)")
source, executed = header.index("Source"), header.index("Instructions Executed")
total = sum(int(r[samples] or 0) for r in data)
NOTABLE = {"HGMMA", "BAR", "UTMASTG", "UTMALDG", "STSM", "LDG", "SYNCS", "FENCE", "F2FP", "ATOMG",
           "UTMACCTL", "UTMACMDFLUSH", "MEMBAR", "NANOSLEEP", "STS", "LDS"}
regions = {}
for r in data:
    words = r[source].split()
    op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else (words or [""])[0])
    region = regions.setdefault((int(r[0], 16) & 0xFFFFF) // 0x400, [0, 0, set()])
    region[0] += int(r[samples] or 0)
    region[1] = max(region[1], int(r[executed] or 0))
    if op.split(".")[0] in NOTABLE:
        region[2].add(op.split(".")[0])
print(f"{total} samples; regions with at least 0.3% of them:")
for key in sorted(regions):
    count, most, ops = regions[key]
    if count > 0.003 * total:
        print(f"  +{key * 0x400:05x}  {100 * count / total:5.1f}%  executed up to {most:>7}  {' '.join(sorted(ops))}")
