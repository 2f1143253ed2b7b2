"""Where a kernel's warps wait: Nsight Compute's warp-stall samples summed per 1 KB of code.

    ncu --section WarpStateStats --section SourceCounters -k regex:KERNEL ... -o REPORT PROGRAM
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > SASS.csv
    python bench/ncu_stall_regions.py SASS.csv

Prints each 1 KB region of the kernel's code that holds at least 0.3% of the samples, with the
most times any of its instructions ran and the notable instructions in it (HGMMA: the mainloop;
STSM, BAR, UTMASTG: an epilogue storing through shared memory; ...). Used in
bench/results/2026-11-30-h200-epilogue-tile/ (stall-regions-*.txt).
"""

from __future__ import annotations

import argparse
import csv

NOTABLE = {"HGMMA", "BAR", "UTMASTG", "UTMALDG", "STSM", "LDG", "SYNCS", "FENCE", "F2FP", "ATOMG",
           "UTMACCTL", "UTMACMDFLUSH", "MEMBAR", "NANOSLEEP", "STS", "LDS"}
REGION_BYTES = 0x400
MIN_SHARE = 0.003


def opcode(sass: str) -> str:
    """The instruction's opcode without modifiers or predicate: '@P0 BAR.SYNC 0x1' -> 'BAR'."""
    words = sass.split()
    if words and words[0].startswith("@") and len(words) > 1:
        words = words[1:]
    return (words or [""])[0].split(".")[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    args = parser.parse_args()
    with open(args.csv, newline="") as file:
        rows = list(csv.reader(file))
    header, data = rows[1], rows[2:]  # rows[0] names the kernel
    samples = header.index("Warp Stall Sampling (All Samples)")
    source, executed = header.index("Source"), header.index("Instructions Executed")
    total = sum(int(row[samples] or 0) for row in data)
    regions = {}  # region -> [samples, most executions, notable opcodes]
    for row in data:
        address = int(row[0], 16) & 0xFFFFF
        region = regions.setdefault(address // REGION_BYTES, [0, 0, set()])
        region[0] += int(row[samples] or 0)
        region[1] = max(region[1], int(row[executed] or 0))
        if opcode(row[source]) in NOTABLE:
            region[2].add(opcode(row[source]))
    print(f"{total} samples; regions with at least {MIN_SHARE:.1%} of them:")
    for key in sorted(regions):
        count, most, ops = regions[key]
        if count > MIN_SHARE * total:
            print(f"  +{key * REGION_BYTES:05x}  {100 * count / total:5.1f}%  executed up to "
                  f"{most:>7}  {' '.join(sorted(ops))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
