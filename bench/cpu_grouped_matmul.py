"""CPU grouped-matmul benchmark (the logic lives in nodrop/bench.py; `nodrop bench` runs it too).

    python bench/cpu_grouped_matmul.py [--iters 20] [--out bench/results]
"""

from nodrop.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
