"""Batch invariance of a trained model: a sequence's logits next to two different sets of
batch-mates, dropless and under capacity factors (the same weights). Prints a markdown table.

    python bench/batch_invariance.py RUN_DIR [--capacity-factors 1.0 1.25] [--batch-size 16]
"""

from __future__ import annotations

import argparse

from nodrop.train import invariance


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a `nodrop train` run folder with a checkpoint")
    parser.add_argument("--capacity-factors", type=float, nargs="+", default=[1.0, 1.25])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--probes", type=int, default=4, help="probe sequences")
    parser.add_argument("--seed", type=int, default=0, help="draws the batch-mates")
    args = parser.parse_args(argv)
    changes = invariance.measure(args.run_dir, capacity_factors=args.capacity_factors,
                                 batch_size=args.batch_size, probes=args.probes, seed=args.seed)
    print(invariance.table(changes), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
