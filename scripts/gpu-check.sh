#!/usr/bin/env bash
# One round on a Hopper GPU machine: build (or take binaries built beforehand for sm_90a), run the
# CUDA engine's tests and the JAX ops' GPU tests, compute-sanitizer memcheck and racecheck on a
# small case of every kernel, and the benchmarks; everything lands in RESULTS_DIR (8 files).
#
#   scripts/gpu-check.sh RESULTS_DIR [BIN_DIR]
#
# BIN_DIR holds nodrop_cuda_tests, nodrop_cuda_moe_tests, nodrop_cuda_bench, nodrop_cuda_fp8_bench,
# nodrop_cuda_permute_bench, nodrop_cuda_adamw_bench and libnodrop_ffi_cuda.so; without it they
# are built into build/gpu (needs nvcc, CUTLASS in .cutlass/ or the nvidia-cutlass package,
# oneDNN and GoogleTest).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-check.sh RESULTS_DIR [BIN_DIR]}
bin=${2:-}
mkdir -p "$out"
status=()  # "step: result" lines for the summary
record() { status+=("$1: $([ "$2" -eq 0 ] && echo PASS || echo "FAIL (exit $2)")"); }

if [ -z "$bin" ]; then
  cmake -S . -B build/gpu -G Ninja -DNODROP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
    && cmake --build build/gpu -j"$(nproc)" || { echo "build failed" >&2; exit 1; }
  bin=build/gpu
fi
cp "$bin/libnodrop_ffi_cuda.so" nodrop/
# cuBLAS (the dense ceiling of the GEMM benchmark) may live in the Python packages only.
cublas=$(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${cublas:+$(dirname "$cublas"):}${LD_LIBRARY_PATH:-}
# nodrop from this tree, with the library copied above; bench/*.py find their shared modules
# (bench/shapes.py, timing.py, torch_peer.py) next to themselves.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python=$(command -v python3)

{ date -u +%Y-%m-%d; nvidia-smi -L; } > "$out/summary.md"

for t in nodrop_cuda_tests nodrop_cuda_moe_tests; do
  echo "== $t" >> "$out/tests.log"
  "$bin/$t" --gtest_brief=1 >> "$out/tests.log" 2>&1; record "$t" $?
done
# Command buffers on for custom calls, even for one-op graphs: replays must read new sizes.
echo "== pytest tests/python/test_gpu.py" >> "$out/tests.log"
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  "$python" -m pytest -q -p no:cacheprovider tests/python/test_gpu.py >> "$out/tests.log" 2>&1
record "pytest test_gpu.py (CUDA graphs on)" $?

small_gemm='CudaGroupedMatmulGraph.*:*/uneven_*bf16_bf16*:*/empty_groups_*f16_f32*:*/int32_extremes_*bf16_f32*:CudaFp8BlockwiseGraph.*:CudaFp8TensorwiseGraph.*:*/CudaFp8TensorwiseTest.*/mixed_*:CudaFp8ContractGraph.*:*/CudaFp8ContractTest.*/mixed_auto*:CudaFp8TensorwiseContractGraph.*:*/CudaFp8TensorwiseContractTest.*/mixed_*'
small_moe='*AdamWGpu*n1003*:*SortByExpert*uniform*:*RowMovers*odd_H*:*Arbitrary*:*Router*softmax_E8*:*RouterGrad*:*QuantizeFp8Gpu*bf16*:*QuantizeFp8TransposedGpu*bf16*:*PermuteRowsFp8Gpu*bf16*'
for tool in memcheck racecheck; do
  for pair in "nodrop_cuda_tests:$small_gemm" "nodrop_cuda_moe_tests:$small_moe"; do
    t=${pair%%:*}
    echo "== $tool $t" >> "$out/sanitizer.log"
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$bin/$t" --gtest_brief=1 \
      --gtest_filter="${pair#*:}" 2>&1 | tail -6 >> "$out/sanitizer.log"
    record "compute-sanitizer $tool $t" "${PIPESTATUS[0]}"
  done
done

"$bin/nodrop_cuda_bench" > "$out/gemm-bench.md" 2>&1; record "CUDA grouped GEMM benchmark" $?
# FP8 against bf16, a layer's three GEMMs with the quantisers, in the same file.
{ echo; "$bin/nodrop_cuda_fp8_bench" --mode=training; } >> "$out/gemm-bench.md" 2>&1
record "FP8 training benchmark" $?
"$bin/nodrop_cuda_permute_bench" > "$out/permute-bench.log" 2>&1; record "permute benchmark" $?
# The AdamW step against a copy, after the permute benchmark's log.
"$bin/nodrop_cuda_adamw_bench" >> "$out/permute-bench.log" 2>&1; record "AdamW benchmark" $?
"$python" bench/gpu_moe.py --out "$out" > /dev/null 2>> "$out/tests.log"
record "JAX benchmark against the peers (bench/gpu_moe.py)" $?

{ echo; printf '%s\n' "${status[@]/#/- }"; echo; cat "$out/gpu-moe.md" 2>/dev/null; } >> "$out/summary.md"
cat "$out/summary.md"
! grep -q FAIL <(printf '%s\n' "${status[@]}")
