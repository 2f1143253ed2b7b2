"""Expert load of short runs: per MoE layer, the busiest expert over the mean at step 1, its mean
over steps 20-60 and its maximum there (what tests/python/test_router_balance.py checks).

    python3 bench/load_table.py RUN_DIR_OR_METRICS_FILE...
"""

import gzip
import json
import sys
from pathlib import Path


def train_records(path: Path) -> dict[int, dict]:
    if path.is_dir():
        path = path / "metrics.jsonl"
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as lines:
        records = (json.loads(line) for line in lines)
        return {r["step"]: r for r in records if r["kind"] == "train"}


def main(paths: list[str]) -> None:
    print("| run | step 1 | mean, steps 20-60 | max, steps 20-60 |")
    print("| --- | --- | --- | --- |")
    for name in paths:
        records = train_records(Path(name))
        steps = [s for s in range(20, 61) if s in records]
        if not steps:
            print(f"| {name} | (no steps 20-60) | | |")
            continue
        loads = [records[s]["max_over_mean"] for s in steps]
        layers = range(len(loads[0]))
        mean = [sum(load[i] for load in loads) / len(loads) for i in layers]
        worst = [max(load[i] for load in loads) for i in layers]
        first = records.get(1, {}).get("max_over_mean", [])
        fmt = lambda values: " ".join(f"{v:.2f}" for v in values)  # noqa: E731
        print(f"| {name} | {fmt(first)} | {fmt(mean)} | {fmt(worst)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
