"""Expert load of short runs: per MoE layer, the busiest expert over the mean at step 1, its mean
over steps 20-60 and its maximum there (what tests/python/test_router_balance.py checks), and,
where the run evaluated, the same counted over all its validation batches at each evaluation.

    python3 bench/load_table.py RUN_DIR_OR_METRICS_FILE...
"""

import gzip
import json
import sys
from pathlib import Path


def records_of(path: Path, kind: str) -> dict[int, dict]:
    if path.is_dir():  # a run folder, as written or as committed (compressed)
        path = next((path / name for name in ("metrics.jsonl", "metrics.jsonl.gz")
                     if (path / name).exists()), path / "metrics.jsonl")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as lines:
        records = (json.loads(line) for line in lines)
        return {r["step"]: r for r in records if r["kind"] == kind}


def main(paths: list[str]) -> None:
    print("| run | step 1 | mean, steps 20-60 | max, steps 20-60 | validation (step: per layer) |")
    print("| --- | --- | --- | --- | --- |")
    fmt = lambda values: " ".join(f"{v:.2f}" for v in values)  # noqa: E731
    for name in paths:
        records = records_of(Path(name), "train")
        validation = "; ".join(f"{step}: {fmt(r['val_max_over_mean'])}" for step, r in sorted(
            records_of(Path(name), "eval").items()) if "val_max_over_mean" in r)
        steps = [s for s in range(20, 61) if s in records]
        if not steps:
            print(f"| {name} | (no steps 20-60) | | | {validation} |")
            continue
        loads = [records[s]["max_over_mean"] for s in steps]
        layers = range(len(loads[0]))
        mean = [sum(load[i] for load in loads) / len(loads) for i in layers]
        worst = [max(load[i] for load in loads) for i in layers]
        first = records.get(1, {}).get("max_over_mean", [])
        print(f"| {name} | {fmt(first)} | {fmt(mean)} | {fmt(worst)} | {validation} |")


if __name__ == "__main__":
    main(sys.argv[1:])
