# Entry points; each one sets up what it needs first (scripts/setup.sh is idempotent).
.PHONY: setup train demo test test-cpp test-python bench gpu-check ep-run clean

setup:
	bash scripts/setup.sh

# The main job: the tiny MoE model on this Python's standard library, on the CPU.
train: setup
	.venv/bin/nodrop train

demo: setup
	.venv/bin/nodrop demo

test: setup test-cpp test-python

test-cpp:
	ctest --test-dir build/wheel --output-on-failure

# The editable install runs the repository's own Python files, from here as from anywhere. Two
# pytest workers (pytest-xdist): the suite is mostly XLA compiles, about one core each; on CI's
# 2 cores 12:35 against 22:15 in one process (2026-12-02). The multi-device tests, which start
# processes of their own, run in one. The CPU suites run on the CPU on every machine: on a GPU
# machine JAX would run them on the GPU, where their element-by-element checks of the CPU
# engine's arithmetic do not hold. The GPU suite (marker gpu, skipped without a GPU) checks the
# CUDA engine against the references on the GPU.
test-python:
	JAX_PLATFORMS=cpu .venv/bin/pytest -q -n 2 -m "not gpu" tests/python
	JAX_PLATFORMS=cpu .venv/bin/pytest -q tests/python/multidevice
	.venv/bin/pytest -q -m gpu tests/python

bench: setup
	.venv/bin/python bench/cpu_grouped_matmul.py --out bench/results

clean:
	rm -rf build .venv

# Expert-parallel training on every GPU of this host, or (under srun, one task per node) of
# every node: make ep-run ARGS="--preset mixtral --steps 200" (docs/scale-out.md).
ep-run:
	bash scripts/ep_run.sh $(ARGS)

# On a Hopper GPU machine: GPU tests, sanitizers and benchmarks into OUT (see scripts/gpu-check.sh).
gpu-check:
	bash scripts/gpu-check.sh $(OUT) $(BIN)
