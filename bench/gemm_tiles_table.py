"""Pivots `nodrop_cuda_bench --tiles=all --csv=FILE` into one row per case, one column per tile.

    python bench/gemm_tiles_table.py FILE.csv > FILE.md

Each cell is TFLOP/s; the automatic tile's cell is marked `*`, the fastest is bold, and the last
column says how far the automatic tile is from the fastest. Used to choose grouped_matmul_tile.
"""
import argparse
import csv
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="the benchmark's --csv output")
    args = parser.parse_args()
    with open(args.csv, newline="") as file:
        rows = list(csv.DictReader(file))
    if not rows:
        print(f"{args.csv}: no rows", file=sys.stderr)
        return 1

    cases: dict[tuple[str, str, str], dict[str, float]] = {}
    auto: dict[tuple[str, str, str], str] = {}
    tiles: list[str] = []
    for row in rows:
        case = (row["shape"], row["group_sizes"], row["mode"])
        tile = row["kernel"].removesuffix(" (auto)")
        if row["kernel"].endswith(" (auto)"):
            auto[case] = tile
        if tile not in tiles:
            tiles.append(tile)
        cases.setdefault(case, {})[tile] = float(row["tflops"])

    print("| shape | group sizes | mode | " + " | ".join(tiles) + " | auto / fastest |")
    print("| --- | --- | --- | " + " | ".join("---:" for _ in tiles) + " | ---: |")
    ratios = []
    for case, by_tile in cases.items():
        fastest = max(by_tile.values())
        cells = []
        for tile in tiles:
            value = by_tile.get(tile)
            cell = "" if value is None else f"{value:.0f}" + ("*" if auto.get(case) == tile else "")
            cells.append(f"**{cell}**" if value == fastest else cell)
        ratio = by_tile[auto[case]] / fastest if case in auto else float("nan")
        ratios.append(ratio)
        print(f"| {' | '.join(case)} | {' | '.join(cells)} | {ratio:.2f} |")
    known = [r for r in ratios if r == r]
    if known:
        print(f"\nThe automatic tile reaches {sum(known) / len(known):.3f} of the fastest on average "
              f"(worst {min(known):.2f}) over {len(known)} cases.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
